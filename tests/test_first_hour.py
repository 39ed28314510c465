"""A new user's first hour at the command line: family names, the header, the saved configuration,
output without a terminal, --list_models, "did you mean", the compile notice."""

import json
import os
import subprocess
import sys

import pytest

from pydtnn.cli import parse_args
from pydtnn.errors import ConfigError
from test_cli_run import assert_user_error as one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
QUICK = ["--num_epochs", "1", "--steps_per_epoch", "2", "--batch_size", "8"]


def cli(*args, timeout=300, env=None, launcher=()):
    return subprocess.run([*launcher, sys.executable, "-m", "pydtnn", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_family_name_trains_on_the_default_digits_and_the_header_says_how():
    r = cli("--model", "vgg16", *QUICK)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pydtnn: model vgg16_cifar10 (from --model vgg16), 33,637,066 parameters" in r.stderr
    assert "adapted: first layer takes 1 channel (designed for 3)" in r.stderr
    assert "adapted: 28x28 images zero-padded to its design size 32x32" in r.stderr
    assert "final: test_loss" in r.stdout


def test_suffixed_cifar_model_on_digits_is_padded_not_a_shape_error():
    r = cli("--model", "resnet20_cifar10", *QUICK)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pydtnn: model resnet20_cifar10, 272,186 parameters" in r.stderr
    assert "first layer takes 1 channel (designed for 3)" in r.stderr and "zero-padded" in r.stderr


def test_a_model_that_cannot_take_the_digits_is_one_line():
    one_error_line(cli("--model", "inceptionv3", *QUICK), "inceptionv3_imagenet cannot take 1x28x28 images",
                   "a dataset with larger images (imagenet)", "a model for small images (alexnet,")


def test_list_models_is_a_table_of_facts():
    r = cli("--list_models")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["model", "input", "classes", "parameters", "GFLOPs"]
    rows = {line.split()[0]: line.split() for line in lines[2:] if line and not line.startswith(("Family", " "))}
    assert rows["resnet20_cifar10"] == ["resnet20_cifar10", "3x32x32", "10", "272,474", "0.083"]
    assert rows["resnet50_imagenet"][1:4] == ["3x224x224", "1000", "25,557,032"]
    families = {line.split()[0]: line.split()[1:] for line in lines if line.startswith("  ")}
    assert families["vgg16"] == ["vgg16_cifar10", "/", "vgg16_imagenet"]
    assert families["resnet50"] == ["resnet50_imagenet"]


@pytest.mark.parametrize("argv,hint", [
    (["--batchsize", "3"], "did you mean '--batch_size'?"),
    (["--learning-rte", "0.1"], "did you mean '--learning-rate'?"),
    (["--optimizer", "sdg"], "did you mean 'sgd'?"),
    (["--reduction", "bucket"], "did you mean 'bucketed'?"),
])
def test_misspelled_flags_and_choices_get_a_suggestion(argv, hint):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert hint in str(e.value)


def test_misspelled_model_at_the_command_line():
    one_error_line(cli("--model", "mobilenet", *QUICK), "unknown model 'mobilenet'", "did you mean 'mobilenetv1'?")


def test_without_a_terminal_no_bars_but_one_line_per_epoch_on_stdout(tmp_path):
    for progress in ([], ["--progress", "false"]):
        r = cli("--model", "simplemlp", "--num_epochs", "2", "--steps_per_epoch", "3", *progress)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "\r" not in r.stderr and "batch/s" not in r.stderr and "it/s" not in r.stderr
        # results on stdout (epoch lines, then the final one), diagnostics on stderr
        assert [s.split(":")[0] for s in r.stdout.splitlines()] == ["epoch 1", "epoch 2", "final"], r.stdout
        assert "epoch 1:" not in r.stderr and r.stderr.startswith("pydtnn: model simplemlp")
        assert "configuration {" not in r.stderr  # no one-line JSON dump


def test_without_a_terminal_progress_is_a_line_at_a_steady_interval():
    """What mpirun's pipes and log files get instead of a bar (every 10 s from the command line; every step here)."""
    import numpy as np

    from pydtnn import models
    from pydtnn.data import ArrayDataset
    from pydtnn.losses import SoftmaxCrossEntropy
    from pydtnn.optim import SGD
    from pydtnn.trainer import Trainer

    model = models.create("simplemlp", input_shape=(1, 4, 4), num_classes=3)
    rng = np.random.default_rng(0)
    train = ArrayDataset(rng.random((40, 1, 4, 4), np.float32), rng.integers(0, 3, 40), 3)
    said = []
    t = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.1), log=said.append, progress_every=0.0)
    t.fit(train, epochs=2, batch_size=8)
    assert len(said) == 2 * 4  # steps 1-4 of 5 in each epoch; the epoch's own line says the rest
    first = said[0].split(", ")
    assert first[0] == "epoch 1/2: step 1/5" and first[1].endswith(" samples/s")
    assert first[2].startswith("loss ") and first[3].endswith(" left in the epoch"), said[0]
    assert said[-1].startswith("epoch 2/2: step 4/5")
    quiet = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.1), log=said.append, progress=False,
                    progress_every=0.0)
    quiet.fit(train, epochs=1, batch_size=8)
    assert len(said) == 8  # --progress false: no lines either


