"""PowerSGD (--reduction powersgd): its arithmetic against a NumPy version written out step by step, the full rank
equal to one process, fewer bytes at a low rank, a resumed run equal to an uninterrupted one, its messages as the
performance model prices them, and what it refuses."""

import sys

import numpy as np
import pytest
from test_distributed import (  # noqa: F401 (single: a fixture)
    ENV,
    MPIEXEC,
    assert_same_parameters,
    launch,
    read,
    refused_in_one_line,
    resumed_equals_whole,
    single,
)

from pydtnn.backends import CPUBackend
from pydtnn.distributed import reducers
from pydtnn.distributed.comm import SingleProcess
from pydtnn.distributed.reducers.layout import powersgd_matrices, powersgd_messages
from pydtnn.distributed.reducers.powersgd import SEED
from pydtnn.layers import Conv2D, Dense, Flatten, ReLU
from pydtnn.model import Model


class Ranks(SingleProcess):
    """One process standing for `k` ranks whose gradients are all its own: an allreduce multiplies by k."""

    def __init__(self, k):
        self.k = k

    def allreduce(self, buf, label=""):
        buf *= self.k


def _model():
    return Model([Conv2D(6, 3), ReLU(), Flatten(), Dense(5)], (2, 5, 5), CPUBackend("float64", seed=1))


def test_powersgd_arithmetic_equals_a_numpy_version_step_by_step():
    """Three steps over 3 ranks with equal gradients (each weighted 1/3): P = M Q summed, orthonormalized by QR,
    Q = M^T P summed, the gradient P Q^T, the residual M - w P Q^T carried into the next step, Q warm-started;
    the biases sent as they are."""
    model = _model()
    red = reducers.create("powersgd", Ranks(3), rank=2).attach(model)
    grads = dict(model.gradients())
    names = list(grads)
    mats = dict(zip(names, powersgd_matrices([grads[n].shape for n in names], 2, 2.0)))
    assert [n for n in names if mats[n]] == ["0.weight", "3.weight"]  # 6 x 18 and 54 x 5 at rank 2
    rng = np.random.default_rng(SEED)
    q = {n: rng.standard_normal((m[1], m[2])) for n, m in mats.items() if m}
    e = {n: np.zeros_like(g) for n, g in grads.items()}
    draw = np.random.default_rng(5)
    for _ in range(3):
        g = {n: draw.standard_normal(v.shape) for n, v in grads.items()}
        for n in names:
            grads[n][...] = g[n]
        red.begin_step(1 / 3)
        red.finish()
        for n in names:
            m = g[n] / 3 + e[n]
            if not mats[n]:
                np.testing.assert_allclose(grads[n], g[n], rtol=1e-13, atol=1e-13)  # 3 equal shares summed
                continue
            mm = m.reshape(mats[n][0], -1)
            p = np.linalg.qr(3 * mm @ q[n])[0]
            q[n] = 3 * mm.T @ p
            approx = p @ q[n].T
            e[n] = (mm - approx / 3).reshape(m.shape)
            np.testing.assert_allclose(grads[n], approx.reshape(m.shape), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(red.residual, np.concatenate([e[n].reshape(-1) for n in names]), atol=1e-12)
    state = red.state_dict()
    other = reducers.create("powersgd", Ranks(3), rank=2).attach(_model())
    other.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(other.qs, red.qs) if a is not None) and other.residual.any()


def test_powersgd_sends_whole_gradients_before_its_start_step():
    model = _model()
    red = reducers.create("powersgd", Ranks(2), rank=1, start_step=2).attach(model)
    sizes, missed = [], []
    draw = np.random.default_rng(0)
    for _ in range(3):
        for _, g in model.gradients():
            g[...] = draw.standard_normal(g.shape)
        before = red.bytes_reduced
        red.begin_step(0.5)
        red.finish()
        sizes.append(red.bytes_reduced - before)
        missed.append(bool(red.residual.any()))
    whole = sum(g.nbytes for _, g in model.gradients())
    assert sizes[:2] == [whole, whole] and sizes[2] < whole / 3 and missed == [False, False, True]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_powersgd_at_full_rank_equals_one_process(single, tmp_path, n):  # noqa: F811 (the fixture)
    """At rank min(n, m), every matrix compressed (min_compression_rate 0): P P^T spans the sum, so P Q^T is the
    sum of the ranks' gradients, and the residuals add up to nothing: the dense result, to rounding."""
    r = launch(n, tmp_path, "--strategies", "powersgd", "--rank", "1000", "--min_compression_rate", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("powersgd",), rtols=(("float64", 1e-12), ("float32", 2e-4)),
                           what=f"np={n}")


@pytest.mark.slow
def test_powersgd_in_two_levels_over_two_emulated_nodes_equals_one_process(single, tmp_path):  # noqa: F811
    """np 4 as 2 nodes of 2 (--powersgd_hierarchical, --ranks_per_node 2): each P and Q summed into the node's
    leader, allreduced between the leaders, broadcast back; at full rank the dense result."""
    r = launch(4, tmp_path, "--strategies", "powersgd", "--rank", "1000", "--min_compression_rate", "0",
               "--ranks_per_node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("powersgd",), rtols=(("float64", 1e-12), ("float32", 2e-4)),
                           what="np=4 as 2 nodes")


