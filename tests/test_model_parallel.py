"""Model and hybrid parallelism: N processes compute what 1 process computes, checkpoints move between
layouts, failures end the job.

Multi-process runs use the mpiexec next to the Python in use, as subprocesses with a timeout.
"""

import json
import os
import subprocess
import signal
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from pydtnn.distributed import model_parallel
from pydtnn.distributed.comm import SingleProcess
from pydtnn.errors import ConfigError
from pydtnn.layers import BatchNorm, Conv2D, Dense, Dropout, Flatten, MaxPool2D, ReLU
from pydtnn.model import Model

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
WORKER = os.path.join(HERE, "mp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
KILLED = int(signal.SIGKILL)  # MPICH's mpiexec exits with the signal's number when a process dies of one


def launch(n, out, *extra, timeout=180):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, WORKER, str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def assert_close(want_path, got_path, rtol):
    want, got = load_file(str(want_path)), load_file(str(got_path))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert np.abs(want[k]).max() > 0, k  # a parameter that stayed zero would prove nothing
        err = np.abs(got[k].astype(np.float64) - want[k]).max() / np.abs(want[k]).max()
        assert err <= rtol, f"{k}: relative difference {err:.3g} > {rtol}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, dropout and random flips and crops on (tests/mp_worker.py)."""
    out = tmp_path_factory.mktemp("mp1")
    for dtype in ("float64", "float32"):
        r = launch(1, out / f"{dtype}.st", "--dtype", dtype, "--augment")
        assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_model_parallel_equals_one_process(single, tmp_path, n, dtype, rtol):
    """Channel counts 5, 7, 3+4 and 11 split unevenly over 2 and 3 ranks; BatchNorm, dropout, a residual
    and a concatenation block, a depthwise convolution: 10 steps give one process's parameters."""
    r = launch(n, tmp_path / "p.st", "--dtype", dtype, "--augment")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(single / f"{dtype}.st", tmp_path / "p.st", rtol)


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_hybrid_2x2_equals_one_process(single, tmp_path, dtype, rtol):
    """Two replicas of a model split over two ranks each, synchronized BatchNorm, dropout and augmentation on:
    each sample's draws are its own (pydtnn.randomness), whichever replica holds it."""
    r = launch(4, tmp_path / "h.st", "--dtype", dtype, "--model_parallel_size", "2", "--augment")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(single / f"{dtype}.st", tmp_path / "h.st", rtol)


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_with_dropout_and_augmentation_equals_one_process(single, tmp_path, n):
    """Dropout masks, flips and crops keyed by each sample, not by rank or step: np 2 and 3 draw what np 1 draws."""
    r = launch(n, tmp_path / "d.st", "--dtype", "float64", "--model_parallel_size", "1", "--augment")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(single / "float64.st", tmp_path / "d.st", 1e-12)


def test_a_killed_rank_ends_a_model_parallel_job(tmp_path):
    """The launcher sees rank 1 die of SIGKILL and ends the job with the signal's code; the stall timeout is
    longer than the test's, so only that ends the others in time."""
    r = launch(3, tmp_path / "k.st", "--kill_at", "4", "--stall_timeout", "600", timeout=60)
    assert r.returncode == KILLED, r.stderr[-2000:]
    assert not (tmp_path / "k.st").exists()


def test_an_exception_on_one_rank_ends_a_model_parallel_job(tmp_path):
    """Rank 1 raises mid-step: the abort handler prints its traceback under its rank and ends every rank with
    exit code 1 (an internal error). The stall timeout is longer than the test's, so the job ends in time only
    if the handler ends it."""
    r = launch(3, tmp_path / "e.st", "--raise_at", "3", "--stall_timeout", "600", timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "rank 1: Traceback (most recent call last):" in r.stderr, r.stderr[-2000:]
    assert "RuntimeError: deliberate failure in call 3" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "e.st").exists()


def test_a_stalled_rank_of_a_group_is_reported_by_the_watchdog(tmp_path):
    """Rank 1 sleeps 120 s, longer than the test's timeout: the 3 s watchdog ends the job (exit code 1)."""
    r = launch(2, tmp_path / "s.st", "--stall_at", "3", "--stall_timeout", "3", timeout=90)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "stalled" in r.stderr and "allgather" in r.stderr, r.stderr[-2000:]


ZOO = ("lenet5", "simplecnn", "simplemlp", "alexnet_cifar10", "vgg11bn_cifar10", "resnet20_cifar10",
       "mobilenetv1_cifar10", "densenet_cifar10", "googlenet_cifar10")


@pytest.mark.slow
def test_every_zoo_family_split_over_3_processes_computes_what_it_computes_whole():
    """One model of every family (residual, concatenation and dense blocks, depthwise convolutions, dropout):
    output and gradients of one training step equal the whole model's (tests/mp_zoo_worker.py)."""
    cmd = [MPIEXEC, "-n", "3", sys.executable, os.path.join(HERE, "mp_zoo_worker.py"), *ZOO]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == list(ZOO)


# -- the command line: layouts, checkpoints, traces ----------------------------------------------------------
def cli(n, *args, cwd, timeout=180):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, "-m", "pydtnn", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


BASE = ("--model", "simplecnn", "--dataset", "mnist5k", "--dtype", "float64", "--global_batch_size", "32",
        "--steps_per_epoch", "4", "--progress", "false")
LAYOUTS = {"one": (1, ()), "model2": (2, ("--parallel", "model")), "data2": (2, ("--parallel", "data")),
           "hybrid4": (4, ("--parallel", "hybrid", "--model_parallel_size", "2"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    cli(1, *BASE, "--num_epochs", "2", "--checkpoint_dir", str(d / "ck"), cwd=d)
    return load_file(str(d / "ck" / "model.safetensors")), load_file(str(d / "ck" / "optimizer.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("model2", "one"), ("model2", "data2"), ("one", "model2"),
                                        ("data2", "model2"), ("hybrid4", "model2")])
def test_a_checkpoint_resumes_at_another_layout(uninterrupted, tmp_path, first, then):
    """Saved whole (the names and shapes of one process), resumed split or not: the same as no interruption."""
    n, flags = LAYOUTS[first]
    cli(n, *BASE, *flags, "--num_epochs", "1", "--checkpoint_dir", str(tmp_path / "ck"), cwd=tmp_path)
    n, flags = LAYOUTS[then]
    cli(n, "--resume", str(tmp_path / "ck"), "--num_epochs", "2", *flags, cwd=tmp_path)
    for got, want in zip((load_file(str(tmp_path / "ck" / f)) for f in ("model.safetensors", "optimizer.safetensors")),
                         uninterrupted):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].shape == want[k].shape
            err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
            assert err <= 1e-12, f"{first} -> {then}: {k} differs by {err:.3g}"


def test_model_parallel_collectives_are_traced_and_rank_0_alone_writes(tmp_path):
    r = cli(2, *BASE, "--parallel", "model", "--num_epochs", "1", "--tracing", "true", "--tracer_output",
            "t.json", "--metrics_file", "m.jsonl", "--debug_collectives", "true", "--stall_timeout", "60", cwd=tmp_path)
    assert "model parallel" in r.stderr
    events = json.load(open(tmp_path / "t.rank1.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = {e["cat"] for e in events if e.get("tid") == 2}
    assert {"allgather", "allreduce", "reduce_scatter"} <= ops, ops
    # simplecnn at np 2: a gather before the second Conv2D (reduce-scatter back), before Flatten and before the
    # classifier (reduce-scatter back), one at the output, and a summed dx before the first Dense
    gathers = [e for e in events if e.get("cat") == "allgather"]
    assert gathers and all(e["args"]["bytes"] > 0 for e in gathers)
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["final"]


# -- the rewrite, in one process ------------------------------------------------------------------------------
class FakeGroup:
    """Rank `rank` of `size`: enough for partition(), which does not communicate."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_partition_splits_by_output_channels_and_gathers_where_a_whole_tensor_is_needed():
    model = Model([Conv2D(5, 3, padding=1), BatchNorm(), ReLU(), MaxPool2D(2), Conv2D(3, 3), Flatten(),
                   Dense(10), ReLU(), Dropout(0.5), Dense(4)], (2, 8, 8))
    whole = {k: v.copy() for k, v in model.state_dict().items()}
    model_parallel.partition(model, FakeGroup(1, 2))
    kinds = [(name, type(layer).__name__) for name, layer in model.root.children]
    assert kinds == [("0", "Conv2D"), ("1", "BatchNorm"), ("2", "ReLU"), ("3", "MaxPool2D"),
                     ("4:allgather", "Gather"), ("4", "Conv2D"), ("5:allgather", "Gather"), ("5", "Flatten"),
                     ("6:sum_dx", "SumGrad"), ("6", "Dense"), ("7", "ReLU"), ("8", "Dropout"),
                     ("9:allgather", "Gather"), ("9", "Dense"), ("output:allgather", "Gather")]
    layers = dict(model.root.children)
    assert layers["4:allgather"].reduce_grad and not layers["5:allgather"].reduce_grad
    # rank 1 of 2 holds channels 3:5 of 5, 2:3 of 3, 5:10 of 10, 2:4 of 4
    state = model.state_dict()
    for name, rows in (("0.weight", slice(3, 5)), ("1.running_var", slice(3, 5)), ("4.weight", slice(2, 3)),
                       ("6.weight", slice(5, 10)), ("9.bias", slice(2, 4))):
        np.testing.assert_array_equal(state[name], whole[name][rows])
    assert layers["8"].channels == (10, 5, 10)
    assert model.state_layout()["6.weight"][0] == (10, 12)  # whole shapes, as one process has them
    assert model.count_params() == sum(v.size for k, v in whole.items() if "running" not in k)
    assert model.grad_buffer.size == sum(g.size for _, _, g in model.parameters())


def test_a_dense_over_tokens_is_not_split_by_channels():
    """Its features are the last axis, not the channel axis the split cuts: it runs whole on every rank."""
    model = Model([Dense(6), ReLU(), Dense(3)], (4, 5))
    whole = {k: v.copy() for k, v in model.state_dict().items()}
    model_parallel.partition(model, FakeGroup(1, 2))
    assert [type(layer).__name__ for _, layer in model.root.children] == ["Dense", "ReLU", "Dense"]
    assert all(np.array_equal(v, whole[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["resnet20_cifar10", "googlenet_cifar10", "vgg11bn_cifar10"])
def test_plan_lists_what_partition_does(name):
    """plan() (the performance model's input) names every collective partition() inserts, in order, with
    the whole tensor's size, and every leaf layer with the share rank 0 computes."""
    from pydtnn import models

    model = models.create(name)
    steps = model_parallel.plan(model, 4)
    filters = {path: layer.filters for path, layer in model.layers() if isinstance(layer, Conv2D)}
    model_parallel.partition(model, FakeGroup(0, 4))
    inserted = [(type(layer).__name__, int(np.prod(layer.output_shape if isinstance(layer, model_parallel.Gather)
                                                   else layer.input_shape)))
                for _, layer in model.root.named_layers()
                if isinstance(layer, model_parallel.Gather | model_parallel.SumGrad)]
    planned = [("Gather" if s["op"] == "allgather" else "SumGrad", s["elements"]) for s in steps if "op" in s]
    assert planned == inserted
    shares = {s["layer"]: s["fraction"] for s in steps if "kind" in s}
    for path, layer in model.layers():  # rank 0 keeps ceil(C / 4) of C channels
        if isinstance(layer, Conv2D):
            assert shares[path] == -(-filters[path] // 4) / filters[path] and layer.filters == -(-filters[path] // 4)


def test_partition_leaves_the_backend_generator_as_it_was():
    """Splitting rebuilds each split layer, which draws initial values from backend.rng; checkpoints save that
    Generator's state, so partition() leaves it exactly as it was, also when it refuses the split."""
    import copy

    model = Model([Conv2D(5, 3, padding=1), BatchNorm(), ReLU(), Flatten(), Dense(10), ReLU(), Dense(4)], (2, 8, 8))
    rng = model.backend.rng
    rng.random(3)  # a state other than the seed's
    before = copy.deepcopy(rng.bit_generator.state)
    model_parallel.partition(model, FakeGroup(1, 2))
    assert model.backend.rng is rng and rng.bit_generator.state == before
    refused = Model([Flatten(), Dense(5), ReLU(), Dense(2)], (1, 4, 4))  # Dense(5) is split before Dense(2) is refused
    before = copy.deepcopy(refused.backend.rng.bit_generator.state)
    with pytest.raises(ConfigError, match="Dense '3' has 2 output channels, fewer than the 3 processes"):
        model_parallel.partition(refused, FakeGroup(0, 3))
    assert refused.backend.rng.bit_generator.state == before


def test_a_group_larger_than_a_layer_is_refused():
    model = Model([Flatten(), Dense(3), ReLU(), Dense(2)], (1, 4, 4))
    with pytest.raises(ConfigError, match="Dense '3' has 2 output channels, fewer than the 3 processes"):
        model_parallel.plan(model, 3)


def test_the_layout_flags_are_checked():
    comm = SingleProcess()
    with pytest.raises(ConfigError, match="needs --model_parallel_size"):
        model_parallel.layout(comm, "hybrid", None)
    with pytest.raises(ConfigError, match="does not divide"):
        model_parallel.layout(comm, "hybrid", 2)
    with pytest.raises(ConfigError, match="needs --parallel hybrid"):
        model_parallel.layout(comm, "data", 2)
    assert model_parallel.layout(comm, "model", None) == (None, comm, 1)
