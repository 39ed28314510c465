"""Callbacks the trainer calls at epoch ends: early stopping, stop-at-threshold, checkpoints.

A callback is any object with some of: on_train_begin(trainer), on_epoch_begin(trainer, epoch),
on_batch_end(trainer, step, logs), on_epoch_end(trainer, epoch, logs). Setting
trainer.stop_training = True ends training after the current epoch. Callbacks with state offer
state_dict()/load_state_dict() (JSON values), saved in checkpoints so a resumed run decides alike.
"""

from pydtnn.optim.schedules import improved, monitored


class EarlyStopping:
    """Stop when `metric` has not improved for `patience` epochs; optionally restore the best weights.

    The best weights are kept in memory (a copy of the state dict), not in a side file.
    """

    def __init__(self, metric="val_loss", patience=10, restore_best=True):
        self.metric, self.patience, self.restore_best = metric, int(patience), restore_best
        self.best, self.wait, self.best_epoch = None, 0, None
        self._best_state = None

    def on_epoch_end(self, trainer, epoch, logs):
        value = monitored(logs, self.metric, "early_stopping")
        if self.best is None or improved(self.metric, value, self.best):
            self.best, self.wait, self.best_epoch = value, 0, epoch + 1
            if self.restore_best:
                self._best_state = {k: v.copy() for k, v in trainer.model.state_dict().items()}
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.stop_training = True
            trainer.log(f"early_stopping: {self.metric} has not improved for {self.wait} epochs "
                        f"(best {self.best:.4g} at epoch {self.best_epoch})")
            if self._best_state is not None:
                trainer.model.load_state_dict(self._best_state)
                trainer.log(f"early_stopping: restored the weights of epoch {self.best_epoch}")

    def state_dict(self):
        return {"best": self.best, "wait": self.wait, "best_epoch": self.best_epoch}

    def load_state_dict(self, state):
        self.best, self.wait, self.best_epoch = state["best"], state["wait"], state["best_epoch"]


class StopAtThreshold:
    """Stop once `metric` reaches `threshold`: at or above for accuracies, at or below otherwise."""

    def __init__(self, metric="val_accuracy", threshold=0.0):
        self.metric, self.threshold = metric, float(threshold)

    def on_epoch_end(self, trainer, epoch, logs):
        value = monitored(logs, self.metric, "stop_at_loss")
        if value == self.threshold or improved(self.metric, value, self.threshold):
            trainer.stop_training = True
            trainer.log(f"stop_at_loss: {self.metric} = {value:.4g} reached {self.threshold:.4g}")


class ModelCheckpoint:
    """Save a resumable checkpoint into `directory` every `save_freq` epochs and at the last epoch.

    `save(trainer, epoch)` is supplied by the owner of the run (it knows the configuration to store).
    """

    def __init__(self, save, save_freq=1):
        self.save, self.save_freq = save, max(int(save_freq), 1)

    def on_epoch_end(self, trainer, epoch, logs):
        if (epoch + 1) % self.save_freq == 0 or trainer.stop_training or epoch + 1 == trainer.epochs:
            self.save(trainer, epoch)
