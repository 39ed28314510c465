"""What a run guarantees when things go wrong: no hang on a hostile file, nothing written before every
check has passed, no checkpoint overwritten unasked, resume continues where the checkpoint now is."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--num_epochs", "1", "--steps_per_epoch", "3", "--batch_size", "16", "--progress", "false"]


def cli(*args, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, "-m", "pydtnn", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def assert_user_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [s for s in r.stderr.splitlines() if s.startswith("pydtnn: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


# -- hostile configuration files -----------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("kind", ["fifo", "dev_zero_link", "directory"])
def test_a_config_path_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    path = tmp_path / "run.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero_link":
        os.symlink("/dev/zero", path)
    else:
        path.mkdir()
    r = cli("--config", path, *FAST, timeout=30)  # blocked forever in open() or read until memory ran out
    assert_user_error(r, str(path), "expected a regular file")


def test_a_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path):
    """1.4 KB of nested aliases stands for 9**9 strings; str() of it never ended."""
    lines = ['model: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghij"
    for prev, cur in zip(names, names[1:]):
        lines.append(f"{cur}: &{cur} [{', '.join(['*' + prev] * 9)}]")
    text = "\n".join(lines[:1]) + "\n" + "batch_size: [" + ", ".join(
        f"&{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip(names, names[1:])) + "]\n"
    (tmp_path / "bomb.yaml").write_text(text)
    assert len(text) < 2000
    r = cli("--config", tmp_path / "bomb.yaml", *FAST, timeout=30)
    assert_user_error(r, "expected a single value", "list")


def test_deeply_nested_json_config_is_one_line(tmp_path):
    (tmp_path / "deep.json").write_text('{"batch_size": ' + "[" * 100000 + "]" * 100000 + "}")
    assert_user_error(cli("--config", tmp_path / "deep.json", *FAST, timeout=30), "deep.json")


@pytest.mark.parametrize("args,words", [
    (["--seed", "-1"], ["--seed", "'-1'"]),
    (["--momentum", "5"], ["--momentum", "'5'", "[0.0, 1.0)"]),
])
def test_flag_values_that_used_to_end_in_a_traceback(args, words):
    assert_user_error(cli(*args, *FAST), *words)


# -- validated before the first byte is written ----------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--metrics_file", "{tmp}"], ["cannot write metrics file", "is a directory"]),
    (["--lr_schedulers", "reduce_lr_on_plateau", "--reduce_lr_on_plateau_metric", "val_los",
      "--validation_split", "0.1"], ["reduce_lr_on_plateau monitors 'val_los'"]),
    (["--lr_schedulers", "early_stopping"], ["early_stopping monitors 'val_loss'", "--validation_split"]),
    (["--evaluate_only", "--checkpoint_dir", "{tmp}/ck"], ["--evaluate_only", "--checkpoint_dir"]),
    (["--history_file", "{tmp}"], ["cannot write history file", "is a directory"]),
    (["--drop_last", "--dataset", "synthetic", "--model", "simplemlp", "--batch_size", "20000"],
     ["drop_last", "leaves no batch"]),
])
def test_every_check_runs_before_anything_is_written(tmp_path, args, words):
    out = tmp_path / "out"
    out.mkdir()
    args = [a.replace("{tmp}", str(out)) for a in args]
    r = cli(*FAST, "--checkpoint_dir", out / "run", "--metrics_file", out / "m.jsonl", *args)
    assert_user_error(r, *words)
    assert os.listdir(out) == [], os.listdir(out)  # no config.json, no metrics, no checkpoint


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_output_path_that_is_a_fifo_is_refused_before_training(tmp_path):
    os.mkfifo(tmp_path / "m.jsonl")
    assert_user_error(cli(*FAST, "--metrics_file", tmp_path / "m.jsonl", timeout=60), "FIFO")


# -- checkpoints: never overwritten unasked, resume continues in the directory given ----------------
@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One epoch into ckpt/, with the metrics and history files inside it, run from another directory."""
    base = tmp_path_factory.mktemp("resume")
    r = cli(*FAST, "--num_epochs", "1", "--checkpoint_dir", "ckpt", "--metrics_file", "ckpt/m.jsonl",
            "--history_file", "ckpt/h.csv", cwd=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


def test_a_fresh_run_never_overwrites_a_checkpoint(first_run, tmp_path):
    shutil.copytree(first_run / "ckpt", tmp_path / "ckpt")
    before = {n: (tmp_path / "ckpt" / n).read_bytes() for n in os.listdir(tmp_path / "ckpt")}
    r = cli(*FAST, "--checkpoint_dir", tmp_path / "ckpt", "--seed", "5")
    assert_user_error(r, str(tmp_path / "ckpt"), "already holds a checkpoint", "--resume", "--overwrite")
    assert {n: (tmp_path / "ckpt" / n).read_bytes() for n in os.listdir(tmp_path / "ckpt")} == before
    r = cli(*FAST, "--checkpoint_dir", tmp_path / "ckpt", "--seed", "5", "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["meta"]["config"]["seed"] == 5


def test_config_json_comes_with_the_first_checkpoint(tmp_path):
    r = cli(*FAST, "--checkpoint_dir", tmp_path / "ck", "--learning_rate", "1e30", "--num_epochs", "2")
    assert_user_error(r, "loss is")
    assert not (tmp_path / "ck").exists()  # it used to hold a config.json disagreeing with no meta.json
    r = cli(*FAST, "--checkpoint_dir", tmp_path / "ck")
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    effective = config.pop("effective")  # the values computed from the flags, next to the flags
    assert effective["learning_rate"] == 0.05 and config["learning_rate"] is None
    assert config == json.loads((tmp_path / "ck" / "meta.json").read_text())["meta"]["config"]


def test_resume_continues_in_the_directory_it_is_given(first_run, tmp_path):
    """mv a b; --resume b from another working directory: checkpoints, metrics and history go on in b;
    a/ is not re-created, and a later --resume b continues from b's newer epoch."""
    moved = tmp_path / "moved"
    shutil.copytree(first_run / "ckpt", moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli("--resume", moved, "--num_epochs", "2", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.listdir(elsewhere) == []  # nothing re-created relative to the new working directory
    meta = json.loads((moved / "meta.json").read_text())["meta"]
    assert meta["epoch"] == 2 and meta["config"]["checkpoint_dir"] == str(moved)
    assert [json.loads(s).get("epoch") for s in (moved / "m.jsonl").read_text().splitlines()] == [1, 2, None]
    assert len((moved / "h.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert (first_run / "ckpt" / "m.jsonl").read_text().count("\n") == 2  # the original is untouched
    r = cli("--resume", moved, "--num_epochs", "3", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "after epoch 2" in r.stderr
    assert json.loads((moved / "meta.json").read_text())["meta"]["epoch"] == 3


def test_resume_into_another_directory_when_asked(first_run, tmp_path):
    """A fork: checkpoints and the outputs that lived in the checkpoint directory go to the new one."""
    before = {n: (first_run / "ckpt" / n).read_bytes() for n in os.listdir(first_run / "ckpt")}
    r = cli("--resume", first_run / "ckpt", "--num_epochs", "2", "--checkpoint_dir", tmp_path / "fork")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "fork" / "meta.json").read_text())["meta"]["epoch"] == 2
    assert [json.loads(s).get("epoch") for s in (tmp_path / "fork" / "m.jsonl").read_text().splitlines()] == [1, 2, None]
    assert {n: (first_run / "ckpt" / n).read_bytes() for n in os.listdir(first_run / "ckpt")} == before


def test_evaluating_a_checkpoint_leaves_its_metrics_alone(first_run, tmp_path):
    shutil.copytree(first_run / "ckpt", tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "m.jsonl").read_text()
    r = cli("--resume", tmp_path / "ckpt", "--evaluate_only", "--progress", "false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test_accuracy" in r.stdout
    assert (tmp_path / "ckpt" / "m.jsonl").read_text() == before


def test_a_checkpoint_dir_below_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = cli(*FAST, "--checkpoint_dir", tmp_path / "afile" / "ck", "--metrics_file", tmp_path / "m.jsonl")
    assert_user_error(r, "cannot write checkpoint directory", "afile")
    assert not (tmp_path / "m.jsonl").exists()


def test_a_nul_character_in_a_config_value_is_one_line(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"metrics_file": "m\u0000.jsonl"}))
    assert_user_error(cli("--config", tmp_path / "c.json", *FAST), "metrics_file", "NUL")


# -- nothing to train on --------------------------------------------------------------------------
def test_the_trainer_refuses_an_empty_training_set_and_mismatched_shapes():
    import numpy as np

    from pydtnn import models
    from pydtnn.data import ArrayDataset
    from pydtnn.errors import DataError
    from pydtnn.losses import SoftmaxCrossEntropy
    from pydtnn.optim import SGD
    from pydtnn.trainer import Trainer

    model = models.create("simplemlp", input_shape=(1, 4, 4), num_classes=3)
    t = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.1), progress=False)
    empty = ArrayDataset(np.zeros((0, 1, 4, 4), np.float32), np.zeros(0, np.int64), 3)
    with pytest.raises(DataError, match="training set .*is empty"):
        t.fit(empty, epochs=1, batch_size=4)
    train = ArrayDataset(np.zeros((8, 1, 4, 4), np.float32), np.zeros(8, np.int64), 3, name="small")
    other = ArrayDataset(np.zeros((8, 1, 5, 5), np.float32), np.zeros(8, np.int64), 3, name="bigger")
    with pytest.raises(DataError, match=r"test set bigger has samples of shape \(1, 5, 5\); the model takes \(1, 4, 4\)"):
        t.fit(train, epochs=1, batch_size=4, test=other)
    assert t.history == []
