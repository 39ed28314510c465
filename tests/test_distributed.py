"""Data parallelism: N processes compute what 1 process computes, and failures end the whole job.

Multi-process runs use the mpiexec next to the Python in use, as subprocesses with a timeout, so a
hang fails the test instead of stalling the suite.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors import safe_open

from pydtnn.distributed.comm import SingleProcess
from pydtnn.distributed.sampler import local_rows, micro_shares, shard_bounds

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
WORKER = os.path.join(HERE, "dist_worker.py")
STRATEGIES = ("blocking", "per_layer", "bucketed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def launch(n, out, *extra, timeout=240):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, WORKER, str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def read(path):
    with safe_open(str(path), "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def assert_same_parameters(ref_dir, out_dir, strategies, rtols=(("float64", 1e-12), ("float32", 1e-5)), what=""):
    """Every parameter of every run in out_dir equals the one-process run in ref_dir, relative to its scale."""
    for dtype, rtol in rtols:
        want, _ = read(ref_dir / f"single-{dtype}.safetensors")
        for strategy in strategies:
            got, _ = read(out_dir / f"{strategy}-{dtype}.safetensors")
            assert got.keys() == want.keys()
            for k in want:
                assert np.abs(want[k]).max() > 0, k  # a parameter that stayed zero would prove nothing
                err = np.abs(got[k].astype(np.float64) - want[k]).max() / np.abs(want[k]).max()
                assert err <= rtol, f"{what} {strategy} {dtype} {k}: relative difference {err:.3g} > {rtol}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("np1")
    r = launch(1, out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_n_processes_equal_one_process(single, tmp_path, n):
    assert os.path.exists(MPIEXEC), "pip install mpich puts mpiexec next to python"
    r = launch(n, tmp_path, *(["--piece_kb", "8"] if n == 3 else []))  # np=3: messages cut into many pieces
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, STRATEGIES, what=f"np={n}")


def test_hierarchical_reduction_over_two_emulated_nodes_equals_one_process(single, tmp_path):
    """4 processes as 2 nodes of 2 (--ranks_per_node): reduce to each node's leader, allreduce between the
    leaders, broadcast back; the same parameters as one process."""
    r = launch(4, tmp_path, "--strategies", "hierarchical", "--ranks_per_node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("hierarchical",), what="np=4 as 2 nodes")


@pytest.mark.slow
def test_hierarchical_reduction_with_fp16_compression_stays_close_to_one_process(single, tmp_path):
    """fp16 composes with the two-level reduction: 4 processes as 2 nodes of 2 send half-precision buckets (the
    node sums, the leaders' allreduce and the broadcast all in fp16, scaled under 2^15 by a bound over every
    rank); close to one process as fp16 keeps it (over the whole parameter vector), and as many bytes in the
    float64 run as in the float32 one: 2 per entry."""
    r = launch(4, tmp_path, "--strategies", "hierarchical", "--ranks_per_node", "2", "--fp16")
    assert r.returncode == 0, r.stderr[-3000:]
    sent = {}
    for dtype in ("float64", "float32"):
        want, _ = read(single / f"single-{dtype}.safetensors")
        got, meta = read(tmp_path / f"hierarchical-{dtype}.safetensors")
        ref = np.concatenate([v.ravel() for v in want.values()]).astype(np.float64)
        vec = np.concatenate([got[k].ravel() for k in want]).astype(np.float64)
        assert np.linalg.norm(vec - ref) / np.linalg.norm(ref) < 5e-2, dtype
        sent[dtype] = int(meta["bytes"])
    assert sent["float64"] == sent["float32"] > 0


@pytest.mark.parametrize("n", [2, 3])
def test_reductions_progressed_by_a_helper_thread_equal_one_process(single, tmp_path, n):
    """--reduction_progress thread: a helper thread tests the outstanding allreduces while backward runs
    (np=3: in 8 KiB pieces, so that many requests are outstanding at once); the same parameters."""
    r = launch(n, tmp_path, "--strategies", "per_layer,bucketed", "--progress", "thread",
               *(["--piece_kb", "8"] if n == 3 else []))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("per_layer", "bucketed"), what=f"np={n}, progress thread")


@pytest.mark.parametrize("n", [2, 3])
def test_topk_at_density_one_equals_one_process(single, tmp_path, n):
    """Every entry sent as (index, value) pairs and summed in rank order: the dense result."""
    r = launch(n, tmp_path, "--strategies", "topk", "--density", "1.0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("topk",), what=f"np={n}")


@pytest.mark.parametrize("flags", [["--reduction", "hierarchical", "--ranks_per_node", "1"],
                                   ["--reduction", "topk", "--density", "0.05"]])
def test_the_command_line_takes_the_hierarchical_and_topk_reducers(tmp_path, flags):
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
           "--num_epochs", "1", "--steps_per_epoch", "3", "--progress", "false", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"data parallel, {flags[1]} gradient reduction" in r.stderr and "final:" in r.stdout
    bad = subprocess.run(cmd[:-2] + ["--density", "1.5"] if flags[1] == "topk" else cmd[:-2] + ["--ranks_per_node", "3"],
                         capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert bad.returncode == 2 and ("--density: expected a number in (0, 1]" in bad.stderr
                                    or "--ranks_per_node 3 does not divide the 2 processes" in bad.stderr), bad.stderr


PROGRESS_PROBE = """
import time
import numpy as np
from pydtnn.distributed import launch
comm = launch.init(stall_timeout=0)
buf = np.full(1 << 16, comm.rank + 1.0)
thread = comm.progress_thread(interval=1e-3)
comm.barrier()
req = comm.iallreduce(buf)
thread.watch([req])
time.sleep(1.0)  # this thread does not enter MPI here
done = req.done  # set only by a test() that saw the request complete: here, the helper thread's
thread.release([req])
req.wait()
assert buf[0] == comm.size * (comm.size + 1) / 2
import gc
from pydtnn.distributed import reducers
reducer = reducers.create("bucketed", comm, progress="thread")
helper = reducer._thread._thread
del reducer
gc.collect()
helper.join(5)
assert not helper.is_alive(), "the progress thread outlived its reducer"
print(f"rank {comm.rank}: done before wait: {done}, rounds {thread.rounds}")
"""


def test_a_progress_thread_completes_a_reduction_while_the_caller_is_out_of_mpi(tmp_path):
    """The helper thread tests the request while the main thread sleeps, and it completes there (MPI
    progresses only inside calls here: without the thread nothing would move it); a reducer's thread
    ends with the reducer."""
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", PROGRESS_PROBE],
                       capture_output=True, text=True, timeout=60, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    said = re.findall(r"rank (\d): done before wait: (\w+), rounds (\d+)", r.stdout)  # lines may interleave
    assert sorted(r for r, _, _ in said) == ["0", "1"], r.stdout
    assert all(done == "True" and int(rounds) >= 1 for _, done, rounds in said), r.stdout


def test_progress_thread_is_refused_where_the_reducer_cannot_use_it(tmp_path):
    from pydtnn.distributed import reducers
    from pydtnn.errors import ConfigError

    for name in ("blocking", "hierarchical", "topk"):
        with pytest.raises(ConfigError, match=f"{name} reducer: progress 'thread'; expected test$"):
            reducers.create(name, SingleProcess(), progress="thread")

    class OtherComm(SingleProcess):  # a communicator without MPI's requests, of two processes
        name, size = "nccl", 2

    with pytest.raises(ConfigError, match="progress thread: this run's communicator is nccl; expected mpi"):
        reducers.create("bucketed", OtherComm(), progress="thread")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
           "--num_epochs", "1", "--steps_per_epoch", "3", "--progress", "false", "--reduction", "blocking",
           "--reduction_progress", "thread"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert r.returncode == 2 and "blocking reducer: progress 'thread'; expected test" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(cmd[:-5] + ["--reduction", "bucketed", "--reduction_progress", "thread"],
                       capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert r.returncode == 0 and "final:" in r.stdout, r.stderr[-2000:]


def refused_in_one_line(tmp_path, flags, words):
    """pydtnn-train of simplecnn at np 2 with `flags` exits 2 with one line on stderr that holds `words`."""
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--num_epochs",
                        "1", "--steps_per_epoch", "1", "--progress", "false", *flags], capture_output=True, text=True,
                       timeout=120, env=ENV, cwd=tmp_path)
    assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def resumed_equals_whole(base, tmp_path, check_part=None):
    """Run the command `base` (mpiexec ... -m pydtnn and its flags, checkpointing each epoch) for 2 epochs into
    tmp_path/full and for 1 into tmp_path/part, check_part(part's optimizer state) if given, resume part for the
    second epoch, and assert that both end with the same model and optimizer files, bit for bit."""
    from safetensors.numpy import load_file

    for extra in (["--num_epochs", "2", "--checkpoint_dir", "full"], ["--num_epochs", "1", "--checkpoint_dir", "part"]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    if check_part is not None:
        check_part(load_file(str(tmp_path / "part" / "optimizer.safetensors")))
    r = subprocess.run(base[:4] + ["-m", "pydtnn", "--resume", "part", "--num_epochs", "2"], capture_output=True,
                       text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("model.safetensors", "optimizer.safetensors"):
        full, part = load_file(str(tmp_path / "full" / name)), load_file(str(tmp_path / "part" / name))
        assert full.keys() == part.keys() and all(np.array_equal(full[k], part[k]) for k in full), name


@pytest.mark.slow
@pytest.mark.parametrize("corrected", [False, True])
def test_a_topk_run_resumes_bit_identically_with_every_ranks_residual(tmp_path, corrected):
    """The residuals (what each rank has not sent) are saved with the checkpoint, one row per rank, and each
    rank gets its own back: 1 + 1 epochs end exactly where 2 epochs do, residuals included; with momentum
    correction the velocities too."""
    from safetensors.numpy import load_file

    base = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
            "--dtype", "float64", "--global_batch_size", "32", "--steps_per_epoch", "4", "--progress", "false",
            "--reduction", "topk", "--density", "0.1", "--momentum_correction", str(corrected).lower()]
    resumed_equals_whole(base, tmp_path)
    r = subprocess.run(base[:4] + ["-m", "pydtnn", "--resume", "part", "--num_epochs", "3", "--momentum_correction",
                                   str(not corrected).lower()], capture_output=True, text=True, timeout=120, env=ENV,
                       cwd=tmp_path)  # the other kind of reducer state: refused before anything is restored
    want = "give --momentum_correction true as the saved run did" if corrected else "resume without it"
    assert r.returncode == 2 and want in r.stderr, r.stderr[-2000:]
    saved = load_file(str(tmp_path / "part" / "optimizer.safetensors"))
    for name in ("residual", "velocity") if corrected else ("residual",):
        state = saved[f"@reducer.{name}"]
        assert state.shape[0] == 2 and not np.array_equal(state[0], state[1]) and np.abs(state).sum() > 0, name
    assert ("@reducer.velocity" in saved) == corrected


def test_topk_momentum_correction_at_density_one_equals_one_process_without_momentum(tmp_path):
    """Momentum correction clears the velocity of every entry sent: at density 1 every entry is sent each step, so
    2 processes apply plain SGD to the global batch's gradient, as one process with --momentum 0 does (float64,
    1e-12); and the flag is refused in one line where it does not apply."""
    from safetensors.numpy import load_file

    common = ["-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k", "--dtype", "float64",
              "--global_batch_size", "32", "--steps_per_epoch", "4", "--num_epochs", "1", "--progress", "false"]
    runs = {"np2": [MPIEXEC, "-n", "2", sys.executable, *common, "--reduction", "topk", "--density", "1.0",
                    "--momentum_correction", "true", "--checkpoint_dir", "np2"],
            "np1": [sys.executable, *common, "--momentum", "0", "--checkpoint_dir", "np1"]}
    for argv in runs.values():
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = (load_file(str(tmp_path / k / "model.safetensors")) for k in ("np2", "np1"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-14, err_msg=k)
    for extra, words in ((["--momentum_correction", "true"], "applies to the topk or oktopk reducer over several processes"),
                         (["--momentum_correction", "true", "--optimizer", "adam"], None)):
        r = subprocess.run([sys.executable, *common, *extra], capture_output=True, text=True, timeout=120, env=ENV,
                           cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert words is None or words in r.stderr, r.stderr
    for extra, words in ((["--optimizer", "adam"], "expected --optimizer sgd without Nesterov"),
                         (["--momentum", "0"], "but --momentum is 0; expected a momentum in (0, 1)"),
                         (["--decay", "1e-4"], "--decay 0.0001: the decay would skip the reducer's momentum")):
        r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, *common, "--reduction", "topk", "--momentum_correction",
                            "true", *extra], capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
        assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]


def test_topk_sends_the_largest_entries_and_keeps_exactly_the_rest():
    """Error feedback: after each step, sent + kept = this step's weighted gradient + what was kept before."""
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.layers import Dense, Flatten
    from pydtnn.model import Model

    model = Model([Flatten(), Dense(7)], (1, 4, 4), CPUBackend("float64"))
    red = reducers.create("topk", SingleProcess(), density=0.1).attach(model)
    assert red.k == 12  # ceil(0.1 x 119)
    rng, kept = np.random.default_rng(0), np.zeros(model.grad_buffer.size)
    for weight in (1.0, 0.5, 1.0):
        g = rng.standard_normal(model.grad_buffer.size)
        model.grad_buffer[...] = g
        red.begin_step(weight)
        red.finish()
        acc = weight * g + kept
        sent = model.grad_buffer.copy()
        assert np.count_nonzero(sent) == red.k
        assert np.abs(acc[sent != 0]).min() >= np.abs(acc[sent == 0]).max()  # the k largest
        np.testing.assert_array_equal(sent + red.residual, acc)
        kept = red.residual.copy()
    state = red.state_dict()
    other = reducers.create("topk", SingleProcess(), density=0.1).attach(
        Model([Flatten(), Dense(7)], (1, 4, 4), CPUBackend("float64")))
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.residual, kept)


