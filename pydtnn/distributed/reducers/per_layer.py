"""PyDTNN's non-blocking scheme: an Iallreduce per gradient as soon as its layer's backward ends."""

from pydtnn.backends import array_module
from pydtnn.distributed.reducers.base import Reducer


class PerLayerReducer(Reducer):
    """One non-blocking allreduce per gradient tensor (in place unless compressed), progressed by
    test() between layers (or by a progress thread)."""

    name = "per_layer"

    def setup(self):
        wire = self.compression.wire_dtype
        self.wire = {n: g if self.compression.in_place else array_module(g).empty(g.shape, wire)
                     for n, g in self.grads.items()}
        self.pending = []

    def grads_ready(self, names):
        for p in self.pending:
            self._progress(p)
        for n in names:
            self._pack([self.wire[n]], [n])
            self.pending.append(self._start(self.wire[n], n))

    def finish(self):
        self.order_done = True
        for p in self.pending:
            self._wait(p)
            self._unpack([self.wire[p[1]]], [p[1]])
        self.pending = []
