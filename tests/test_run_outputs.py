"""No run writes over what it reads: every output is compared with every input, every other output and
the checkpoint's own files before anything runs; devices are never replaced; a checkpoint cannot send a
resumed run's writes elsewhere; an output that would fail at the end of epoch 1 is refused at the start."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from pydtnn import files
from pydtnn.data import source_folders
from pydtnn.errors import ConfigError
from test_run_safety import assert_user_error as one_error_line
from test_run_safety import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--model", "simplemlp", "--num_epochs", "1", "--steps_per_epoch", "2", "--batch_size", "16",
        "--progress", "false"]


def assert_user_error(r, *words):
    one_error_line(r, *words)
    assert "epoch 1:" not in r.stdout  # refused before any training


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names}


@pytest.fixture
def digits(tmp_path):
    """A copy of the embedded digits, given as --dataset_train_path."""
    (folder,) = source_folders("mnist5k")
    shutil.copytree(folder, tmp_path / "digits")
    return tmp_path / "digits"


# -- 1. an output that names an input, another output or the checkpoint's own files --------------------------
def test_a_metrics_file_naming_the_training_images_is_refused(digits):
    images = next(p for p in sorted(os.listdir(digits)) if p.startswith("train-images"))
    before = snapshot(digits)
    r = cli(*FAST, "--dataset_train_path", digits, "--metrics_file", digits / images)
    assert_user_error(r, "metrics file", images, "data file")
    assert snapshot(digits) == before


def test_other_files_beside_the_data_stay_the_users_to_write(digits):
    """Only the files the loader reads are inputs: a run writing its metrics into the data folder runs again."""
    for _ in range(2):
        r = cli(*FAST, "--dataset_train_path", digits, "--metrics_file", digits / "m.jsonl")
        assert r.returncode == 0, r.stderr[-3000:]


def test_a_temporary_name_that_is_an_input_is_refused(tmp_path):
    """--history_file h with --config h.tmp: writing h first removes h.tmp."""
    (tmp_path / "h.tmp").write_text("batch_size: 16\n")
    assert_user_error(cli(*FAST, "--config", tmp_path / "h.tmp", "--history_file", tmp_path / "h"),
                      "history file's temporary name", "config file")


def test_an_output_through_a_link_to_the_data_is_refused(digits, tmp_path):
    images = next(p for p in sorted(os.listdir(digits)) if p.startswith("train-images"))
    os.symlink(digits / images, tmp_path / "soft.csv")
    os.link(digits / images, tmp_path / "hard.csv")
    before = snapshot(digits)
    for link in ("soft.csv", "hard.csv"):
        r = cli(*FAST, "--dataset_train_path", digits, "--history_file", tmp_path / link)
        assert_user_error(r, "history file", "data file")
    assert snapshot(digits) == before


@pytest.mark.parametrize("case", ["history_is_config", "metrics_is_history", "metrics_in_checkpoint",
                                  "trace_is_config_json", "metrics_is_resumed_meta"])
def test_outputs_that_collide_with_inputs_or_each_other_are_refused(tmp_path, case):
    config = tmp_path / "run.yaml"
    config.write_text("batch_size: 16\n")
    ck = tmp_path / "ck"
    if case == "metrics_is_resumed_meta":
        assert cli(*FAST, "--checkpoint_dir", ck).returncode == 0
    before = snapshot(tmp_path)
    argv, words = {
        "history_is_config": (["--config", config, "--history_file", config], ["history file", "config file"]),
        "metrics_is_history": (["--metrics_file", tmp_path / "m", "--history_file", tmp_path / "m"],
                               ["history file", "metrics file"]),
        "metrics_in_checkpoint": (["--checkpoint_dir", ck, "--metrics_file", ck / "model.safetensors"],
                                  ["metrics file", "checkpoint file"]),
        "trace_is_config_json": (["--checkpoint_dir", ck, "--tracing", "--tracer_output", ck / "config.json"],
                                 ["trace file", "checkpoint file"]),
        "metrics_is_resumed_meta": (["--resume", ck, "--num_epochs", "2", "--metrics_file", ck / "meta.json"],
                                    ["metrics file", "meta.json"]),
    }[case]
    assert_user_error(cli(*FAST, *argv), *words)
    assert snapshot(tmp_path) == before


def test_outputs_inside_the_checkpoint_directory_and_a_resumed_checkpoint_still_work(tmp_path):
    ck = tmp_path / "ck"
    r = cli(*FAST, "--checkpoint_dir", ck, "--metrics_file", ck / "m.jsonl", "--history_file", ck / "h.csv")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("--resume", ck, "--num_epochs", "2", "--config", ck / "config.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((ck / "meta.json").read_text())["meta"]["epoch"] == 2


def test_check_distinct_names_both_paths_and_compares_files_not_names(tmp_path):
    (tmp_path / "a").write_text("x")
    os.link(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ConfigError, match=r"out .*/b is the source .*/a this command reads"):
        files.check_distinct([("out", tmp_path / "b")], [("source", tmp_path / "a")])
    with pytest.raises(ConfigError, match="each output needs a path of its own"):
        files.check_distinct([("one", tmp_path / "new"), ("two", tmp_path / "." / "new")])
    files.check_distinct([("out", tmp_path / "new")], [("source", tmp_path / "a")], [("data", tmp_path)])
    with pytest.raises(ConfigError, match="is a file of the data"):
        files.check_distinct([("out", tmp_path / "a")], folders=[("data", tmp_path)])


# -- 2. devices and other non-regular files are never replaced ------------------------------------------------
def test_write_atomic_never_replaces_a_fifo_or_a_directory(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    for name, kind in (("pipe", "FIFO"), ("dir", "directory")):
        with pytest.raises(ConfigError, match=kind):
            files.write_atomic(tmp_path / name, b"data")
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode) and (tmp_path / "dir").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["dir", "pipe"]


def _null_device(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here: {e}")


def test_a_character_device_named_as_an_output_stays_a_device(tmp_path):
    _null_device(tmp_path / "null")
    with pytest.raises(ConfigError, match="character device"):
        files.write_atomic(tmp_path / "null", b"data")
    for flag in ("--history_file", "--metrics_file"):
        assert_user_error(cli(*FAST, flag, tmp_path / "null"), "character device")
    assert stat.S_ISCHR(os.stat(tmp_path / "null").st_mode)


def test_write_atomic_makes_no_folder_unless_asked(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        files.write_atomic(tmp_path / "a" / "b" / "f", b"x")
    assert os.listdir(tmp_path) == []
    files.write_atomic(tmp_path / "a" / "f", b"x", make_folder=True)
    assert (tmp_path / "a" / "f").read_bytes() == b"x"


# -- 3. a checkpoint's paths never decide where a resumed run writes -------------------------------------------
def test_an_edited_checkpoint_cannot_redirect_the_resumed_runs_outputs(tmp_path):
    ck, victim = tmp_path / "ck", tmp_path / "precious.txt"
    r = cli(*FAST, "--checkpoint_dir", ck, "--metrics_file", ck / "m.jsonl")
    assert r.returncode == 0, r.stderr[-3000:]
    victim.write_text("keep me")
    meta = json.loads((ck / "meta.json").read_text())
    meta["meta"]["config"].update(history_file=str(victim), tracer_output=str(victim), tracing=True)
    (ck / "meta.json").write_text(json.dumps(meta))
    r = cli("--resume", ck, "--num_epochs", "2", cwd=tmp_path)  # the trace goes back to its default, here
    assert r.returncode == 0, r.stderr[-3000:]
    assert victim.read_text() == "keep me" and (tmp_path / "pydtnn-trace.json").is_file()
    assert f"the checkpoint's --history_file {victim} lies outside it and is not written again" in r.stderr
    assert [json.loads(s).get("epoch") for s in (ck / "m.jsonl").read_text().splitlines()] == [1, 2, None]


def test_a_link_in_the_checkpoint_cannot_lead_a_resumed_runs_outputs_out_of_it(tmp_path):
    """ck/m.jsonl and ck/sub are links to files and folders outside: the saved paths are inside the checkpoint
    by their names, not once the links are resolved."""
    ck, outside = tmp_path / "ck", tmp_path / "outside"
    outside.mkdir()
    r = cli(*FAST, "--checkpoint_dir", ck, "--metrics_file", ck / "m.jsonl", "--history_file", ck / "sub" / "h.csv")
    assert r.returncode == 0, r.stderr[-3000:]
    (outside / "keys").write_text("precious")
    (outside / "h.csv").write_text("precious too")
    (ck / "m.jsonl").unlink()
    os.symlink(outside / "keys", ck / "m.jsonl")
    shutil.rmtree(ck / "sub")
    os.symlink(outside, ck / "sub")
    r = cli("--resume", ck, "--num_epochs", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (outside / "keys").read_text() == "precious" and (outside / "h.csv").read_text() == "precious too"
    assert "the checkpoint's --metrics_file" in r.stderr and "the checkpoint's --history_file" in r.stderr


# -- 9. what would fail at the end of epoch 1 fails at the start ------------------------------------------------
def test_a_file_name_too_long_for_its_temporary_name_is_refused_at_the_start(tmp_path):
    name = "h" * 250 + ".csv"  # 254 bytes: the file fits, its temporary name (+ .tmp) does not
    assert_user_error(cli(*FAST, "--history_file", tmp_path / name), "history file", "temporary suffix")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("blocked", ["model.safetensors.tmp", "config.json", "meta.json.tmp"])
def test_a_directory_where_a_checkpoint_file_goes_is_refused_at_the_start(tmp_path, blocked):
    (tmp_path / "ck" / blocked).mkdir(parents=True)
    assert_user_error(cli(*FAST, "--checkpoint_dir", tmp_path / "ck"), "cannot write checkpoint", blocked)
    assert os.listdir(tmp_path / "ck") == [blocked]


def test_a_directory_at_an_outputs_temporary_name_is_refused_at_the_start(tmp_path):
    (tmp_path / "h.csv.tmp").mkdir()
    assert_user_error(cli(*FAST, "--history_file", tmp_path / "h.csv"), "h.csv.tmp", "is a directory")


# -- 8. a disk that takes no more bytes: one line, and the records written so far stay whole --------------------
def test_a_metrics_file_that_cannot_grow_is_one_line(tmp_path):
    import resource

    def small_files():  # a file size limit: a write past 600 bytes fails as on a full disk (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))

    r = subprocess.run([sys.executable, "-m", "pydtnn", *FAST, "--num_epochs", "3", "--metrics_file",
                        tmp_path / "m.jsonl"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       preexec_fn=small_files, env={**os.environ, "PYDTNN_CPU_KERNELS": "numpy"})
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith(
        f"pydtnn: error: cannot write metrics file {tmp_path / 'm.jsonl'}: File too large"), r.stderr[-2000:]
    whole = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(s)["epoch"] for s in whole[:-1]] == list(range(1, len(whole)))


def test_a_checkpoint_directory_name_too_long_is_refused_at_the_start(tmp_path):
    assert_user_error(cli(*FAST, "--checkpoint_dir", tmp_path / ("c" * 300)), "folder name", "300 bytes")
    assert os.listdir(tmp_path) == []


def test_checkpoint_save_never_replaces_a_fifo_with_a_file(tmp_path):
    """The library's own save (no command line checked it first) refuses a non-regular file too."""
    from pydtnn import checkpoint, models

    (tmp_path / "ck").mkdir()
    os.mkfifo(tmp_path / "ck" / "meta.json")
    with pytest.raises(ConfigError, match="meta.json: it is a FIFO"):
        checkpoint.save(tmp_path / "ck", models.create("simplemlp", input_shape=(1, 4, 4), num_classes=3))
    assert stat.S_ISFIFO(os.stat(tmp_path / "ck" / "meta.json").st_mode)
    assert sorted(os.listdir(tmp_path / "ck")) == ["meta.json"]
