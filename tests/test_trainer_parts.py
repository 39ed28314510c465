"""The Trainer in parts: the Step (one batch), the Readings (reads and finiteness checks), the loop; the
contracts between them (per-sample streams passed in, layers asked to synchronize, nothing set on a trainer)."""

import argparse
import ast
import math
import pathlib

import numpy as np
import pytest

from pydtnn import metrics, step
from pydtnn.backends import Backend, CPUBackend
from pydtnn.distributed.comm import SingleProcess
from pydtnn.errors import TrainingDiverged
from pydtnn.layers import BatchNorm, Dense, Flatten, ReLU
from pydtnn.layers.base import Layer
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.optim import SGD
from pydtnn.randomness import SampleStreams
from pydtnn.readings import Readings, settle
from pydtnn.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Probe(Layer):
    """Identity that records, at each forward, the rows of the sample streams the backend serves."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.seen, self.fail_at = [], fail_at

    def forward(self, x, training=True):
        streams = self.backend.sample_streams
        self.seen.append(None if streams is None else streams.indices.tolist())
        if len(self.seen) == self.fail_at:
            raise RuntimeError("deliberate failure in forward")
        return x

    def backward(self, dy):
        return dy


class Synchronized(Layer):
    """Identity whose statistics would span the batch: it keeps the sync object it is given."""

    def __init__(self):
        super().__init__()
        self.sync = None

    def synchronize(self, sync):
        self.sync = sync

    def forward(self, x, training=True):
        return x

    def backward(self, dy):
        return dy


def mlp(*extra, dtype=np.float64, seed=0):
    return Model([Flatten(), *extra, Dense(12), ReLU(), Dense(5)], (2, 3, 3), CPUBackend(dtype, seed=seed))


def batch(n=7, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 2, 3, 3)), rng.integers(0, 5, n)


# -- nothing is set on a trainer from outside -------------------------------------------------------------
def trainer_names(tree):
    """`trainer`, and every name bound to a Trainer(...) call in the module."""
    names = {"trainer"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) == "Trainer":
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def assigned_attributes(tree):
    """(line, name.attr, value) of every assignment to an attribute of a plain name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], node.value
        else:
            continue
        flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        for t in flat:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                yield node.lineno, t.value.id, t.attr, value


def test_nothing_in_the_package_benchmarks_or_examples_sets_a_trainer_attribute():
    """Everything a Trainer needs is given at construction; the one attribute set from outside is the
    callbacks' documented stop_training = True."""
    found = []
    for folder in ("pydtnn", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = trainer_names(tree)
            for line, name, attr, value in assigned_attributes(tree):
                stop = attr == "stop_training" and isinstance(value, ast.Constant) and value.value is True
                if name in names and not stop:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name}.{attr}")
    assert found == []


def test_what_a_trainer_is_built_with_cannot_be_replaced_afterwards():
    from pydtnn.profiling import Tracer

    m = mlp()
    tracer = Tracer()
    t = Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), progress=False, accumulation_steps=3,
                tracer=tracer)
    assert t.accumulation_steps == 3 and t.tracer is tracer and t.step.tracer is tracer
    for name in ("accumulation_steps", "tracer"):
        with pytest.raises(AttributeError):
            setattr(t, name, None)


def test_restore_gives_a_trainer_the_history_and_base_rate_of_an_earlier_run():
    m = mlp()
    t = Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), progress=False)
    saved = [{"epoch": 1, "loss": 1.5}]
    t.restore(history=saved, base_lr=0.025)
    assert t.history == saved and t.history is not saved
    assert t.base_lr == 0.025 and t.optimizer.lr == 0.025


def test_the_callbacks_are_built_without_a_trainer_and_a_rank_with_nothing_to_save_saves_nothing(tmp_path):
    from pydtnn import run
    from pydtnn.callbacks import ModelCheckpoint

    args = argparse.Namespace(lr_schedulers="", history_file=str(tmp_path / "h.csv"),
                              checkpoint_dir=str(tmp_path / "ck"), model_checkpoint_save_freq=1)
    root, other = run.build_callbacks(args, {}, {}, is_root=True), run.build_callbacks(args, {}, {}, is_root=False)
    assert [type(c).__name__ for c in root] == ["HistoryCSV", "ModelCheckpoint"]
    assert [type(c) for c in other] == [ModelCheckpoint]  # saves with the others: resume says who takes part
    m = mlp()
    t = Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), progress=False, is_root=False,
                callbacks=other)
    t.epochs = 1
    other[0].on_epoch_end(t, 0, {})
    assert not (tmp_path / "ck").exists()


# -- the step ---------------------------------------------------------------------------------------------
class CountingStep(step.Step):
    def micro_step(self, x, y, weight, streams, read):
        self.calls.append((x.shape[0], weight))
        return super().micro_step(x, y, weight, streams, read)


def test_accumulation_is_a_loop_over_the_one_micro_step_and_updates_as_the_whole_batch():
    """3 micro-batches of 7 rows (2, 2, 3): three micro_steps weighted by their shares, then one update that
    is the whole batch's (float64, to rounding)."""
    x, y = batch()
    params = []
    for k in (1, 3):
        m = mlp()
        s = CountingStep(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.5), accumulation_steps=k)
        s.calls = []
        loss, out = s.run(x, y, weight=0.5)
        assert [n for n, _ in s.calls] == ([7] if k == 1 else [2, 2, 3])
        assert [w for _, w in s.calls] == ([0.5] if k == 1 else [0.5 * 2 / 7, 0.5 * 2 / 7, 0.5 * 3 / 7])
        assert out.shape == (7, 5) and math.isfinite(loss)
        params.append([p.copy() for _, p, _ in m.parameters()])
    for whole, accumulated in zip(*params):
        np.testing.assert_allclose(accumulated, whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("k,rows", [(1, [[10, 11, 12, 13, 14, 15]]), (2, [[10, 11, 12], [13, 14, 15]])])
def test_the_step_serves_each_micro_batch_its_own_samples_streams_and_clears_them(k, rows):
    probe = Probe()
    m = mlp(probe)
    s = step.Step(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), accumulation_steps=k)
    x, y = batch(6)
    s.run(x, y, streams=SampleStreams(0, 0, [10, 11, 12, 13, 14, 15]))
    assert probe.seen == rows and m.backend.sample_streams is None
    s.run(x, y)  # no streams: the Generator serves dropout
    assert probe.seen[-1] is None


