"""Learning-rate schedules and training callbacks."""

import math

import numpy as np
import pytest

from pydtnn import data, models
from pydtnn.backends import CPUBackend
from pydtnn.callbacks import EarlyStopping, StopAtThreshold
from pydtnn.errors import ConfigError
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD
from pydtnn.optim.schedules import Cosine, ReduceEveryNEpochs, ReduceOnPlateau, WarmUp, learning_rate
from pydtnn.trainer import Trainer


def test_warm_up_ramps_linearly_per_batch_then_holds():
    w = WarmUp(epochs=2, start_factor=0.25)
    lrs = [learning_rate(0.4, [w], e, s, 10) for e in range(3) for s in range(10)]
    assert lrs[0] == pytest.approx(0.4 * (0.25 + 0.75 * 1 / 20))
    assert lrs[9] == pytest.approx(0.4 * (0.25 + 0.75 * 10 / 20))
    assert lrs[19] == pytest.approx(0.4) and lrs[29] == pytest.approx(0.4)
    assert all(b > a for a, b in zip(lrs[:19], lrs[1:20]))


def test_cosine_endpoints_and_midpoint():
    c = Cosine(epochs=4, min_factor=0.1)
    assert c.factor(0, 0, 5) == pytest.approx(1.0)
    assert c.factor(2, 0, 5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert c.factor(3, 4, 5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 19 / 20)))
    assert c.factor(9, 0, 5) == pytest.approx(0.1)


def test_reduce_every_n_epochs_with_floor():
    r = ReduceEveryNEpochs(factor=0.5, nepochs=2, min_lr=0.02)
    assert [learning_rate(0.1, [r], e, 0, 3) for e in range(7)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.02])


def test_reduce_on_plateau_counts_patience_and_round_trips():
    r = ReduceOnPlateau("val_loss", factor=0.1, patience=2)
    for loss in [1.0, 0.9, 0.95, 0.91]:  # two epochs without improvement -> one reduction
        r.on_epoch_end(0, {"val_loss": loss})
    assert r.factor(0, 0, 1) == pytest.approx(0.1)
    r2 = ReduceOnPlateau("val_loss", factor=0.1, patience=2)
    r2.load_state_dict(r.state_dict())
    for sched in (r, r2):
        sched.on_epoch_end(0, {"val_loss": 0.92})
        sched.on_epoch_end(0, {"val_loss": 0.93})
    assert r.factor(0, 0, 1) == r2.factor(0, 0, 1) == pytest.approx(0.01)
    acc = ReduceOnPlateau("val_accuracy", patience=0)
    acc.on_epoch_end(0, {"val_accuracy": 0.5})
    acc.on_epoch_end(0, {"val_accuracy": 0.6})  # higher is better for accuracies
    assert acc.reductions == 0


def test_missing_metric_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"val_loss.*validation_split=0\.1 or test_as_validation=True"):
        ReduceOnPlateau("val_loss").on_epoch_end(0, {"loss": 1.0, "val_loss": None})


@pytest.fixture(scope="module")
def digits():
    train, test = data.load("mnist5k")
    return train.subset(np.arange(0, 4000, 8)), test.subset(np.arange(0, 1000, 4))


def trainer_for(**kw):
    m = models.create("simplemlp", backend=CPUBackend(seed=0))
    return Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.1, momentum=0.9), progress=False,
                   log=lambda msg: None, **kw)


def test_trainer_applies_schedules_each_step(digits):
    train, _ = digits
    t = trainer_for(schedules=[ReduceEveryNEpochs(0.5, 1)])
    t.fit(train, epochs=3, batch_size=100)
    assert [r["lr"] for r in t.history] == pytest.approx([0.1, 0.05, 0.025])


def test_early_stopping_stops_and_restores_best():
    from types import SimpleNamespace

    model = models.create("simplemlp")
    trainer = SimpleNamespace(model=model, stop_training=False, log=lambda msg: None)
    stopper = EarlyStopping("val_loss", patience=2)
    for epoch, loss in enumerate([1.0, 0.8, 0.9, 0.95, 0.7]):
        for _, p, _ in model.parameters():
            p[...] = epoch  # weights that say which epoch they come from
        stopper.on_epoch_end(trainer, epoch, {"val_loss": loss})
        if trainer.stop_training:
            break
    assert epoch == 3 and stopper.best_epoch == 2  # two epochs without improvement after epoch 2
    assert all((p == 1).all() for _, p, _ in model.parameters())  # epoch 2's weights are back


def test_stop_at_threshold(digits):
    train, val = digits
    t = trainer_for(callbacks=[StopAtThreshold("val_accuracy", 0.5)])
    t.fit(train, epochs=10, batch_size=50, val=val)
    assert t.history[-1]["val_accuracy"] >= 0.5 and len(t.history) < 10


def test_min_lr_floors_decay_but_never_raises_the_rate():
    warm, step = WarmUp(epochs=1, start_factor=0.1), ReduceEveryNEpochs(factor=0.1, nepochs=1, min_lr=0.05)
    assert learning_rate(0.01, [step], 3, 0, 10) == pytest.approx(0.01)  # min_lr above base: stays at base
    assert learning_rate(0.1, [warm, step], 0, 0, 10) == pytest.approx(0.1 * (0.1 + 0.9 / 10))  # ramp intact
    assert learning_rate(0.1, [warm, step], 3, 0, 10) == pytest.approx(0.05)
