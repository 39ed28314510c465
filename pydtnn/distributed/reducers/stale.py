"""One-step-stale reduction (--reduction_staleness 1): each step's update uses the previous step's gradients, whose
allreduce ran during this step's forward and backward, so the reduction is hidden behind a whole step.

    finish() of step t   copy this step's weighted gradients into a wire buffer and start its allreduce (non-
                         blocking, in pieces); wait for step t - 1's, which has had step t's forward and backward to
                         travel, and put it in the gradients: the optimizer applies g(t - 1). At an epoch's first
                         reduction there is none yet: has_update is False and the step makes no update.
    grads_ready()        during backward, lets the outstanding allreduce move (test(), or a progress thread)
    end_epoch(optimizer) waits for the last step's allreduce and applies it, so an epoch makes as many updates as
                         it has steps, evaluation and checkpoints see every gradient, and nothing is in flight
                         across epochs (a resumed run is bit-identical; nothing is checkpointed)

This changes the algorithm: the gradient of step t is computed at the parameters before the update by g(t - 1),
and applied one step later (PyDTNN's --parallel-pipeline; Ok-Topk's and DeepSpeed's 1-step-delayed updates).
The delay needs a gentler optimizer: simplecnn on Fashion-MNIST at SGD's momentum 0.9 and learning rate 0.1
diverges with it (as PyTorch's SGD does with the same delay), and trains within 0.4 points of undelayed training at
momentum 0.5 (docs/benchmarks.md, "Lossy gradient reductions"). Two wire buffers take turns: one in flight while the next is filled.
Staleness 0 is the default reduction, not this reducer.
"""

from pydtnn.distributed.reducers.base import Reducer, flat_buffer
from pydtnn.errors import ConfigError


class StaleReducer(Reducer):
    name = "stale"

    def __init__(self, comm, staleness=1, compression="none", progress="test"):
        if staleness != 1:
            raise ConfigError(f"stale reducer: staleness {staleness!r}; expected 1 (staleness 0 is the default "
                              f"reduction)")
        super().__init__(comm, compression, progress)
        self.staleness = 1
        self.pending = None  # (what _wait takes, the buffer's turn) of the previous step's allreduce
        self.has_update = True

    def setup(self):
        self.names = [n for n, _ in self.gradients]
        grads = [g for _, g in self.gradients]
        self.wire = [flat_buffer(grads) for _ in range(2)]  # [(buffer, views)]: the two turns
        self.turn = 0

    def grads_ready(self, names):
        if self.pending is not None:
            self._progress(self.pending[0])

    def finish(self):
        self.order_done = True
        buf, views = self.wire[self.turn]
        self._pack(views, self.names)  # this rank's weighted share
        previous, self.pending = self.pending, (self._start(buf, "stale gradients"), self.turn)
        self.turn ^= 1
        self.has_update = previous is not None
        if previous is not None:
            self._apply(previous)

    def _apply(self, pending):
        """Wait for a step's allreduce and write its sum into the gradients."""
        self._wait(pending[0])
        self._unpack(self.wire[pending[1]][1], self.names)

    def end_epoch(self, optimizer):
        if self.pending is not None:
            self._apply(self.pending)
            self.pending = None
            optimizer.step()
