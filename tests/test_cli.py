"""The command line: the main job, flag spellings, and user errors (exit 2, one line, no traceback)."""

import json
import os
import subprocess
import sys

import pytest

from pydtnn.cli import main, parse_args

BIN = os.path.dirname(sys.executable)


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pydtnn", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_main_job_reaches_95_percent_on_held_out_digits(tmp_path):
    """The README's main job, with its defaults: simplecnn on the embedded 5,000 digits."""
    metrics = tmp_path / "run.jsonl"
    assert main(["--model", "simplecnn", "--metrics_file", str(metrics), "--progress", "false"]) == 0
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert final["final"] is True
    assert final["test_accuracy"] >= 0.95, final


def test_console_script_and_module_are_the_same_program(tmp_path):
    script = os.path.join(BIN, "pydtnn-train")
    assert os.path.exists(script), "pip install -e . should install the pydtnn-train console script"
    common = ["--num_epochs", "1", "--steps_per_epoch", "3", "--progress", "false"]
    outs = []
    for cmd in ([script], [sys.executable, "-m", "pydtnn"], [sys.executable, "examples/train.py"]):
        f = tmp_path / f"{len(outs)}.jsonl"
        r = subprocess.run(cmd + common + ["--metrics_file", str(f)], capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(__file__)))
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(f.read_text().splitlines()[-1])["params_sha256"])
    assert outs[0] == outs[1] == outs[2]  # same program, same seed, same result


def test_flags_accept_dashes_and_pydtnn_booleans():
    a = parse_args(["--batch-size", "8", "--nesterov", "False", "--learning_rate", "0.1"])
    assert a.batch_size == 8 and a.nesterov is False and a.learning_rate == 0.1
    for text, want in (("true", True), ("1", True), ("YES", True), ("no", False), ("0", False)):
        assert parse_args(["--nesterov", text]).nesterov is want
    assert parse_args(["--nesterov"]).nesterov is True
    assert parse_args([]).nesterov is False


@pytest.mark.parametrize(
    "args,words",
    [
        (["--model", "resnet9000"], ["unknown model 'resnet9000'", "simplecnn"]),
        (["--dataset", "imagenet22k"], ["unknown dataset", "mnist5k"]),
        (["--batch_size", "0"], ["--batch_size", "an integer > 0", "'0'"]),
        (["--batch_size", "-3"], ["--batch_size", "an integer > 0"]),
        (["--learning_rate", "fast"], ["--learning_rate", "'fast'"]),
        (["--nesterov", "maybe"], ["--nesterov", "'maybe'"]),
        (["--no_such_flag", "1"], ["--no_such_flag"]),
        (["--dataset", "mnist"], ["dataset_train_path"]),
        (["--dataset", "mnist", "--dataset_train_path", "/nonexistent"], ["/nonexistent", "train-images-idx3-ubyte"]),
        (["--metrics_file", "/nonexistent/dir/m.jsonl"], ["cannot write metrics file", "/nonexistent/dir/m.jsonl"]),
        (["--learning_rate", "1e30", "--num_epochs", "2"], ["loss is", "try a smaller learning rate"]),
    ],
)
def test_user_errors_exit_2_with_one_line(args, words):
    r = run_cli(*args, "--progress", "false")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err_lines = [line for line in r.stderr.splitlines() if line.startswith("pydtnn: error:")]
    assert len(err_lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in err_lines[0], (w, err_lines[0])


def test_bad_dataset_file_leaves_no_metrics_file(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x01\x00")
    out = tmp_path / "m.jsonl"
    r = run_cli("--dataset", "mnist", "--dataset_train_path", str(tmp_path), "--metrics_file", str(out))
    assert r.returncode == 2 and "pydtnn: error:" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_help_and_list_models():
    r = run_cli("--help")
    assert r.returncode == 0 and "--batch_size" in r.stdout and "--learning_rate" in r.stdout
    r = run_cli("--list_models")
    assert r.returncode == 0 and "simplecnn" in r.stdout.split()


def test_cli_reference_is_current(tmp_path):
    """docs/cli.md is generated from the parser: regenerate it and compare, so no flag goes undocumented."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("make_cli_doc", os.path.join(root, "docs", "make_cli_doc.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fresh = mod.main(str(tmp_path / "cli.md"))
    with open(fresh) as a, open(os.path.join(root, "docs", "cli.md")) as b:
        assert a.read() == b.read(), "docs/cli.md is stale: run python docs/make_cli_doc.py"
    text = open(fresh).read()
    for flag in ("--batch_size", "--global_batch_size", "--lr_schedulers", "--resume", "--config", "--tracing",
                 "--profile", "--non_blocking_mpi", "--enable_nccl", "--test_as_validation", "--history_file"):
        assert f"`{flag}`" in text, flag


def _fresh(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_run_does_not_import_the_command_line():
    """cli.py uses run.py, never the reverse: run.py imports alone in a fresh interpreter and resolves a
    run's optimizer options without loading cli.py, and cli.py imports alone and builds its parser."""
    assert _fresh("import sys, types\n"
                  "from pydtnn import run\n"
                  "args = types.SimpleNamespace(optimizer='adam', learning_rate=None, decay=None, beta1=0.9,"
                  " beta2=0.999, epsilon=1e-8)\n"
                  "assert run.optimizer_options(args, 'simplecnn')['lr'] == 0.001\n"
                  "print('pydtnn.cli' in sys.modules)") == ["False"]
    assert _fresh("from pydtnn import cli\nprint(cli.build_parser().prog)") == ["pydtnn"]


def test_library_errors_name_parameters_and_the_command_line_names_flags(capsys):
    """data.load tells a Python caller its parameters (train_path=DIR, download=True); the same
    mistakes made at the command line are told in flags (--dataset_train_path DIR, --download)."""
    from pydtnn import data
    from pydtnn.errors import ConfigError

    with pytest.raises(ConfigError) as e:  # no copy in the (empty) data directory
        data.load("cifar10")
    assert "pass download=True to fetch it" in str(e.value) and "or train_path=DIR holding" in str(e.value)
    assert "--" not in str(e.value)
    with pytest.raises(ConfigError, match="validation_split=0.2 and test_as_validation=True are exclusive"):
        data.resolve_validation(None, None, 0.2, True)

    for argv, words in ((["--dataset", "cifar10"], ["pass --download to fetch it", "or --dataset_train_path DIR holding"]),
                        (["--validation_split", "0.2", "--test_as_validation"],
                         ["--validation_split 0.2 and --test_as_validation are exclusive"])):
        assert main([*argv, "--progress", "false"]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
        assert "train_path=" not in err and "=True" not in err and "validation_split=" not in err, err


def test_micro_batches_is_the_accumulation_steps_flag():
    """--micro_batches M (the name pipelines use) splits each step into M micro-batches, as --accumulation_steps."""
    assert parse_args(["--micro_batches", "4"]).accumulation_steps == 4
    assert parse_args(["--micro-batches", "3"]).accumulation_steps == 3
    assert parse_args(["--accumulation_steps", "2"]).accumulation_steps == 2
