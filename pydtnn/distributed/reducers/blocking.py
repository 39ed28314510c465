"""After the whole backward pass, one allreduce of all gradients (in pieces when large)."""

from pydtnn.distributed.reducers.base import Reducer, flat_buffer


class BlockingReducer(Reducer):
    """Simplest and a baseline: no overlap, the fewest messages."""

    name = "blocking"

    def setup(self):
        self.names = [n for n, _ in self.gradients]
        if self.flat is not None and self._span(self.names) == (0, self.flat.size):
            self.buf, self.views = self.flat, None  # the model's own gradient buffer, reduced in place
        else:
            self.buf, self.views = flat_buffer([g for _, g in self.gradients], self.compression.wire_dtype)

    def finish(self):
        self.order_done = True
        if self.views is None:
            self._scale(self.buf)
            self._reduce(self.buf, "all gradients")
            return
        self._pack(self.views, self.names)
        self._reduce(self.buf, "all gradients")
        self._unpack(self.views, self.names)
