"""PyDTNN's non-blocking scheme: an Iallreduce per gradient as soon as its layer's backward ends."""

import time

from pydtnn.distributed.reducers.base import Reducer


class PerLayerReducer(Reducer):
    """One non-blocking allreduce per gradient tensor, in place; progressed by test() between layers."""

    name = "per_layer"

    def setup(self):
        self.pending = []  # [(request, name, start_ns)]

    def grads_ready(self, names):
        self._progress()
        for n in names:
            g = self.grads[n]
            self._scale(g)
            self.bytes_reduced += g.nbytes
            self.pending.append((self.comm.iallreduce(g, n), n, time.perf_counter_ns(), g.nbytes))

    def _progress(self):
        for req, *_ in self.pending:
            req.test()

    def finish(self):
        self.order_done = True
        for req, n, start, nbytes in self.pending:
            t_wait = time.perf_counter_ns()
            req.wait()
            if self.tracer is not None:
                end = time.perf_counter_ns()
                self.tracer.add(f"allreduce {n}", "allreduce", start, end, tid=2, bytes=nbytes)
                self.tracer.add(f"wait {n}", "wait", t_wait, end, tid=1)
        self.pending = []