def test_warnings_for_a_global_batch_above_the_data_and_a_warm_up_above_the_run():
    r = cli("--model", "simplemlp", "--num_epochs", "1", "--batch_size", "5000", "--lr_schedulers", "warm_up",
            "--warm_up_epochs", "4", "--progress", "false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("pydtnn: warning: the global batch of 5,000 samples is larger than the 4,000 training samples"
            in r.stderr), r.stderr
    assert ("pydtnn: warning: warm_up ramps the learning rate over 4 epochs but the run trains 1 epoch: it never "
            "reaches the full rate (about 0.33x at the end); give --warm_up_epochs 1 or fewer") in r.stderr


def test_misspelled_scheduler_gets_a_suggestion():
    with pytest.raises(ConfigError, match="unknown scheduler 'cosin'; did you mean 'cosine'"):
        parse_args(["--lr_schedulers", "warm_up,cosin"])


@pytest.mark.parametrize("how,prog", [(["-m", "pydtnn"], "python -m pydtnn"),
                                      ([os.path.join("examples", "train.py")], "python train.py")])
def test_help_names_the_command_that_was_run(how, prog):
    r = subprocess.run([sys.executable, *how, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {prog} "), r.stdout[:200]


def test_a_failed_gradient_check_prints_plain_numbers():
    import numpy as np

    from pydtnn.layers import Dense
    from pydtnn.testing import check_gradients

    layer = Dense(3)
    layer.build((4,), dtype=np.float64)
    layer.backward = lambda dy: 2 * (dy @ layer.params["weight"])  # a wrong dx
    with pytest.raises(AssertionError) as e:
        check_gradients(layer, (2, 4))
    assert "np." not in str(e.value) and "worst at (" in str(e.value), str(e.value)


def test_config_json_holds_the_values_used_and_is_a_config_file(tmp_path):
    ckpt = tmp_path / "ck"
    r = cli("--model", "simplemlp", *QUICK, "--checkpoint_dir", ckpt, "--progress", "false")
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((ckpt / "config.json").read_text())
    # the flags as given (null: the default for this model and optimizer), then the values they gave
    assert config["learning_rate"] is None and config["momentum"] is None and config["batch_size"] == 8
    assert config["progress"] is False and config["model"] == "simplemlp"
    eff = config["effective"]
    assert eff["learning_rate"] == 0.05 and eff["momentum"] == 0.9 and eff["weight_decay"] == 0.0
    assert eff["parallel"] == "sequential" and eff["processes"] == 1 and eff["reduction"] is None
    assert eff["model"] == "simplemlp" and eff["input_shape"] == [1, 28, 28] and eff["global_batch_size"] == 8
    assert eff["num_epochs"] == 1
    args = parse_args(["--config", str(ckpt / "config.json"), "--optimizer", "adamw"])
    assert args.learning_rate is None and args.progress is False and args.batch_size == 8  # adamw's own rate


@pytest.mark.slow
def test_family_recipe_sets_batch_epochs_and_rate_where_no_flag_does(tmp_path):
    ckpt = tmp_path / "ck"
    r = cli("--model", "vgg11", "--steps_per_epoch", "1", "--checkpoint_dir", ckpt, "--num_epochs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    eff = json.loads((ckpt / "config.json").read_text())["effective"]
    assert (eff["learning_rate"], eff["batch_size_per_process"], eff["lr_schedulers"]) == (0.005, 16, ["cosine"])
    assert "one process, batch 16" in r.stderr and "sgd, learning rate 0.005" in r.stderr
    assert "1 epoch; schedules: cosine" in r.stderr
    r = cli("--model", "vgg11bn", "--steps_per_epoch", "1", "--num_epochs", "1", "--lr_schedulers", "warm_up")
    assert r.returncode == 0, r.stderr[-3000:]  # BatchNorm: the plain defaults; a flag given wins
    assert "one process, batch 64" in r.stderr and "learning rate 0.05;" in r.stderr
    assert "schedules: warm_up" in r.stderr


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="pip install mpich puts mpiexec next to python")
def test_two_processes_state_the_learning_rate_scaling_and_save_the_scaled_rate(tmp_path):
    ckpt = tmp_path / "ck"
    r = cli("--model", "simplemlp", *QUICK, "--checkpoint_dir", ckpt, launcher=(MPIEXEC, "-n", "2"), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 processes, data parallel, bucketed gradient reduction, batch 8 per process (16 global)" in r.stderr
    assert "learning rate 0.1 = 0.05 x 2 processes" in r.stderr
    assert r.stderr.count("pydtnn: model simplemlp") == 1  # the header comes from rank 0 only
    config = json.loads((ckpt / "config.json").read_text())
    assert config["learning_rate"] is None and config["effective"]["learning_rate"] == 0.1
    assert config["effective"]["reduction"] == "bucketed" and config["effective"]["processes"] == 2


def test_compile_notice_only_while_the_cache_is_cold(tmp_path, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cold"))
    code = "import json; from pydtnn.backends.cpu.kernels import jit; print(json.dumps(jit.cache_dir()))"

    def cache_dir():
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout)

    path, held = cache_dir()
    assert path.startswith(str(tmp_path / "cold")) and held is False
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, "vectors.rounded-13.py311.nbi"), "wb").close()
    assert cache_dir() == [path, True]


@pytest.mark.slow
def test_first_run_says_it_compiles_and_the_second_does_not(tmp_path):
    pytest.importorskip("numba")
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = cli("--model", "simplecnn", *QUICK, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "pydtnn: compiling CPU kernels, first run only" in first.stderr
    second = cli("--model", "simplecnn", *QUICK, env=env, timeout=600)
    assert second.returncode == 0 and "compiling" not in second.stderr, second.stderr[-3000:]


# -- datasets from the command line: found where they were fetched, or fetched with --download ---------
def _serve_fashion_mnist(tmp_path, monkeypatch):
    """REMOTE['fashion_mnist'] pointed at small, real-format files behind file:// URLs."""
    from test_data_download import write_mnist_gz

    from pydtnn.data import datasets as registry

    monkeypatch.setitem(registry.REMOTE, "fashion_mnist", write_mnist_gz(tmp_path / "www", n_train=40, n_test=10))


def test_download_flag_fetches_then_a_plain_run_finds_the_copy(tmp_path, monkeypatch, capsys):
    from pydtnn.cli import main

    monkeypatch.delenv("PYDTNN_DATA_DIR", raising=False)
    monkeypatch.setenv("PYDTNN_DATA", str(tmp_path / "data"))
    _serve_fashion_mnist(tmp_path, monkeypatch)
    argv = ["--dataset", "fashion_mnist", "--model", "simplemlp", *QUICK, "--progress", "false"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pass --download" in err and str(tmp_path / "data" / "fashion_mnist") in err
    assert main(argv + ["--download"]) == 0
    assert os.path.isdir(tmp_path / "data" / "fashion_mnist")
    # another process, no --download, no path, no URL table of ours: the fetched copy is found
    r = cli(*argv, env={"PYDTNN_DATA": str(tmp_path / "data")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data fashion_mnist: 40 train, 0 validation, 10 test" in r.stderr


@pytest.mark.parametrize("n_epochs", [2, 3, 7])
def test_plot_ticks_are_whole_epochs(tmp_path, n_epochs):
    import matplotlib.pyplot as plt

    from pydtnn.plot import figure

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "loss": 1.0 / e, "accuracy": 0.5 + e / 100}) + "\n"
                            for e in range(1, n_epochs + 1)))
    fig = figure(str(path))
    try:
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
    finally:
        plt.close(fig)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="pip install mpich puts mpirun next to python")
