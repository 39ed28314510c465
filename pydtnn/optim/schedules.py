"""Learning-rate schedules: each gives a multiplicative factor, the trainer multiplies them.

    lr(epoch, step) = max(base_lr * prod(s.factor(epoch, step, steps_per_epoch) for s in schedules), min_lr)

A factor depends only on (epoch, step) and the schedule's own small state (e.g. how many plateau
reductions happened), so schedules compose in any order and are restored exactly on resume.
"""

import math

from pydtnn.errors import ConfigError


class Schedule:
    """Base: factor 1, no state. `min_lr` is a floor on the final learning rate."""

    min_lr = 0.0

    def factor(self, epoch, step, steps_per_epoch):
        return 1.0

    def on_epoch_end(self, epoch, logs):
        """Update state from the epoch's metrics (plateau detection)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        for k, v in state.items():
            setattr(self, k, v)


class WarmUp(Schedule):
    """Linear ramp per batch from start_factor to 1 over `epochs` epochs (Goyal et al. 2017).

    With P processes and the learning rate scaled by P, start_factor = 1/P starts from the
    single-process rate, as PyDTNN's warm_up did.
    """

    def __init__(self, epochs, start_factor):
        if epochs < 0 or not 0 < start_factor <= 1:
            raise ConfigError(f"warm_up: epochs must be >= 0 and start_factor in (0, 1], got {epochs}, {start_factor}")
        self.epochs, self.start_factor = epochs, start_factor

    def factor(self, epoch, step, steps_per_epoch):
        total = self.epochs * steps_per_epoch
        done = epoch * steps_per_epoch + step + 1
        if total == 0 or done >= total:
            return 1.0
        return self.start_factor + (1 - self.start_factor) * done / total


class Cosine(Schedule):
    """Cosine decay per batch from 1 to min_factor over `epochs` epochs (Loshchilov and Hutter 2017)."""

    def __init__(self, epochs, min_factor=0.0):
        if epochs < 1 or not 0 <= min_factor <= 1:
            raise ConfigError(f"cosine: epochs must be >= 1 and min_factor in [0, 1], got {epochs}, {min_factor}")
        self.epochs, self.min_factor = epochs, min_factor

    def factor(self, epoch, step, steps_per_epoch):
        t = min((epoch * steps_per_epoch + step) / (self.epochs * steps_per_epoch), 1.0)
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * t))


class ReduceEveryNEpochs(Schedule):
    """Multiply by `factor` after every `nepochs` epochs; never below min_lr."""

    def __init__(self, factor=0.1, nepochs=5, min_lr=0.0):
        if not 0 < factor <= 1 or nepochs < 1 or min_lr < 0:
            raise ConfigError(f"reduce_lr_every_nepochs: need 0 < factor <= 1, nepochs >= 1, min_lr >= 0; "
                              f"got {factor}, {nepochs}, {min_lr}")
        self.decay, self.nepochs, self.min_lr = factor, nepochs, min_lr

    def factor(self, epoch, step, steps_per_epoch):
        return self.decay ** (epoch // self.nepochs)


class ReduceOnPlateau(Schedule):
    """Multiply by `factor` when `metric` has not improved for `patience` epochs; never below min_lr.

    Improvement means lower for losses and errors, higher for accuracies.
    """

    def __init__(self, metric="val_loss", factor=0.1, patience=5, min_lr=0.0):
        if not 0 < factor < 1 or patience < 0 or min_lr < 0:
            raise ConfigError(f"reduce_lr_on_plateau: need 0 < factor < 1, patience >= 0, min_lr >= 0; "
                              f"got {factor}, {patience}, {min_lr}")
        self.metric, self.decay, self.patience, self.min_lr = metric, factor, patience, min_lr
        self.best, self.wait, self.reductions = None, 0, 0

    def factor(self, epoch, step, steps_per_epoch):
        return self.decay**self.reductions

    def on_epoch_end(self, epoch, logs):
        value = monitored(logs, self.metric, "reduce_lr_on_plateau")
        if self.best is None or improved(self.metric, value, self.best):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.reductions, self.wait = self.reductions + 1, 0

    def state_dict(self):
        return {"best": self.best, "wait": self.wait, "reductions": self.reductions}


def monitored(logs, metric, who):
    """logs[metric], or a ConfigError saying which metrics exist (PyDTNN silently used another)."""
    value = logs.get(metric)
    if value is None:
        have = sorted(k for k, v in logs.items() if isinstance(v, float))
        raise ConfigError(f"{who} monitors {metric!r}, which this run does not produce; available: {', '.join(have)}"
                          + ("; validation metrics need validation data (validation_split=0.1 or test_as_validation=True)"
                             if metric.startswith("val_") else ""))
    return value


def improved(metric, value, best):
    """True if value beats best: higher for accuracies, lower for everything else."""
    return value > best if "accuracy" in metric else value < best


def learning_rate(base_lr, schedules, epoch, step, steps_per_epoch):
    """The learning rate of one step: base_lr times every factor, with the decays (not the warm-up)
    floored at the largest min_lr (a floor never raises the rate above base_lr)."""
    ramp = decay = 1.0
    for s in schedules:
        f = s.factor(epoch, step, steps_per_epoch)
        if isinstance(s, WarmUp):
            ramp *= f
        else:
            decay *= f
    floor = min(max((s.min_lr for s in schedules), default=0.0), base_lr)
    return ramp * max(base_lr * decay, floor)
