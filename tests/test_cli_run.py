"""The command line end to end: config files, checkpoints and kill-and-resume, outputs, bad input."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pydtnn import checkpoint
from pydtnn.cli import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--steps_per_epoch", "5", "--batch_size", "32", "--progress", "false"]


def cli(*args, timeout=300, check=True):
    r = subprocess.run([sys.executable, "-m", "pydtnn", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def final_of(path):
    return json.loads(open(path).read().splitlines()[-1])


def assert_user_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [s for s in r.stderr.splitlines() if s.startswith("pydtnn: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


# -- configuration ---------------------------------------------------------------------------
def test_config_file_layers_under_the_command_line(tmp_path):
    (tmp_path / "c.yaml").write_text("batch_size: 16\nnum-epochs: 3\nnesterov: true\nlr_schedulers: cosine,warm_up\n")
    a = parse_args(["--config", str(tmp_path / "c.yaml"), "--num_epochs", "7"])
    assert (a.batch_size, a.num_epochs, a.nesterov, a.lr_schedulers) == (16, 7, True, "cosine,warm_up")
    (tmp_path / "c.json").write_text(json.dumps({"learning_rate": 0.2, "optimizer": "adam"}))
    a = parse_args(["--config", str(tmp_path / "c.json")])
    assert a.learning_rate == 0.2 and a.optimizer == "adam"


@pytest.mark.parametrize(
    "text,words",
    [
        ("batch_sise: 3\n", ["unknown flag 'batch_sise'"]),
        ("batch_size: -1\n", ["batch_size", "an integer > 0"]),
        ("optimizer: adagrad\n", ["optimizer", "adagrad"]),
        ("[1, 2]\n", ["must map flag names"]),
        ("a: [\n", ["not valid YAML"]),
    ],
)
def test_bad_config_files(tmp_path, text, words):
    (tmp_path / "c.yaml").write_text(text)
    assert_user_error(cli("--config", tmp_path / "c.yaml", check=False), *words)


# -- checkpoints and resume ------------------------------------------------------------------------
RUN = ["--model", "simplecnn", "--num_epochs", "8", "--steps_per_epoch", "12", "--batch_size", "32",
       "--flip_images", "--crop_images", "--lr_schedulers", "cosine,reduce_lr_on_plateau",
       "--test_as_validation", "--progress", "false"]


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    cli(*RUN, "--checkpoint_dir", whole, "--metrics_file", tmp_path / "whole.jsonl")
    want = final_of(tmp_path / "whole.jsonl")["params_sha256"]

    proc = subprocess.Popen([sys.executable, "-m", "pydtnn", *RUN, "--checkpoint_dir", str(part)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    epoch = 0
    while time.time() < deadline and proc.poll() is None:
        try:
            epoch = checkpoint.read_meta(str(part))["epoch"]
        except Exception:  # not written yet
            epoch = 0
        if epoch >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = checkpoint.read_meta(str(part))["epoch"]
    assert 3 <= killed_at < 8

    r = cli("--resume", part, "--checkpoint_dir", part, "--metrics_file", tmp_path / "part.jsonl")
    assert f"after epoch {killed_at}" in r.stderr
    lines = [json.loads(s) for s in open(tmp_path / "part.jsonl").read().splitlines()]
    assert [x["epoch"] for x in lines[:-1]] == list(range(1, 9))  # earlier epochs kept in the metrics file
    assert lines[-1]["params_sha256"] == want
    whole_lines = [json.loads(s) for s in open(tmp_path / "whole.jsonl").read().splitlines()]
    assert [x["loss"] for x in lines[:-1]] == [x["loss"] for x in whole_lines[:-1]]
    assert json.load(open(part / "config.json"))["model"] == "simplecnn"


def test_resume_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_user_error(cli("--resume", tmp_path / "empty", *FAST, check=False), "not a pydtnn checkpoint")
    cli("--model", "simplemlp", "--num_epochs", "1", *FAST, "--checkpoint_dir", tmp_path / "mlp")
    r = cli("--weights_and_bias_filename", tmp_path / "mlp", "--model", "simplecnn", *FAST, check=False)
    assert_user_error(r)
    (tmp_path / "mlp" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    assert_user_error(cli("--resume", tmp_path / "mlp", *FAST, check=False))


def test_weights_file_reproduces_evaluation(tmp_path):
    cli("--num_epochs", "1", *FAST, "--checkpoint_dir", tmp_path / "ck", "--metrics_file", tmp_path / "a.jsonl")
    trained = final_of(tmp_path / "a.jsonl")
    cli("--evaluate_only", "--weights_and_bias_filename", tmp_path / "ck" / "model.safetensors",
        "--metrics_file", tmp_path / "b.jsonl", "--progress", "false")
    again = final_of(tmp_path / "b.jsonl")
    assert again["params_sha256"] == trained["params_sha256"]
    assert again["test_accuracy"] == pytest.approx(trained["test_accuracy"]) and again["samples_per_second"] > 0
    r = cli("--weights_and_bias_filename", tmp_path / "weights.npz", *FAST, check=False)
    assert_user_error(r, "weights.npz")


# -- outputs ---------------------------------------------------------------------------------
def test_history_plot_trace_and_profile(tmp_path):
    r = cli("--num_epochs", "2", *FAST, "--validation_split", "0.1", "--history_file", tmp_path / "h.csv",
            "--metrics_file", tmp_path / "m.jsonl", "--tracing", "--tracer_output", tmp_path / "t.json", "--evaluate")
    assert r.stdout.startswith("before training: ") and "% of steps" in r.stderr  # results on stdout
    rows = list(csv.DictReader(open(tmp_path / "h.csv")))
    assert [row["epoch"] for row in rows] == ["1", "2"] and float(rows[0]["val_loss"]) > 0
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    assert {"forward", "backward", "optimizer", "data"} <= {e.get("cat") for e in events}
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pydtnn-plot"), str(tmp_path / "m.jsonl"),
                          "-o", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.jsonl").write_text("not json\n")
    bad = subprocess.run([sys.executable, "-m", "pydtnn.plot", str(tmp_path / "bad.jsonl")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "bad.jsonl:1" in bad.stderr
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--num_epochs", "1", *FAST, "--profile"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "cumulative" in r.stderr and (tmp_path / "pydtnn.prof").exists()


def _gpus():
    from pydtnn.backends.gpu import gpu_status

    return gpu_status()[0]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--history_file", "/nonexistent/h.csv"], ["history file", "/nonexistent"]),
        (["--validation_split", "1.5"], ["--validation_split", "1.5"]),
        (["--lr_schedulers", "warmup"], ["unknown scheduler 'warmup'", "warm_up"]),
        (["--lr_schedulers", "reduce_lr_on_plateau"], ["val_loss", "--validation_split"]),
        (["--global_batch_size", "0"], ["--global_batch_size"]),
        pytest.param(["--enable_gpu"], ["GPU"],
                     marks=pytest.mark.skipif(_gpus() > 0, reason="a GPU is visible: --enable_gpu is no error here")),
        (["--enable_nccl"], ["--enable_nccl", "--enable_gpu"]),
        (["--tracing", "--tracer_output", "/nonexistent/t.json"], ["trace file", "/nonexistent"]),
        (["--model", "vgg16_imagenet"], ["larger than the padded input", "input shape"]),
    ],
)
def test_more_user_errors(args, words):
    assert_user_error(cli(*args, *FAST, "--num_epochs", "1", check=False), *words)


def _mnist_dir(path, images=None, labels=None, gz=True):
    from pydtnn.data import write_idx
    import numpy as np

    rng = np.random.default_rng(0)
    path.mkdir(exist_ok=True)
    for split, n in (("train", 64), ("t10k", 16)):
        ext = ".gz" if gz else ""
        write_idx(path / f"{split}-images-idx3-ubyte{ext}",
                  images if images is not None else rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(path / f"{split}-labels-idx1-ubyte{ext}",
                  labels if labels is not None else rng.integers(0, 10, n, dtype=np.uint8))
    return path


def _corrupt(kind, path):
    import numpy as np

    d = _mnist_dir(path)
    f = d / "train-images-idx3-ubyte.gz"
    if kind == "bad magic":
        import gzip

        f.write_bytes(gzip.compress(b"\x08\x08\x08\x03" + gzip.decompress(f.read_bytes())[4:]))
    elif kind == "wrong length":
        import gzip

        f.write_bytes(gzip.compress(gzip.decompress(f.read_bytes())[:-100]))
    elif kind == "bad gzip":
        f.write_bytes(f.read_bytes()[:40])
    elif kind == "label out of range":
        _mnist_dir(path, labels=np.full(64, 12, np.uint8))
    elif kind == "nan in data":
        d = path / "shards"
        d.mkdir()
        x = np.random.default_rng(0).random((8, 3, 28, 28)).astype(np.float32)
        x[3, 1, 2, 2] = np.nan
        for prefix in ("train", "val"):
            np.save(d / f"{prefix}_images_000.npy", x)
            np.save(d / f"{prefix}_labels_000.npy", np.arange(8) % 2)
        return ["--dataset", "imagenet", "--dataset_train_path", str(d)]
    return ["--dataset", "mnist", "--dataset_train_path", str(d)]


@pytest.mark.parametrize("kind,words", [
    ("bad magic", ["train-images-idx3-ubyte.gz", "magic"]),
    ("wrong length", ["train-images-idx3-ubyte.gz", "wrong length"]),
    ("bad gzip", ["train-images-idx3-ubyte.gz", "gzip"]),
    ("label out of range", ["label 12", "0..9"]),
    ("nan in data", ["NaN"]),
])
def test_bad_dataset_files_exit_2_and_leave_no_output(tmp_path, kind, words):
    args = _corrupt(kind, tmp_path / "data")
    out = tmp_path / "m.jsonl"
    r = cli(*args, "--model", "simplecnn", "--batch_size", "4", "--num_epochs", "1", "--metrics_file", out,
            "--checkpoint_dir", tmp_path / "ck", "--progress", "false", check=False)
    assert_user_error(r, *words)
    assert not out.exists() and not (tmp_path / "ck" / "model.safetensors").exists()