def test_powersgd_in_two_levels_reduces_through_the_node_and_its_leaders():
    """The two levels' calls, on fake node and leader communicators: every piece summed into the node's rank 0,
    allreduced among the leaders, broadcast back, in that order."""
    calls = []

    class Level(SingleProcess):
        def __init__(self, name):
            self.label = name

        def ireduce(self, buf, root=0, label=""):
            calls.append((self.label, "reduce", buf.size))
            return super().ireduce(buf, root, label)

        def ibcast(self, buf, root=0, label=""):
            calls.append((self.label, "bcast", buf.size))
            return super().ibcast(buf, root, label)

        def allreduce(self, buf, label=""):
            calls.append((self.label, "allreduce", buf.size))
            buf *= 2  # two nodes of equal sums
            return buf

    red = reducers.create("powersgd", Ranks(2), rank=1).attach(_model())
    red.node, red.leaders = Level("node"), Level("leaders")
    for _, g in red.gradients:
        g[...] = 1.0
    red.begin_step(0.5)
    red.finish()
    sizes = [red.first.size, red.second.size]
    assert calls == [c for n in sizes for c in (("node", "reduce", n), ("leaders", "allreduce", n),
                                                 ("node", "bcast", n))]


@pytest.mark.slow
def test_powersgd_at_rank_one_sends_a_fraction_of_the_bytes_and_still_learns(tmp_path):
    r = launch(2, tmp_path, "--strategies", "bucketed,powersgd", "--rank", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    (_, dense), (_, low) = (read(tmp_path / f"{name}-float64.safetensors") for name in ("bucketed", "powersgd"))
    assert int(low["bytes"]) < int(dense["bytes"]) / 4
    assert float(low["loss"]) < 2.2  # from ln 10 = 2.30 at the start (dense: 0.83 after these 20 steps)


def test_powersgd_messages_follow_the_matrices_it_compresses():
    shapes = [(16, 3, 1, 1), (16,), (10, 400), (10,)]
    counts = [48, 16, 4000, 10]
    # (16 + 3) x 3 (its rank capped at 3) x 2 > 48: whole; (10 + 400) x 4 x 2 <= 4000: compressed
    assert powersgd_matrices(shapes, 4, 2.0) == [None, None, (10, 400, 4), None]
    sent = powersgd_messages(counts, 4, 1 << 20, 4, 2.0, shapes)
    assert [(m.collective, m.params, m.nbytes) for m in sent] == [("allreduce", None, (48 + 16 + 40 + 10) * 4),
                                                                  ("allreduce", None, 400 * 4 * 4)]
    priced = reducers.messages("powersgd", counts, 4, shapes=shapes, rank=4)
    assert [m.nbytes for m in priced] == [m.nbytes for m in sent]
    with pytest.raises(Exception, match="expected one shape per gradient, got none for 4"):
        reducers.messages("powersgd", counts, 4)


@pytest.mark.parametrize("flags, words", [
    (["--reduction", "bucketed", "--rank", "2"], "--rank applies to the powersgd reducer over several processes"),
    pytest.param(["--reduction", "powersgd", "--zero", "1"], "powersgd leaves each replica its own residual",
                 marks=pytest.mark.slow),
    pytest.param(["--reduction", "powersgd", "--gradient_compression", "fp16"], "powersgd reducer: compression 'fp16'",
                 marks=pytest.mark.slow),
    pytest.param(["--reduction", "powersgd", "--rank", "0"], "--rank: expected", marks=pytest.mark.slow),
    pytest.param(["--powersgd_hierarchical", "true"], "--powersgd_hierarchical applies to the powersgd reducer",
                 marks=pytest.mark.slow),
])
def test_powersgd_refuses_what_it_cannot_take_in_one_line(tmp_path, flags, words):
    refused_in_one_line(tmp_path, flags, words)


@pytest.mark.slow
def test_a_powersgd_run_resumes_bit_identically_across_its_start_step(tmp_path):
    """The residuals (one row per rank) and Q (the same on every rank) are saved; the step count is the
    optimizer's, so a run resumed after 4 steps still starts the low-rank steps at step 6: 1 + 1 epochs end
    exactly where 2 do."""
    from safetensors.numpy import load_file

    base = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
            "--dtype", "float64", "--global_batch_size", "32", "--steps_per_epoch", "4", "--progress", "false",
            "--reduction", "powersgd", "--rank", "2", "--powersgd_start_step", "6"]
    def nothing_missed_yet(saved):  # no low-rank step yet after 4
        assert not saved["@reducer.residual"].any()

    resumed_equals_whole(base, tmp_path, nothing_missed_yet)
    state = load_file(str(tmp_path / "full" / "optimizer.safetensors"))
    assert state["@reducer.residual"].shape[0] == 2 and np.abs(state["@reducer.residual"]).sum() > 0
    assert np.array_equal(state["@reducer.q"][0], state["@reducer.q"][1]) and state["@reducer.q"].any()
