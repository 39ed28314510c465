"""Reading the loss and metrics back from the device: when, how many at once, and the check that the loss
is finite.

On the host reading is free and fit reads every step, checking the loss before the update. On a GPU each
read makes the host wait for the device, so training keeps each step's values on the device and reads
`every` steps of them in one transfer (a non-finite loss is then found after the updates that followed,
and the error says how many), and evaluation keeps running sums on the device, read once at the end.
"""

import json
import math

import numpy as np

from pydtnn.errors import TrainingDiverged
from pydtnn.losses import targets_checked_on_host


def settle(reducer):
    """Wait, from the host, for the reductions that reducer's communicator has queued on a device stream
    (NCCL), watched for stalls: before a read of a device value, which would otherwise block unwatched."""
    if reducer is not None:  # Communicator.settle: a no-op where collectives complete before they return
        reducer.comm.settle()


def diverged(what, epoch, step, parameters, last=None, rank=None):
    """TrainingDiverged: `what` went wrong at 0-based (epoch, step), on `rank` (None: one process), what the
    parameters hold now, and `last` (the last completed epoch's record, or None)."""
    where = f" on rank {rank}" if rank is not None else ""
    return TrainingDiverged(
        f"{what} at epoch {epoch + 1} step {step + 1}{where}; {parameters}; last completed epoch: "
        f"{json.dumps(last) if last else 'none'}; try a smaller learning rate")


class Readings:
    """The loss and metrics of a run of batches, summed over their samples: `sums` ({"loss", metric...}, host
    floats once read) and `seen` (samples).

    metric_fns: {name: pydtnn.metrics function}. every: how batches are read.
      1     each batch at once (host arrays); the loss is a float, already checked by the step.
      k > 1 each batch's values stay on the device and k batches are read in one transfer, in order, each
            loss checked to be finite; reducer (its communicator settles first), epoch, last (the last
            completed epoch's record) and rank (None: one process) name a failure.
      None  running sums on the device, read once by totals(); nothing checked (evaluation: no update to stop).
    With k > 1 and None, the caller checked the targets on the host: their values are not read on the device.
    """

    def __init__(self, metric_fns, backend, every=1, reducer=None, epoch=0, last=None, rank=None):
        self.metric_fns, self.backend, self.every = metric_fns, backend, every
        self.reducer, self.epoch, self.last, self.rank = reducer, epoch, last, rank
        self.sums, self.seen = dict.fromkeys(("loss",) + tuple(metric_fns), 0.0), 0
        self.pending = []  # (step, n, [loss, metrics...] as 0-d device arrays), every > 1

    def add(self, loss, out, y, n, step=0, last=False):
        """One batch of n samples (n = 0: a stand-in sample that counts for nothing): its loss (a float, or a
        0-d device array) and outputs out against targets y. last: the run's last batch, read now.
        Returns whether the host sums were updated."""
        if self.every == 1:
            if not n:
                return False
            self.sums["loss"] += loss * n
            for m, fn in self.metric_fns.items():
                self.sums[m] += fn(out, y) * n
            self.seen += n
            return True
        with targets_checked_on_host():  # the caller checked them: no value is read here
            values = [loss] + [fn(out, y, read=False) if n else 0.0 for fn in self.metric_fns.values()]
        if self.every is None:
            xp = self.backend.xp
            for k, v in zip(self.sums, values):
                self.sums[k] += xp.asarray(v, dtype=np.float64) * n
            self.seen += n
            return False
        self.pending.append((step, n, values))
        if len(self.pending) >= self.every or last:
            self.read()
            return True
        return False

    def read(self):
        """Read the pending batches' values in one transfer, check each loss is finite, and add them to the
        sums in batch order (as a read every batch would)."""
        settle(self.reducer)
        xp = self.backend.xp
        rows = self.backend.to_numpy(xp.stack([xp.stack([xp.asarray(v, dtype=xp.float64) for v in values])
                                               for _, _, values in self.pending]))
        for i, ((step, n, _), row) in enumerate(zip(self.pending, rows)):
            loss = float(row[0])
            if not math.isfinite(loss):
                later = len(self.pending) - 1 - i
                raise diverged(f"loss is {loss}", self.epoch, step, (
                    f"the loss is read every {self.every} steps here, so the parameters have taken {later + 1} "
                    f"update{'s' if later else ''} since (sync_every 1 stops before the update)"), self.last, self.rank)
            if n:
                self.sums["loss"] += loss * n
                for m, v in zip(self.metric_fns, row[1:]):
                    self.sums[m] += float(v) * n
                self.seen += n
        self.pending.clear()

    def mean(self, name="loss"):
        """The mean of `name` per sample read so far on this process (None before any)."""
        return self.sums[name] / self.seen if self.seen else None

    def totals(self, comm):
        """({name: mean per sample over every rank}, samples over every rank): one reduction over comm."""
        if self.every is None and self.seen:  # one transfer for every sum
            xp = self.backend.xp
            values = self.backend.to_numpy(xp.stack([xp.asarray(v, dtype=np.float64) for v in self.sums.values()]))
            self.sums = dict(zip(self.sums, (float(v) for v in values)))
        totals = comm.allreduce_sum(list(self.sums.values()) + [self.seen])
        seen = int(totals[-1])
        return {k: float(v) / max(seen, 1) for k, v in zip(self.sums, totals)}, seen
