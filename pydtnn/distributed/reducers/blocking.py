"""After the whole backward pass, one allreduce of all gradients packed into one buffer."""

from pydtnn.distributed.reducers.base import Reducer, flat_buffer


class BlockingReducer(Reducer):
    """Simplest and a baseline: no overlap, one message (the fewest latencies)."""

    name = "blocking"

    def setup(self):
        self.names = [n for n, _, _ in self.params]
        self.buf, self.views = flat_buffer([g for _, _, g in self.params], self.wire_dtype)

    def finish(self):
        self.order_done = True
        self._pack(self.views, self.names)
        self._reduce(self.buf, "all gradients")
        self._unpack(self.views, self.names)
