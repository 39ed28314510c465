"""Data parallelism for a hand-written training loop: wrap the optimizer (Horovod's idea).

    comm = launch.init()
    opt = DistributedOptimizer(SGD(model.parameters(), lr=0.1), model, comm)   # broadcasts rank 0's state
    for x, y in my_batches_for(comm.rank):
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())       # reductions start as layers finish
        opt.step()                            # waits, averages, updates
    opt.end_epoch()                           # the stale reducer's last gradients, local SGD's average
"""

from pydtnn.distributed import reducers
from pydtnn.distributed.consistency import broadcast_state
from pydtnn.step import reduce_and_update


class DistributedOptimizer:
    """An optimizer whose step() first averages the gradients over all ranks.

    Each rank's gradients count 1/size by default, right when every rank's batch has the same size;
    call set_weight(local_samples / global_samples) before backward when they differ.

    Between backward and the end of the reduction the gradients are being reduced in place: to read
    or change them (clipping, logging), call synchronize() first; they are then the global average,
    and step() applies them without reducing again.
    """

    def __init__(self, optimizer, model, comm, strategy="bucketed", **options):
        self.optimizer, self.comm = optimizer, comm
        self.reducer = reducers.create(strategy, comm, **options).attach(model) if comm.size > 1 else None
        broadcast_state(comm, model, optimizer)
        self._synchronized = False
        self.set_weight(1 / comm.size)

    def synchronize(self):
        """Wait for the reduction: the gradients are now averaged over all ranks."""
        if self.reducer is not None and not self._synchronized:
            self.reducer.finish()
        self._synchronized = True

    def set_weight(self, weight):
        """This rank's share of the global batch for the next backward."""
        if self.reducer is not None:
            self.reducer.begin_step(weight)

    def step(self):
        """Wait for the reduction (unless synchronize() did), then the wrapped optimizer's step (none where the
        reducer has no update yet: the stale reducer's first step)."""
        if not self._synchronized:
            reduce_and_update(self.optimizer, self.reducer)
        else:
            if self.reducer is None or self.reducer.has_update:
                self.optimizer.step()
            if self.reducer is not None:
                self.reducer.after_update(self.optimizer)  # local SGD counts its steps (and averages) here too
        self._synchronized = False
        self.set_weight(1 / self.comm.size)

    def end_epoch(self):
        """Call at the end of each epoch (and of training), on every rank: the stale reducer applies its last
        step's gradients, local SGD averages the replicas; nothing for the other reducers."""
        if self.reducer is not None:
            self.reducer.end_epoch(self.optimizer)

    @property
    def lr(self):
        return self.optimizer.lr

    @lr.setter
    def lr(self, value):
        self.optimizer.lr = value

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)