def test_topk_density_warm_up_falls_from_a_quarter_to_the_density_epoch_by_epoch():
    """Over W warm-up epochs the density falls geometrically from 0.25 to --density: epoch e of W sends
    0.25 (density / 0.25)^(e / W); the trainer's begin_epoch sets it; each step then sends that many."""
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.errors import ConfigError
    from pydtnn.layers import Dense, Flatten
    from pydtnn.model import Model

    model = Model([Flatten(), Dense(50)], (1, 8, 8), CPUBackend("float64"))  # 3,250 gradient entries
    red = reducers.create("topk", SingleProcess(), density=0.01, warmup_epochs=2).attach(model)
    assert [red.density_at(e) for e in range(4)] == pytest.approx([0.25, 0.05, 0.01, 0.01], rel=1e-12)
    rng = np.random.default_rng(2)
    for epoch, want in enumerate((813, 163, 33, 33)):  # ceil(density x 3,250)
        red.begin_epoch(epoch)
        model.grad_buffer[...] = rng.standard_normal(model.grad_buffer.size)
        red.begin_step(1.0)
        red.finish()
        assert red.k == want and np.count_nonzero(model.grad_buffer) == want, epoch
    plain = reducers.create("topk", SingleProcess(), density=0.01).attach(model)
    plain.begin_epoch(0)
    assert plain.k == 33 and plain.density_at(0) == 0.01
    assert reducers.create("topk", SingleProcess(), density=0.5, warmup_epochs=3).density_at(0) == 0.5
    with pytest.raises(ConfigError, match="a whole number of epochs >= 0, got 1.5"):
        reducers.create("topk", SingleProcess(), density=0.01, warmup_epochs=1.5)


