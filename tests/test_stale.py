"""One-step-stale reduction (--reduction_staleness 1): the same parameters at 1, 2 and 3 processes (one process
running the same delayed algorithm), different from the undelayed ones; staleness 0 the default, bit for bit; a
resumed run equal to an uninterrupted one; the hidden reduction as the performance model prices it; and what it
refuses."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from test_distributed import ENV, MPIEXEC, launch, read, refused_in_one_line, resumed_equals_whole

from pydtnn import models
from pydtnn.perfmodel import machine as machines
from pydtnn.perfmodel.machine import Link
from pydtnn.perfmodel.predict import predict


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """One process through the stale reducer (and, for comparison, the plain undelayed run)."""
    out = tmp_path_factory.mktemp("stale1")
    for extra in ((), ("--alone", "--strategies", "stale")):
        r = launch(1, out, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def _relative(a, b):
    return max(np.abs(a[k].astype(np.float64) - b[k]).max() / np.abs(b[k]).max() for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_stale_reduction_at_n_processes_equals_one_process_and_differs_from_no_delay(alone, tmp_path, n):
    r = launch(n, tmp_path, "--strategies", "stale")
    assert r.returncode == 0, r.stderr[-3000:]
    for dtype, rtol in (("float64", 1e-12), ("float32", 1e-5)):
        want, _ = read(alone / f"stale-{dtype}.safetensors")
        got, _ = read(tmp_path / f"stale-{dtype}.safetensors")
        assert _relative(got, want) <= rtol, (dtype, _relative(got, want))
        undelayed, _ = read(alone / f"single-{dtype}.safetensors")
        assert _relative(want, undelayed) > 1e-3  # one step stale is another algorithm


@pytest.mark.slow
def test_staleness_zero_is_the_default_bit_for_bit(tmp_path):
    from safetensors.numpy import load_file

    base = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
            "--num_epochs", "1", "--steps_per_epoch", "3", "--progress", "false"]
    for name, extra in (("default", []), ("zero", ["--reduction_staleness", "0"]), ("one", ["--reduction_staleness", "1"])):
        r = subprocess.run(base + ["--checkpoint_dir", name, *extra], capture_output=True, text=True, timeout=120,
                           env=ENV, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    files = {n: load_file(str(tmp_path / n / "model.safetensors")) for n in ("default", "zero", "one")}
    assert all(np.array_equal(files["default"][k], files["zero"][k]) for k in files["default"])
    assert not all(np.array_equal(files["default"][k], files["one"][k]) for k in files["default"])


@pytest.mark.slow
def test_a_stale_run_resumes_bit_identically(tmp_path):
    """Each epoch ends by applying its last step's gradients: nothing is in flight at a checkpoint."""
    base = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
            "--dtype", "float64", "--global_batch_size", "32", "--steps_per_epoch", "4", "--progress", "false",
            "--reduction_staleness", "1"]
    resumed_equals_whole(base, tmp_path)


@pytest.mark.parametrize("gbit", [10.0, 0.1])
def test_the_model_hides_the_stale_reduction_behind_the_next_steps_compute(gbit):
    """VGG-11-BN's 112 MB of gradients over 4 processes on links of 10 and 0.1 Gbit/s that move bytes while the ranks
    compute: the stale step exposes only what its allreduce takes beyond a forward and backward."""
    model = models.create("vgg11bn_cifar10")
    link = Link(50e-6, gbit * 1e9 / 8, background=True)
    machine = dataclasses.replace(machines.DEFAULT, links={"intra": link, "inter": link})
    stale = predict(model, 32, 4, machine, reduction="stale")
    bucketed = predict(model, 32, 4, machine, reduction="bucketed")
    fwd_bwd = sum(t.forward_s + t.backward_data_s + t.backward_weights_s for t in stale.layers)
    comm = stale.comm_s - stale.sync_s
    assert stale.exposed_comm_s - stale.sync_s == pytest.approx(max(0.0, comm - fwd_bwd), rel=1e-6, abs=1e-9)
    assert (comm > fwd_bwd) == (gbit < 1)  # hidden at 10 Gbit/s, not at 0.1
    assert stale.exposed_comm_s < bucketed.exposed_comm_s


@pytest.mark.parametrize("flags, words", [
    (["--reduction_staleness", "1", "--reduction", "topk"], ("--reduction_staleness 1 reduces every gradient in one "
     "allreduce applied a step late; it replaces the gradient reduction, and --reduction topk was given")),
    pytest.param(["--reduction_staleness", "1", "--zero", "1"], "stale holds each step's average a step late",
                 marks=pytest.mark.slow),
    pytest.param(["--reduction_staleness", "1", "--gradient_compression", "fp16"], "stale reducer: compression 'fp16'",
                 marks=pytest.mark.slow),
    pytest.param(["--reduction", "stale"], "--reduction stale needs --reduction_staleness 1", marks=pytest.mark.slow),
    pytest.param(["--reduction_staleness", "1", "--parallel", "model"], "--reduction_staleness applies to the stale "
                 "reducer over several processes; this run reduces with nothing (one model replica)",
                 marks=pytest.mark.slow),
])
def test_staleness_refuses_what_it_cannot_take_in_one_line(tmp_path, flags, words):
    refused_in_one_line(tmp_path, flags, words)