def test_the_readme_command_from_examples(tmp_path):
    """`cd examples; mpirun -np 2 python train.py --model vgg16`, cut to two steps of one epoch."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    r = subprocess.run([mpirun, "-np", "2", sys.executable, "train.py", "--model", "vgg16", "--num_epochs", "1",
                        "--steps_per_epoch", "2"], capture_output=True, text=True, timeout=300,
                       cwd=os.path.join(ROOT, "examples"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pydtnn: model vgg16_cifar10 (from --model vgg16)" in r.stderr
    assert "2 processes, data parallel, bucketed gradient reduction, batch 16 per process (32 global)" in r.stderr
    assert "learning rate 0.01 = 0.005 x 2 processes" in r.stderr
    assert "what to expect: VGG without BatchNorm stays near chance" in r.stderr  # its first epoch looks broken
    assert [s.split(":")[0] for s in r.stdout.splitlines()] == ["epoch 1", "final"], r.stdout
    assert r.stdout.splitlines()[-1].startswith("final: test_loss")
    assert "processes 2, replicas 2, model_parallel_size 1" in r.stdout


def test_a_model_too_large_for_memory_is_not_called_a_shape_mismatch():
    from pydtnn.errors import TooLarge
    from pydtnn.models.families import resolve

    def build(variant, shape):
        raise TooLarge("fc1: its float32 parameter of shape (4096, 10**12) needs ...")

    with pytest.raises(TooLarge, match="fc1: its float32 parameter"):
        resolve("vgg16", (3, 32, 32), 10, build=build)
