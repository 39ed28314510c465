"""The reducer contract: after `finish()`, every rank's gradients hold the global-batch average.

    reducer.attach(model)          # registers the gradients-ready hook
    reducer.begin_step(weight)     # weight = local samples / global samples of this step
    model.backward(dy)             # hooks call reducer.grads_ready(names) layer by layer
    reducer.finish()               # wait for communication; grads are now averaged
    optimizer.step()

Each rank's loss is the mean over its own samples; scaling its gradients by its share of the
global batch before summing makes the result exact for uneven batches (and for empty shards).
"""

import time

import numpy as np


class Reducer:
    """Base: keeps the (name, param, grad) list and the step's weight."""

    name = None

    def __init__(self, comm):
        self.comm = comm
        self.weight = 1.0
        self.tracer = None
        self.bytes_reduced = 0

    def attach(self, model):
        self.params = model.parameters()
        self.grads = {n: g for n, _, g in self.params}
        self.paused, self.order, self.order_done = False, [], False
        model.add_grad_ready_hook(self._hook)
        self.setup()
        return self

    def _hook(self, names):
        if not self.order_done:  # learn backward's order (the same on every rank) from the first pass
            if names in self.order:
                self.order_done = True
            else:
                self.order.append(names)
        if not self.paused:
            self.grads_ready(names)

    def replay(self):
        """Report every gradient ready, in backward's order (after backward ran with the reducer paused,
        e.g. to accumulate micro-batches)."""
        for names in self.order:
            self.grads_ready(names)

    def setup(self):
        """Allocate buffers once the parameters are known."""

    def begin_step(self, weight):
        self.weight = weight

    def grads_ready(self, names):
        """Called during backward as soon as these gradients are final."""

    def finish(self):
        raise NotImplementedError

    def _scale(self, g):
        if self.weight != 1.0:
            g *= g.dtype.type(self.weight)

    def _reduce(self, buf, label):
        """Blocking allreduce of one buffer, traced when a tracer is set."""
        self.bytes_reduced += buf.nbytes
        if self.tracer is None:
            return self.comm.allreduce(buf, label)
        start = time.perf_counter_ns()
        self.comm.allreduce(buf, label)
        end = time.perf_counter_ns()
        self.tracer.add(label, "allreduce", start, end, tid=2, bytes=int(buf.nbytes))
        self.tracer.add(label, "blocking", start, end, tid=1)  # nothing overlaps a blocking reduction
        return buf


def flat_buffer(grads, dtype=None):
    """One contiguous buffer large enough for `grads` and views of it shaped like each."""
    dtype = dtype or grads[0].dtype
    total = sum(g.size for g in grads)
    buf = np.empty(total, dtype)
    views, off = [], 0
    for g in grads:
        views.append(buf[off : off + g.size].reshape(g.shape))
        off += g.size
    return buf, views
