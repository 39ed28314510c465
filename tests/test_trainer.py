"""Trainer: learning on the embedded digits, the metrics file, reproducibility, divergence."""

import json

import numpy as np
import pytest

from pydtnn import data, models
from pydtnn.backends import CPUBackend
from pydtnn.errors import TrainingDiverged
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD, Adam
from pydtnn.trainer import Trainer


@pytest.fixture(scope="module")
def mnist5k():
    return data.load("mnist5k")


def make_trainer(seed=0, lr=0.05, model="simplecnn", **kw):
    m = models.create(model, backend=CPUBackend(seed=seed))
    return Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=lr, momentum=0.9), seed=seed, progress=False, **kw)


def test_mlp_learns_digits_and_writes_metrics_file(mnist5k, tmp_path):
    train, test = mnist5k
    val = test.subset(np.arange(0, 1000, 2), name="val")
    t = make_trainer(model="simplemlp", metrics_file=str(tmp_path / "m.jsonl"))
    history = t.fit(train, epochs=3, batch_size=64, val=val, test=test)
    assert len(history) == 3
    assert history[-1]["loss"] < history[0]["loss"]
    assert t.final["test_accuracy"] > 0.9  # an MLP on 4,000 digits; chance is 0.1
    lines = [json.loads(s) for s in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[-1]["final"] is True
    for rec in lines[:3]:
        for key in ("epoch", "loss", "accuracy", "val_loss", "val_accuracy", "time_s", "samples_per_second"):
            assert rec[key] is not None, key
    for key in ("test_loss", "test_accuracy", "wall_time_s", "samples_per_second", "world_size", "params_sha256"):
        assert lines[-1][key] is not None, key
    assert lines[-1]["params_sha256"] == t.model.params_sha256() and lines[-1]["world_size"] == 1
    assert [r["epoch"] for r in lines[:3]] == [1, 2, 3]


def test_no_validation_gives_nulls(mnist5k, tmp_path):
    train, _ = mnist5k
    t = make_trainer(metrics_file=str(tmp_path / "m.jsonl"))
    t.fit(train, epochs=1, batch_size=64, steps_per_epoch=3)
    first, final = [json.loads(s) for s in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert first["val_loss"] is None and first["val_accuracy"] is None
    assert final["test_loss"] is None and final["test_accuracy"] is None


def test_same_seed_same_parameters_different_seed_different(mnist5k):
    train, _ = mnist5k
    runs = []
    for seed in (1, 1, 2):
        t = make_trainer(seed=seed)
        t.fit(train, epochs=1, batch_size=32, steps_per_epoch=10)
        runs.append(t.final["params_sha256"])
    assert runs[0] == runs[1] != runs[2]


def test_evaluate_and_predict_agree(mnist5k):
    train, test = mnist5k
    t = make_trainer()
    t.fit(train, epochs=1, batch_size=64, steps_per_epoch=20)
    ev = t.evaluate(test, batch_size=100)
    pred = t.predict(test, batch_size=333)
    assert pred.shape == (1000, 10)
    assert ev["accuracy"] == pytest.approx((pred.argmax(1) == test.y).mean())
    x = test.get_batch(np.arange(10))[0]
    np.testing.assert_allclose(t.predict(x), pred[:10], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_nan_loss_stops_with_last_good_epoch_kept(mnist5k, tmp_path):
    train, _ = mnist5k

    class Explode:
        def on_epoch_begin(self, trainer, epoch):
            if epoch == 1:
                trainer.optimizer.lr = 1e30

    t = make_trainer(metrics_file=str(tmp_path / "m.jsonl"), callbacks=[Explode()])
    with pytest.raises(TrainingDiverged) as e:
        t.fit(train, epochs=3, batch_size=64, steps_per_epoch=10)
    msg = str(e.value)
    assert "epoch 2" in msg and "last completed epoch" in msg and '"epoch": 1' in msg
    assert len(t.history) == 1
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["epoch"] == 1
    assert all(np.isfinite(p).all() for _, p, _ in t.model.parameters())  # the bad update never happened


def test_adam_trains_too(mnist5k):
    train, test = mnist5k
    m = models.create("simplemlp", backend=CPUBackend(seed=0))
    t = Trainer(m, SoftmaxCrossEntropy(), Adam(m.parameters(), lr=1e-3), progress=False)
    t.fit(train, epochs=1, batch_size=64, test=test)
    assert t.final["test_accuracy"] > 0.8


def test_dropout_run_resumed_from_a_checkpoint_is_bit_identical(mnist5k, tmp_path):
    """Dropout masks are keyed by (seed, epoch, step, rank), so stopping and resuming changes nothing."""
    from pydtnn import checkpoint
    from pydtnn.layers import Dense, Dropout, Flatten, ReLU
    from pydtnn.model import Model

    train = mnist5k[0].subset(np.arange(0, 4000, 10))

    def fresh(seed):
        m = Model([Flatten(), Dense(32), Dropout(0.5), ReLU(), Dense(10)], (1, 28, 28), CPUBackend(seed=seed))
        return Trainer(m, SoftmaxCrossEntropy(), Adam(m.parameters(), lr=1e-3), progress=False, seed=5)

    whole = fresh(0)
    whole.fit(train, epochs=3, batch_size=32)
    first = fresh(0)
    first.fit(train, epochs=1, batch_size=32)
    checkpoint.save(str(tmp_path / "ck"), first.model, first.optimizer, {"epoch": 1})
    resumed = fresh(9)  # other initial weights: everything must come from the checkpoint
    checkpoint.load(str(tmp_path / "ck"), resumed.model, resumed.optimizer)
    resumed.fit(train, epochs=3, batch_size=32, start_epoch=1)
    assert resumed.final["params_sha256"] == whole.final["params_sha256"]


class _Watched:
    """A dataset that records which thread assembles each batch and can fail on a given call."""

    def __init__(self, inner, fail_at=None):
        self.inner, self.fail_at, self.threads, self.calls = inner, fail_at, [], 0

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_batch(self, idx, dtype, rng=None):
        import threading

        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(f"deliberate read error in batch {self.calls}")
        self.threads.append(threading.current_thread().name)
        return self.inner.get_batch(idx, dtype, rng=rng)


def test_prefetching_builds_batches_in_the_background_and_changes_nothing(mnist5k):
    train, _ = mnist5k
    shas = {}
    for prefetch in (True, False):
        watched = _Watched(train)
        t = make_trainer(prefetch=prefetch, model="simplemlp")
        t.fit(watched, epochs=2, batch_size=32, steps_per_epoch=7)
        shas[prefetch] = t.final["params_sha256"]
        assert len(watched.threads) == 14  # one load per step, none wasted
        from_background = [name.startswith("pydtnn-data") for name in watched.threads]
        assert all(from_background) if prefetch else not any(from_background)
    assert shas[True] == shas[False]


def test_a_failed_background_read_is_raised_in_the_training_thread(mnist5k):
    train, _ = mnist5k
    t = make_trainer(model="simplemlp")
    with pytest.raises(OSError, match="deliberate read error in batch 3"):
        t.fit(_Watched(train, fail_at=3), epochs=1, batch_size=32, steps_per_epoch=6)


# -- reading the loss every few steps (what a GPU does to avoid a wait per step) -------------------
@pytest.mark.parametrize("accumulation", [1, 2])
def test_reading_every_few_steps_changes_nothing(mnist5k, accumulation):
    """sync_every 5 (and a last read of 3 steps) gives the history and parameters of a read every step,
    exactly: the same sums in the same order, metrics included."""
    train, test = mnist5k[0].subset(np.arange(0, 1664)), mnist5k[1].subset(np.arange(0, 300))
    runs = []
    for every in (1, 5):
        t = make_trainer(model="simplemlp", metrics=("accuracy", "top3_accuracy", "mse"), sync_every=every,
                         accumulation_steps=accumulation)
        assert t.steps_between_reads() == every
        history = t.fit(train, epochs=2, batch_size=64, val=test, test=test)
        runs.append((history, t.model.params_sha256(), {k: v for k, v in t.final.items() if k.startswith("test_")}))
    strip = [[{k: v for k, v in r.items() if k not in ("time_s", "samples_per_second")} for r in h] for h, _, _ in runs]
    assert strip[0] == strip[1] and runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]
    assert strip[0][0]["top3_accuracy"] > strip[0][0]["accuracy"] > 0.3 and strip[0][1]["val_mse"] > 0


def test_a_loss_whose_forward_adds_a_term_is_read_through_forward(mnist5k):
    from pydtnn.losses import MeanSquaredError, defers

    class Penalized(SoftmaxCrossEntropy):
        def forward(self, y, target):
            return super().forward(y, target) + 1.0

    assert defers(SoftmaxCrossEntropy()) and defers(MeanSquaredError()) and not defers(Penalized())
    train = mnist5k[0].subset(np.arange(0, 320))
    losses = []
    for loss in (SoftmaxCrossEntropy(), Penalized()):
        m = models.create("simplemlp", backend=CPUBackend(seed=0))
        t = Trainer(m, loss, SGD(m.parameters(), lr=0.05), progress=False, sync_every=4)
        losses.append(t.fit(train, epochs=1, batch_size=64)[0]["loss"])
    assert losses[1] == pytest.approx(losses[0] + 1.0, rel=1e-12)


def test_cpu_reads_every_step_by_default_and_sync_every_is_checked():
    from pydtnn.errors import ConfigError

    assert make_trainer(model="simplemlp").steps_between_reads() == 1
    for bad in (0, -2, 1.5):
        with pytest.raises(ConfigError, match=f"sync_every must be a positive integer, got {bad}"):
            make_trainer(model="simplemlp", sync_every=bad)


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_a_nan_read_late_names_its_step_and_the_updates_since(mnist5k):
    train = mnist5k[0].subset(np.arange(0, 640))

    class Explode:
        def on_batch_end(self, trainer, step, logs):
            if step == 2:
                trainer.optimizer.lr = 1e30

    steps = []
    for every in (1, 4):
        t = make_trainer(model="simplemlp", sync_every=every, callbacks=[Explode()])
        with pytest.raises(TrainingDiverged) as e:
            t.fit(train, epochs=1, batch_size=64)
        steps.append(int(str(e.value).split(" step ")[1].split()[0].rstrip(";")))
        msg = str(e.value)
        if every == 1:
            assert "parameters keep the values of the step before" in msg
        else:
            assert "the loss is read every 4 steps here, so the parameters have taken" in msg
            assert "sync_every 1 stops before the update" in msg
    assert steps[0] == steps[1] > 3  # the same first bad step, whenever it is read


def test_bad_labels_are_refused_on_the_host_when_reads_are_deferred(mnist5k):
    from pydtnn.errors import DataError

    train = mnist5k[0].subset(np.arange(0, 256))
    train.y[100] = 12
    t = make_trainer(model="simplemlp", sync_every=8)
    with pytest.raises(DataError, match=r"label 12 .* out of range; expected labels in \[0, 10\)"):
        t.fit(train, epochs=1, batch_size=64)
