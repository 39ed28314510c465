"""After the whole backward pass, one allreduce of all gradients packed into one buffer."""

from pydtnn.distributed.reducers.base import Reducer, flat_buffer


class BlockingReducer(Reducer):
    """Simplest and a baseline: no overlap, one message (the fewest latencies)."""

    name = "blocking"

    def setup(self):
        self.buf, self.views = flat_buffer([g for _, _, g in self.params])

    def finish(self):
        self.order_done = True
        for view, (_, _, g) in zip(self.views, self.params):
            view[...] = g
        self._scale(self.buf)
        self._reduce(self.buf, "allreduce all")
        for view, (_, _, g) in zip(self.views, self.params):
            g[...] = view
