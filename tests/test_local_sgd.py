"""Local SGD (--local_sgd H): every process steps on its own gradients and the replicas average their parameters
and optimizer state every H steps and at each epoch's end. H = 1 with weighted averages equals one process,
post-local SGD's data-parallel steps equal the blocking reducer's, the replicas end every epoch equal, a resumed
run equals an uninterrupted one, and what it cannot take is refused in one line."""

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

from pydtnn.distributed.reducers import layout


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_local_sgd_averaging_every_step_by_samples_equals_one_process(single, tmp_path, n):  # noqa: F811
    """SGD with momentum 0.9, uneven last batches: the replicas' updates from one point, averaged by their shares
    of the samples, are the update by the average gradient, and the momentum buffers average alike."""
    r = launch(n, tmp_path, "--strategies", "local_sgd", "--every", "1", "--average", "weighted")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("local_sgd",), what=f"np={n}")


def test_local_sgd_replicas_end_each_epoch_equal_and_its_first_steps_are_data_parallel(tmp_path):
    """H = 3 (the 2 x 11 steps do not end on an average: the epoch's end averages), and post-local SGD over every
    step equals the blocking reducer to rounding."""
    r = launch(2, tmp_path, "--strategies", "bucketed,local_sgd", "--every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    for dtype in ("float64", "float32"):
        a, _ = read(tmp_path / f"local_sgd-{dtype}-rank0.safetensors")
        b, _ = read(tmp_path / f"local_sgd-{dtype}-rank1.safetensors")
        assert all(np.array_equal(a[k], b[k]) for k in a)
    (_, dense), (_, local) = (read(tmp_path / f"{s}-float64.safetensors") for s in ("bucketed", "local_sgd"))
    # an average every 3 of the 22 steps and at the 2 epochs' ends, each of the parameters and momentum buffers
    assert int(local["bytes"]) < 0.8 * int(dense["bytes"]) and float(local["loss"]) < 2.0
    (tmp_path / "post").mkdir()
    r = launch(2, tmp_path / "post", "--strategies", "blocking,local_sgd", "--post_local", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    (_, blocking), (_, post) = (read(tmp_path / "post" / f"{s}-float64.safetensors") for s in ("blocking",
                                                                                                "local_sgd"))
    assert blocking["sha"] == post["sha"]  # the same allreduce of the same weighted gradients, every step


def test_a_local_step_keeps_the_own_gradients_but_an_empty_share_moves_nothing():
    """After post_local steps the gradients stay the process's own (no reduction, not weighted); a step whose share
    of the global batch is empty (weight 0: its stand-in sample's gradient) leaves them zero."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.distributed.comm import SingleProcess

    model = models.create("simplecnn", backend=CPUBackend("float64"))
    red = reducers.create("local_sgd", SingleProcess(), every=2, post_local=1).attach(model)
    grads = [g for _, g in model.gradients()]
    for step, weight in enumerate((0.5, 0.5, 0.0)):
        for g in grads:
            g[...] = 1.0
        red.begin_step(weight)
        red.finish()
        want = 0.5 if step == 0 else 1.0 if weight else 0.0  # the first step data parallel: weighted and summed
        assert all(np.all(g == want) for g in grads), step
        red.step += 1


def test_local_sgd_prices_one_average_every_h_steps():
    """1 / H of the parameters and of the optimizer's arrays per parameter (SGD's momentum by default)."""
    from pydtnn.distributed import reducers

    for state, entries in ((0, 256), (1, 512), (2, 768)):
        sent = layout.local_sgd_messages([1000, 24], 4, 1 << 20, 4, state)
        assert [(m.collective, m.params, m.nbytes) for m in sent] == [("allreduce", None, entries * 4)]
    assert layout.local_sgd_messages([1000, 24], 4, 1 << 20, 4)[0].nbytes == 512 * 4
    assert reducers.messages("local_sgd", [1000, 24], 4, state_arrays=2, every=4)[0].nbytes == 768 * 4


@pytest.mark.parametrize("name, hyper", [("sgd", {"momentum": 0.0}), ("sgd", {"momentum": 0.9}), ("adam", {}),
                                         ("adamw", {}), ("nadam", {}), ("rmsprop", {}), ("rmsprop", {"momentum": 0.9})])
def test_the_priced_state_is_what_the_optimizer_keeps(name, hyper):
    """predict's optimizer_state_arrays counts the float arrays per parameter that the real optimizer holds after a
    step (what local SGD's average sends with the parameters)."""
    from pydtnn import optim
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel.predict import optimizer_state_arrays

    backend = CPUBackend(np.float64, seed=0)
    params = [("w", np.ones((3, 4)), np.full((3, 4), 0.5)), ("b", np.ones(4), np.full(4, 0.5))]
    opt = optim.create(name, params, backend=backend, **hyper)
    opt.step()
    floats = sum(a.size for a in opt.state_dict()["arrays"].values() if a.dtype.kind == "f")
    assert floats == 16 * optimizer_state_arrays(name, optim.hyperparameters(name, **hyper))


@pytest.mark.parametrize("flags, words", [
    (["--local_sgd", "2", "--reduction", "topk"], "--local_sgd 2 replaces the gradient reduction"),
    pytest.param(["--average", "weighted"], "--average applies to the local_sgd reducer over several processes; "
                 "this run reduces with bucketed: add --local_sgd H", marks=pytest.mark.slow),
    pytest.param(["--local_sgd", "2", "--zero", "1"], "local_sgd leaves each replica its own residual",
                 marks=pytest.mark.slow),
    pytest.param(["--reduction", "local_sgd"], "--reduction local_sgd needs --local_sgd H", marks=pytest.mark.slow),
    pytest.param(["--parallel", "auto", "--local_sgd", "2"], "--parallel auto chooses the layout and its reduction; --local_sgd 2 replaces",
                 marks=pytest.mark.slow),
])
def test_local_sgd_refuses_what_it_cannot_take_in_one_line(tmp_path, flags, words):
    refused_in_one_line(tmp_path, flags, words)


@pytest.mark.slow
def test_a_local_sgd_run_resumes_bit_identically(tmp_path):
    """Each epoch ends on an average, so a checkpoint holds the replicas' one model and optimizer state; the
    post-local start counts from the optimizer's step: 1 + 1 epochs end exactly where 2 do."""
    base = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
            "--dtype", "float64", "--global_batch_size", "32", "--steps_per_epoch", "4", "--progress", "false",
            "--local_sgd", "3", "--post_local_sgd", "2", "--average", "weighted"]
    resumed_equals_whole(base, tmp_path)