def test_the_command_line_warms_topk_up_selects_per_layer_and_refuses_both_without_topk(tmp_path):
    cmd = [sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k", "--num_epochs", "2",
           "--steps_per_epoch", "2", "--progress", "false"]
    warm, layer = ["--density_warmup_epochs", "1"], ["--topk_selection", "per_layer"]
    r = subprocess.run([MPIEXEC, "-n", "2", *cmd, *warm, *layer, "--reduction", "topk", "--density", "0.05"],
                       capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "topk density from 0.25 to 0.05 over 1 epoch" in r.stderr and "topk selection per layer" in r.stderr
    for flags, name in ((warm, "--density_warmup_epochs"), (layer, "--topk_selection")):
        bad = subprocess.run([MPIEXEC, "-n", "2", *cmd, *flags, "--reduction", "bucketed"], capture_output=True,
                             text=True, timeout=120, env=ENV, cwd=tmp_path)
        wanted = "topk or oktopk" if name == "--density_warmup_epochs" else "topk"
        assert bad.returncode == 2 and f"{name} applies to the {wanted} reducer over several processes; this run " \
            f"reduces with bucketed: add --reduction {wanted}" in bad.stderr, bad.stderr[-2000:]
    long = subprocess.run([MPIEXEC, "-n", "2", *cmd, "--density_warmup_epochs", "3", "--reduction", "topk"],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert long.returncode == 2 and "--density_warmup_epochs 3 is more than --num_epochs 2" in long.stderr, \
        long.stderr[-2000:]


def test_topk_per_layer_selection_sends_each_gradients_own_largest():
    """Global selection can leave a layer with small gradients unsent; per_layer sends ceil(density x size)
    of each gradient's own largest, and the residual still holds exactly the rest."""
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.layers import Dense, Flatten
    from pydtnn.model import Model

    def made(selection):
        model = Model([Flatten(), Dense(20), Dense(5)], (1, 4, 4), CPUBackend("float64"))
        return model, reducers.create("topk", SingleProcess(), density=0.1, selection=selection).attach(model)

    rng = np.random.default_rng(3)
    g = None
    for selection in ("global", "per_layer"):
        model, red = made(selection)
        spans = [red.offsets[n] for n, _, _ in model.parameters()]
        if g is None:
            g = rng.standard_normal(model.grad_buffer.size)
            a, b = spans[-1]  # the last layer's bias: tiny gradients
            g[a:b] *= 1e-6
        model.grad_buffer[...] = g
        red.begin_step(1.0)
        red.finish()
        sent = model.grad_buffer.copy()
        counts = [np.count_nonzero(sent[a:b]) for a, b in spans]
        if selection == "global":
            assert counts[-1] == 0 and sum(counts) == red.k == 45  # ceil(0.1 x 445)
        else:
            assert counts == [int(np.ceil(0.1 * (b - a))) for a, b in spans] == red.ks and red.k == sum(counts)
            for a, b in spans:
                part = np.abs(g[a:b])
                assert part[sent[a:b] != 0].min() >= part[sent[a:b] == 0].max()
        np.testing.assert_array_equal(sent + red.residual, g)
    with pytest.raises(Exception, match="topk selection must be global or per_layer, got 'layer'"):
        reducers.create("topk", SingleProcess(), density=0.1, selection="layer")


def test_topk_momentum_correction_accumulates_velocities_and_clears_what_it_sends():
    """u = m u + w g; the accumulation gains u; what is sent is cleared in both (momentum factor masking); the
    state round-trips, and a state without velocities is refused."""
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.errors import ConfigError
    from pydtnn.layers import Dense, Flatten
    from pydtnn.model import Model

    def made(momentum):
        model = Model([Flatten(), Dense(7)], (1, 4, 4), CPUBackend("float64"))
        return model, reducers.create("topk", SingleProcess(), density=0.1, momentum=momentum).attach(model)

    model, red = made(0.9)
    rng = np.random.default_rng(1)
    u, kept = np.zeros(model.grad_buffer.size), np.zeros(model.grad_buffer.size)
    for weight in (1.0, 0.5, 1.0, 1.0):
        g = rng.standard_normal(model.grad_buffer.size)
        model.grad_buffer[...] = g
        red.begin_step(weight)
        red.finish()
        u = 0.9 * u + weight * g
        acc = kept + u
        sent = model.grad_buffer.copy()
        assert np.count_nonzero(sent) == red.k
        assert np.abs(acc[sent != 0]).min() >= np.abs(acc[sent == 0]).max()
        np.testing.assert_allclose(sent + red.residual, acc, rtol=1e-14, atol=1e-14)
        u[sent != 0] = 0
        np.testing.assert_array_equal(red.velocity, u)
        kept = red.residual.copy()
    other = made(0.9)[1]
    other.load_state_dict(red.state_dict())
    np.testing.assert_array_equal(other.velocity, u)
    with pytest.raises(ConfigError, match="saved without momentum correction"):
        made(0.9)[1].load_state_dict({"residual": kept})
    with pytest.raises(ConfigError, match="saved with momentum correction"):
        made(0.0)[1].load_state_dict(red.state_dict())
    with pytest.raises(ConfigError, match=r"momentum must be in \[0, 1\), got 1.5"):
        made(1.5)


def test_topk_finds_exactly_the_k_largest_from_a_sample_or_falls_back_to_a_full_partition():
    from pydtnn.distributed.reducers.topk import SAMPLE, largest

    rng = np.random.default_rng(1)
    mag = np.abs(rng.standard_normal(10 * SAMPLE)).astype(np.float32)
    k = 6554  # 1%
    want = np.sort(np.argpartition(mag, mag.size - k)[mag.size - k:])
    sample = np.sort(rng.choice(mag.size, SAMPLE, replace=False))
    np.testing.assert_array_equal(np.sort(largest(mag, k, sample)), want)
    # a sample of the smallest entries only puts the threshold where more than k pass: still exact
    low = np.argsort(mag)[:SAMPLE]
    np.testing.assert_array_equal(np.sort(largest(mag, k, np.sort(low))), want)
    # a sample of the largest entries puts it where fewer than k pass: the whole array is partitioned
    high = np.argsort(mag)[-SAMPLE:]
    np.testing.assert_array_equal(np.sort(largest(mag, k, np.sort(high))), want)
    np.testing.assert_array_equal(np.sort(largest(mag, k)), want)


def test_topk_on_a_large_model_uses_the_sample_and_keeps_exactly_the_rest():
    """Over 8 x SAMPLE gradients the reducer places its threshold from the sample; sent + kept is still
    the accumulated gradient and the sent entries are the k largest."""
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.distributed.reducers.topk import SAMPLE
    from pydtnn.layers import Dense, Flatten
    from pydtnn.model import Model

    model = Model([Flatten(), Dense(600)], (1, 30, 30), CPUBackend("float32"))
    red = reducers.create("topk", SingleProcess(), density=0.01).attach(model)
    assert model.grad_buffer.size >= 8 * SAMPLE and red.sample is not None
    g = np.random.default_rng(2).standard_normal(model.grad_buffer.size).astype(np.float32)
    model.grad_buffer[...] = g
    red.begin_step(1.0)
    red.finish()
    sent = model.grad_buffer.copy()
    assert np.count_nonzero(sent) == red.k
    assert np.abs(g[sent != 0]).min() >= np.abs(g[sent == 0]).max()
    np.testing.assert_array_equal(sent + red.residual, g)


@pytest.mark.parametrize("n", [1, 2])
def test_gradient_accumulation_equals_one_big_batch(single, tmp_path, n):
    r = launch(n, tmp_path, "--accumulate", "3", "--strategies", "bucketed,per_layer")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("single",) if n == 1 else ("bucketed", "per_layer"), what=f"np={n}")


def test_synchronized_batchnorm_equals_one_process(tmp_path):
    """With BatchNorm, N processes equal one only when statistics span the global batch."""
    ref, par = tmp_path / "ref", tmp_path / "par"
    ref.mkdir(), par.mkdir()
    r = subprocess.run([sys.executable, WORKER, str(ref), "--sync_bn"], capture_output=True, text=True,
                       timeout=240, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(3, par, "--sync_bn", "--strategies", "bucketed,blocking")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(ref, par, ("bucketed", "blocking"), (("float64", 1e-11), ("float32", 1e-4)), "sync BN")


def test_fp16_compression_halves_the_bytes_and_stays_close(single, tmp_path):
    full, half = tmp_path / "full", tmp_path / "half"
    full.mkdir(), half.mkdir()
    for out, extra in ((full, []), (half, ["--fp16"])):
        r = launch(2, out, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    # fp16 rounding of each step's gradients: close to one process (over the whole parameter vector), not equal
    for dtype in ("float64", "float32"):
        want, _ = read(single / f"single-{dtype}.safetensors")
        ref = np.concatenate([v.ravel() for v in want.values()]).astype(np.float64)
        for strategy in STRATEGIES:
            got, _ = read(half / f"{strategy}-{dtype}.safetensors")
            vec = np.concatenate([got[k].ravel() for k in want]).astype(np.float64)
            err = np.linalg.norm(vec - ref) / np.linalg.norm(ref)
            assert err < 5e-2, (strategy, dtype, err)  # measured about 1.6e-2 after 22 steps
    for strategy in STRATEGIES:
        for dtype, ratio in (("float64", 4), ("float32", 2)):
            a, b = (int(read(d / f"{strategy}-{dtype}.safetensors")[1]["bytes"]) for d in (full, half))
            assert a == ratio * b > 0, (strategy, dtype, a, b)
        p16, _ = read(half / f"{strategy}-float64.safetensors")
        p32, _ = read(full / f"{strategy}-float64.safetensors")
        assert any(not np.array_equal(p16[k], p32[k]) for k in p16)  # the wire format really changed


def test_repeated_runs_give_identical_parameters(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for out in (a, b):
        r = launch(2, out, "--strategies", "bucketed")
        assert r.returncode == 0, r.stderr[-3000:]
    for dtype in ("float64", "float32"):
        assert read(a / f"bucketed-{dtype}.safetensors")[1]["sha"] == read(b / f"bucketed-{dtype}.safetensors")[1]["sha"]


def test_a_failing_rank_ends_the_whole_job(tmp_path):
    """Rank 1 of 3 raises at step 5: its traceback under its rank, exit code 1 (an internal error). The stall
    timeout (300 s, the worker's default) is longer than the test's, so the job ends in time only if the abort
    handler ends it."""
    r = launch(3, tmp_path, "--raise_at", "5", "--raise_rank", "1", "--strategies", "per_layer", timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "rank 1: Traceback (most recent call last):" in r.stderr, r.stderr[-2000:]
    assert "RuntimeError: deliberate failure at step 5" in r.stderr, r.stderr[-2000:]


def test_stalled_rank_is_reported_by_the_watchdog(tmp_path):
    """Rank 2 sleeps 120 s, longer than the test's timeout: the 2 s watchdog ends the job (exit code 1)."""
    r = launch(3, tmp_path, "--stall_at", "4", "--raise_rank", "2", "--stall_timeout", "2", "--strategies", "bucketed",
               timeout=90)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "rank 0: stalled" in r.stderr and "ranks that have not arrived: 2;" in r.stderr, r.stderr[-2000:]


def test_debug_collectives_names_the_first_mismatch(tmp_path):
    r = launch(2, tmp_path, "--mismatch_at", "3", "--raise_rank", "1", "--debug_collectives", "--strategies",
               "blocking", timeout=90)
    assert r.returncode == 2, r.stderr[-2000:]  # a CollectiveMismatch, a PydtnnError: one line, no traceback
    assert "differs between ranks" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "rank 1: allreduce float64 x 3" in r.stderr and "rank 0: allreduce" in r.stderr


def test_debug_collectives_passes_a_correct_run(tmp_path):
    r = launch(2, tmp_path, "--debug_collectives", "--strategies", "per_layer")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_user_error_on_one_rank_ends_every_rank(tmp_path):
    """Only rank 0 writes checkpoints, so only rank 0 finds that the directory is a file."""
    (tmp_path / "afile").write_text("not a directory")
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--num_epochs", "1", "--progress", "false",
                        "--checkpoint_dir", str(tmp_path / "afile"), "--stall_timeout", "600"],
                       capture_output=True, text=True, timeout=90, env=ENV)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pydtnn: error: rank 0:" in r.stderr and "afile" in r.stderr, r.stderr[-2000:]


def test_cli_under_mpiexec_matches_single_process(tmp_path):
    common = ["-m", "pydtnn", "--model", "simplemlp", "--num_epochs", "1", "--steps_per_epoch", "15",
              "--global_batch_size", "48", "--progress", "false", "--dtype", "float64"]
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"m{n}.jsonl"
        cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, *common, "--metrics_file", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        import json

        runs[n] = [json.loads(s) for s in out.read_text().splitlines()]
    assert runs[2][-1]["world_size"] == 2
    assert runs[1][0]["loss"] == pytest.approx(runs[2][0]["loss"], rel=1e-9)
    assert runs[1][-1]["test_accuracy"] == pytest.approx(runs[2][-1]["test_accuracy"], abs=1e-9)


class Recorder(SingleProcess):
    """One process that records the buffers it is asked to reduce."""

    def __init__(self):
        self.seen = []

    def allreduce(self, buf, label=""):
        self.seen.append(buf)
        return super().allreduce(buf, label)

    def iallreduce(self, buf, label=""):
        self.seen.append(buf)
        return super().iallreduce(buf, label)


@pytest.mark.parametrize("strategy", ["blocking", "bucketed", "per_layer"])
def test_reducers_work_in_place_on_the_model_gradient_buffer(strategy, monkeypatch):
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers

    monkeypatch.setattr(reducers.base, "PIECE_BYTES", 4096)
    model = models.create("simplecnn", backend=CPUBackend("float64", seed=1))
    assert all(np.shares_memory(g, model.grad_buffer) for _, _, g in model.parameters())
    comm = Recorder()
    options = {"bucket_mb": 0.05, "first_bucket_mb": 0.01} if strategy == "bucketed" else {}
    red = reducers.create(strategy, comm, **options).attach(model)
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((4, 1, 28, 28)), rng.standard_normal((4, 10))
    with red.no_sync():  # backward first, then report the gradients ready, as gradient accumulation does
        model.forward(x, training=True)
        model.backward(dy)
    before = {n: g.copy() for n, _, g in model.parameters()}
    red.begin_step(0.25)
    red.replay()
    red.finish()  # the identity reduction: what is left is the scaling by the weight
    for n, _, g in model.parameters():
        np.testing.assert_array_equal(g, 0.25 * before[n])
    assert len(comm.seen) > 10  # 4 KB pieces
    assert all(0 < b.nbytes <= 4096 and np.shares_memory(b, model.grad_buffer) for b in comm.seen)
    assert sum(b.size for b in comm.seen) == model.grad_buffer.size


def test_no_sync_holds_back_reductions_and_ends_with_its_block_even_on_an_exception():
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers

    model = models.create("simplecnn", backend=CPUBackend("float64", seed=1))
    comm = Recorder()
    red = reducers.create("per_layer", comm).attach(model)  # starts a reduction per gradient as it is ready
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((4, 1, 28, 28)), rng.standard_normal((4, 10))
    with pytest.raises(RuntimeError, match="mid-step"), red.no_sync():
        model.forward(x, training=True)
        model.backward(dy)
        assert comm.seen == []
        raise RuntimeError("mid-step")
    red.begin_step(1.0)
    model.forward(x, training=True)
    model.backward(dy)  # the hooks reduce again
    red.finish()
    assert sum(b.size for b in comm.seen) == model.grad_buffer.size


def test_fp16_compression_keeps_its_own_wire_buffer():
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers

    model = models.create("simplecnn", backend=CPUBackend("float32", seed=1))
    comm = Recorder()
    red = reducers.create("blocking", comm, compression="fp16").attach(model)
    red.begin_step(1.0)
    model.forward(np.zeros((2, 1, 28, 28), np.float32), training=True)
    model.backward(np.ones((2, 10), np.float32))
    red.finish()
    assert comm.seen and all(b.dtype == np.float16 and not np.shares_memory(b, model.grad_buffer) for b in comm.seen)


class TwoAlike(SingleProcess):
    """Two ranks whose gradients are alike: the other rank's are `other` times this rank's, so every sum is
    (1 + other) times this rank's values, rounded as the wire's dtype rounds (an fp16 sum is computed in
    fp16, as MPI's operator for it does)."""

    size = 2

    def __init__(self, other=1.0):
        self.other = other

    def allreduce(self, buf, label=""):
        np.add(buf, buf * buf.dtype.type(self.other), out=buf)
        return buf

    def iallreduce(self, buf, label=""):
        self.allreduce(buf, label)
        return super().iallreduce(buf, label)

    def allreduce_sum(self, values, label="metrics"):
        return (1 + self.other) * np.array(values, dtype=np.float64)


@pytest.mark.parametrize("strategy", ["blocking", "bucketed", "per_layer"])
@pytest.mark.parametrize("size,other", [(1e-9, 1.0), (1e5, 1.0), (1.0, 3.0)])
def test_fp16_wire_scales_gradients_out_of_its_range_into_it(strategy, size, other):
    """Gradients of 1e-9 lie under fp16's smallest value (6e-8) and would arrive as zeros; of 1e5 over its
    largest (65504) and would arrive as infinities. Scaled by a power of two per gradient, each keeps fp16's
    11 significant bits: two alike ranks at weight 1/2 give back each rank's gradient to that precision.
    Where the other rank's gradients are 3 times larger, a scale from this rank's alone would put the sum
    over fp16's largest: the scale bounds the sum over the ranks."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers

    x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)
    dy = (np.random.default_rng(1).standard_normal((4, 10)) * size).astype(np.float32)
    want = models.create("simplecnn", backend=CPUBackend("float32", seed=1))
    want.forward(x, training=True)
    want.backward(dy)
    model = models.create("simplecnn", backend=CPUBackend("float32", seed=1))
    options = {"bucket_mb": 0.05, "first_bucket_mb": 0.01} if strategy == "bucketed" else {}
    red = reducers.create(strategy, TwoAlike(other), compression="fp16", **options).attach(model)
    red.begin_step(0.5)
    model.forward(x, training=True)
    model.backward(dy)
    red.finish()
    assert len(red.compression.scales) == len(model.parameters())
    for (name, _, g), (_, _, ref) in zip(model.parameters(), want.parameters()):
        top = float(np.abs(ref).max())
        assert 2.0**-9 < top / size < 2.0**12, (name, top)  # the gradients really are that far out of range
        mean = ref * ((1 + other) / 2)
        np.testing.assert_allclose(g, mean, rtol=2.0**-10, atol=top * 2.0**-22, err_msg=name)


def test_fp16_wire_scale_is_one_where_the_bound_is_zero_or_not_finite():
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers

    model = models.create("simplecnn", backend=CPUBackend("float32", seed=1))
    red = reducers.create("blocking", TwoAlike(), compression="fp16").attach(model)
    (a, _, ga), (b, _, gb), (c, _, gc) = model.parameters()[:3]
    for _, _, g in model.parameters():
        g[...] = 0.25
    ga[...], gb.flat[0], gc[...] = 0.0, np.nan, 3.0
    red.begin_step(0.5)
    red.finish()
    assert red.compression.scales[a] == 1.0 and red.compression.scales[b] == 1.0 and red.compression.scales[c] == 2.0**13
    assert np.all(ga == 0) and np.isnan(gb.flat[0]) and np.all(gc == 3.0)


@pytest.mark.parametrize("strategy", ["blocking", "bucketed", "per_layer"])
@pytest.mark.parametrize("case", ["tiny", "zero", "infinite"])
def test_fp16_wire_brings_tiny_zero_and_infinite_gradients_back_without_nan(strategy, case):
    """Two alike ranks at weight 1/2, one gradient set by hand after backward (accumulation's replay), the
    others 0.25. Largest entry 1e-36 (a bound of 2^-119): a scale of 2^134 would be infinite in float32 and
    send its zeros as NaN; the shift is clamped, and the entries come back as zeros or close, zeros as zeros.
    All zeros: back as zeros. One infinite entry among entries of 1000: a scale read off the infinite bound
    would push the finite ones over fp16's largest (65504); they come back as sent, the infinity too."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers

    model = models.create("simplecnn", backend=CPUBackend("float32", seed=1))
    options = {"bucket_mb": 0.05, "first_bucket_mb": 0.01} if strategy == "bucketed" else {}
    red = reducers.create(strategy, TwoAlike(), compression="fp16", **options).attach(model)
    with red.no_sync():  # backward reports every gradient ready once; the reductions wait for replay()
        model.forward(np.zeros((2, 1, 28, 28), np.float32), training=True)
        model.backward(np.ones((2, 10), np.float32))
    (name, _, g), rest = model.parameters()[0], model.parameters()[1:]
    for _, _, other in rest:
        other[...] = 0.25
    g[...] = 0.0
    if case == "tiny":
        g.flat[::2] = 1e-36
    elif case == "infinite":
        g[...] = 1000.0
        g.flat[0] = np.inf
    sent = g.copy()
    red.begin_step(0.5)
    red.replay()
    red.finish()
    assert all(np.all(other == 0.25) for _, _, other in rest)
    if case == "infinite":
        assert g.flat[0] == np.inf and np.all(g.flat[1:] == 1000.0), (name, g.flat[:4])
    else:
        assert np.all(np.isfinite(g)), (name, g.flat[:4])
        assert np.all(g[sent == 0] == 0) and np.all(np.abs(g - sent) <= 1e-36), (name, g.flat[:4])


def test_shard_bounds():
    assert shard_bounds(10, 3) == [0, 4, 7, 10]
    assert shard_bounds(2, 3) == [0, 1, 2, 2]
    assert shard_bounds(9, 3) == [0, 3, 6, 9]


@pytest.mark.parametrize("n,m,size", [(12, 4, 2), (10, 4, 3), (7, 3, 2), (5, 4, 3), (9, 1, 2), (32, 3, 4)])
def test_the_ranks_parts_of_each_micro_batch_make_one_process_micro_batch(n, m, size):
    """Rank r takes its part of micro-batch i of the global batch: the ranks' i-th parts, in rank order, are
    one process's i-th micro-batch (step.micro_bounds), every element is taken once, the remainders rotate
    (no rank takes more than one sample above another over a step, where M <= P), and a rank's local rows
    cut its own batch into those parts."""
    from pydtnn.step import micro_bounds

    parts = [micro_shares(n, m, size, r) for r in range(size)]
    for i, (a, b) in enumerate(micro_bounds(n, m)):
        assert all(parts[r][i][:2] == (a, b) for r in range(size))
        assert [p for r in range(size) for p in range(*parts[r][i][2:])] == list(range(b - a))
    totals = [sum(hi - lo for *_, lo, hi in parts[r]) for r in range(size)]
    assert sum(totals) == n and (m > size or max(totals) - min(totals) <= 1), totals
    for r in range(size):
        rows = local_rows(parts[r])
        assert [hi - lo for lo, hi in rows] == [hi - lo for *_, lo, hi in parts[r]] and rows[0][0] == 0
        assert all(x[1] == y[0] for x, y in zip(rows, rows[1:]))
    assert micro_shares(9, 1, 2, 1) == [(0, 9, 5, 9)]  # one micro-batch: the shard_bounds share


def test_resume_at_another_world_size_and_trace_per_rank(tmp_path):
    """One process trains an epoch and saves; two resume it for a second epoch of the same global batches: the
    parameters one process reaches in two epochs without a break (float64, to 1e-12 of each tensor's scale)."""
    import json

    base = [sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--steps_per_epoch", "6", "--dtype", "float64",
            "--global_batch_size", "32", "--progress", "false"]
    for extra in (["--num_epochs", "2", "--checkpoint_dir", "whole"], ["--num_epochs", "1", "--checkpoint_dir", "ck"]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=180, env=ENV, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([MPIEXEC, "-n", "2"] + base + ["--checkpoint_dir", "ck", "--num_epochs", "2", "--resume", "ck",
                       "--tracing", "--metrics_file", str(tmp_path / "m.jsonl")],
                       capture_output=True, text=True, timeout=180, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (want, _), (got, _) = (read(tmp_path / d / "model.safetensors") for d in ("whole", "ck"))
    assert got.keys() == want.keys()
    for k in want:
        err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err <= 1e-12, f"{k}: relative difference {err:.3g}"
    assert "resumed" in r.stderr and "hidden behind computation" in r.stderr
    lines = [json.loads(s) for s in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x.get("epoch") for x in lines[:-1]] == [1, 2] and lines[-1]["world_size"] == 2
    for rank in (0, 1):
        events = json.loads((tmp_path / f"pydtnn-trace.rank{rank}.json").read_text())["traceEvents"]
        cats = {e.get("cat") for e in events}
        assert {"allreduce", "wait", "forward", "backward"} <= cats, cats


@pytest.mark.slow
@pytest.mark.parametrize("bad,word", [(["--batch_size", "0"], "--batch_size"),
                                      (["--resume", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
                                      (["--config", "/nonexistent/run.yaml"], "/nonexistent/run.yaml")])
def test_a_user_error_before_mpi_is_up_ends_every_rank(tmp_path, bad, word):
    """Flags are parsed (and files named by them read) before the run starts; a rank that fails there
    used to exit alone while the others spun in MPI_Init forever (past the test's timeout)."""
    common = [sys.executable, "-m", "pydtnn", "--num_epochs", "2", "--progress", "false"]
    r = subprocess.run([MPIEXEC, "-n", "1", *common, ":", "-n", "1", *common, *bad],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [s for s in r.stderr.splitlines() if s.startswith("pydtnn: error: rank 1: ")]
    assert len(lines) == 1 and word in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize("leaver,debug", [(1, False), (0, False), (1, True)])
def test_a_rank_that_leaves_cleanly_is_named_and_ends_the_job(tmp_path, leaver, debug):
    """A process that ends with exit code 0 in the middle of training: the others learn it at once
    (the stall timeout is longer than the test's) and the report names the rank that left, --debug_collectives
    or not; exit code 1."""
    r = launch(3, tmp_path, "--exit_at", "4", "--raise_rank", str(leaver), "--strategies", "bucketed",
               "--stall_timeout", "200", *(["--debug_collectives"] if debug else []), timeout=90)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"rank {leaver} (after collective #" in r.stderr and "left the job" in r.stderr, r.stderr[-2000:]


def _parent_pid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _descends_from(pid, ancestor):
    while pid > 1:
        pid = _parent_pid(pid)
        if pid == ancestor:
            return True
    return False


def _rank_pid(rank, parent):
    """PID of the pydtnn process of MPI rank `rank` (from its environment) started by the launcher
    `parent` (not another job's on this machine), or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            mine = int(pid) != parent and _descends_from(int(pid), parent)
        except (OSError, ValueError, IndexError):
            continue
        if mine and b"pydtnn" in cmd and f"PMI_RANK={rank}".encode() in env:
            return int(pid)
    return None


def signal_rank(p, header, rank, sig):
    """Once mpiexec's job `p` (stderr piped) has printed the line starting with `header` (rank 0 prints the
    run's header once every rank has built its model), and a second later, send `sig` to rank `rank`."""
    for line in p.stderr:
        if line.startswith(header):
            break
    time.sleep(1.0)
    pid = _rank_pid(rank, p.pid)
    assert pid is not None
    os.kill(pid, sig)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process in /proc")
def test_sigint_to_one_rank_ends_the_job_at_once(tmp_path):
    import signal

    p = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--num_epochs", "50",
                          "--progress", "false", "--metrics_file", str(tmp_path / "m.jsonl")],
                         stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        signal_rank(p, "pydtnn: sgd, learning rate", 1, signal.SIGINT)
        err = p.communicate(timeout=60)[1]  # rank 0's stall timeout (300 s) is longer: only the abort ends it
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "pydtnn: error: rank 1: interrupted; ending the job" in err, err[-2000:]


def _idx_dir(path, seed):
    """An MNIST-layout directory of 40 train and 20 test random digits."""
    from pydtnn.data import write_idx

    rng = np.random.default_rng(seed)
    path.mkdir()
    for stem, n in (("train", 40), ("t10k", 20)):
        write_idx(path / f"{stem}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(path / f"{stem}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
    return path


@pytest.mark.parametrize("case", ["batch_size", "model", "data", "epochs", "watchdog", "debug"])
def test_ranks_that_disagree_are_stopped_before_training(tmp_path, case):
    """Differing flags or data used to hang until the stall timeout, end in an mpi4py traceback, or
    (batch 16 against 32) run to exit 0 on overlapping samples."""
    common = ["--progress", "false", "--num_epochs", "2", "--steps_per_epoch", "3", "--model", "simplemlp"]
    a, b = list(common), list(common)
    want = {"batch_size": ("batch_size", ["--batch_size", "16"], ["--batch_size", "32"]),
            "model": ("model", ["--model", "simplemlp"], ["--model", "simplecnn"]),
            "epochs": ("num_epochs", ["--num_epochs", "2"], ["--num_epochs", "3"]),
            # these change how collectives are issued (blocking or not, checked or not)
            "watchdog": ("stall_timeout", [], ["--stall_timeout", "0"]),
            "debug": ("debug_collectives", [], ["--debug_collectives"]),
            "data": ("train set", ["--dataset", "mnist", "--dataset_train_path", str(_idx_dir(tmp_path / "a", 1))],
                     ["--dataset", "mnist", "--dataset_train_path", str(_idx_dir(tmp_path / "b", 2))])}[case]
    a += want[1]
    b += want[2]
    r = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-m", "pydtnn", *a, ":",
                        "-n", "1", sys.executable, "-m", "pydtnn", *b, "--metrics_file", str(tmp_path / "m.jsonl")],
                       capture_output=True, text=True, timeout=90, env=ENV)  # the stall timeout (300 s) is longer
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [s for s in r.stderr.splitlines() if s.startswith("pydtnn: error:")]
    assert len(lines) == 1, r.stderr[-2000:]
    assert f"the processes disagree on {want[0]}" in lines[0] and "rank 0: " in lines[0] and "rank 1: " in lines[0]
    assert not (tmp_path / "m.jsonl").exists()
