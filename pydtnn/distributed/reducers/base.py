"""The reducer contract: after `finish()`, every rank's gradients hold the global-batch average.

    reducer.attach(model)          # registers the gradients-ready hook
    reducer.begin_step(weight)     # weight = local samples / global samples of this step
    model.backward(dy)             # hooks call reducer.grads_ready(names) layer by layer
    reducer.finish()               # wait for communication; grads are now averaged
    optimizer.step()

Each rank's loss is the mean over its own samples; scaling its gradients by its share of the
global batch before summing makes the result exact for uneven batches (and for empty shards).
"""

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
        model.add_grad_ready_hook(self.grads_ready)
        self.setup()
        return self

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
        with self.tracer.span(label, "allreduce", tid=2, bytes=int(buf.nbytes)):
            return self.comm.allreduce(buf, label)


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