def test_the_streams_are_cleared_when_a_step_fails():
    probe = Probe(fail_at=2)
    m = mlp(probe)
    s = step.Step(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), accumulation_steps=2)
    x, y = batch(6)
    with pytest.raises(RuntimeError, match="deliberate failure"):
        s.run(x, y, streams=SampleStreams(0, 0, np.arange(6)))
    assert probe.seen == [[0, 1, 2], [3, 4, 5]] and m.backend.sample_streams is None


def test_sample_streams_for_sets_the_streams_for_its_block_only():
    backend = Backend(np)
    streams = SampleStreams(1, 2, [3, 4])
    with backend.sample_streams_for(streams) as inside:
        assert inside is streams and backend.sample_streams is streams
    assert backend.sample_streams is None
    with pytest.raises(KeyError), backend.sample_streams_for(streams):
        raise KeyError("boom")
    assert backend.sample_streams is None


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_a_non_finite_loss_stops_the_step_before_the_update():
    m = mlp()
    s = step.Step(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1))
    x, y = batch()
    x[0, 0, 0, 0] = np.nan
    before = [p.copy() for _, p, _ in m.parameters()]
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        s.run(x, y)
    assert all(np.array_equal(a, p) for a, (_, p, _) in zip(before, m.parameters()))


class Recorder:
    """A reducer, its communicator and an optimizer that record what is asked of them, in order."""

    has_update = True

    def __init__(self):
        self.calls, self.comm = [], self

    def replay(self):
        self.calls.append("replay")

    def finish(self):
        self.calls.append("finish")

    def step(self):
        self.calls.append("optimizer step")

    def after_update(self, optimizer):
        self.calls.append("after update")

    def settle(self):
        self.calls.append("settle")


def test_reduce_and_update_waits_for_the_reduction_then_updates_and_distributed_optimizer_uses_it():
    from pydtnn.distributed import optimizer as distributed_optimizer

    r = Recorder()
    step.reduce_and_update(r, r)
    step.reduce_and_update(r, r, replay=True)
    step.reduce_and_update(r)
    assert r.calls == ["finish", "optimizer step", "after update", "replay", "finish", "optimizer step", "after update",
                       "optimizer step"]
    assert distributed_optimizer.reduce_and_update is step.reduce_and_update
    r.calls, r.has_update = [], False  # the stale reducer's first step: reduced, nothing to apply yet
    step.reduce_and_update(r, r)
    assert r.calls == ["finish", "after update"]


def test_sync_batchnorm_asks_every_layer_to_synchronize():
    """Each layer decides (Layer.synchronize): BatchNorm takes the sync, and so does any layer that overrides it."""
    norm, other = BatchNorm(), Synchronized()
    m = mlp(other, Dense(6), norm)
    Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), progress=False)
    assert norm.sync is None and other.sync is None
    t = Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1), progress=False, sync_batchnorm=True)
    assert norm.sync is not None and other.sync is norm.sync is t.step.batchnorm_sync


# -- readings ---------------------------------------------------------------------------------------------
def outputs(steps=5, n=4, seed=2):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, 5)).astype(np.float32), rng.integers(0, 5, n), float(np.float32(rng.random())),
             n - i % 2) for i in range(steps)]


@pytest.mark.parametrize("every", [2, 3, None])
def test_reads_every_batch_every_few_or_once_give_the_same_sums(every):
    """One implementation, read at once, every few batches or once at the end: the same sums, exactly."""
    fns = {"accuracy": metrics.accuracy, "mse": metrics.mse}
    got = []
    for mode in (1, every):
        r = Readings(fns, CPUBackend(), every=mode)
        data = outputs()
        for i, (out, y, loss, n) in enumerate(data):
            value = loss if mode == 1 else np.asarray(loss, np.float32)
            r.add(value, out, y, n, step=i, last=i == len(data) - 1)
        got.append(r.totals(SingleProcess()))
    assert got[0] == got[1] and got[0][1] == 4 + 3 + 4 + 3 + 4


def test_a_late_read_names_the_bad_step_the_updates_since_and_settles_first():
    r = Recorder()
    readings = Readings({}, CPUBackend(), every=3, reducer=r, epoch=1, last={"epoch": 1, "loss": 0.5}, rank=1)
    y = np.zeros(2, np.int64)
    readings.add(np.float32(1.0), None, y, 2, step=3)
    readings.add(np.float32(np.nan), None, y, 2, step=4)
    with pytest.raises(TrainingDiverged) as e:
        readings.add(np.float32(2.0), None, y, 2, step=5)
    msg = str(e.value)
    assert msg.startswith("loss is nan at epoch 2 step 5 on rank 1; the loss is read every 3 steps here, so the "
                          "parameters have taken 2 updates since (sync_every 1 stops before the update)")
    assert '"epoch": 1' in msg and r.calls == ["settle"]


def test_settle_waits_on_the_reducers_communicator_where_there_is_one():
    r = Recorder()
    settle(r)
    settle(None)
    assert r.calls == ["settle"]
