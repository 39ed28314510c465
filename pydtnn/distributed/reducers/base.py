"""The reducer contract: after `finish()`, every rank's gradients hold the global-batch average.

    reducer.attach(model)          # registers the gradients-ready hook
    reducer.begin_step(weight)     # weight = local samples / global samples of this step
    model.backward(dy)             # hooks call reducer.grads_ready(names) layer by layer
    reducer.finish()               # wait for communication; grads are now averaged
    optimizer.step()

Each rank's loss is the mean over its own samples; scaling its gradients by its share of the
global batch before summing makes the result exact for uneven batches (and for empty shards).

compression="fp16" sends half-precision copies of the (already scaled) gradients: half the bytes on
the wire, at the price of fp16 rounding of every gradient and a reduction operator written in Python
(MPI has no half-precision sum). It pays only where the network, not memory, is the bottleneck.
"""

import time

import numpy as np

from pydtnn.backends import array_module


class Reducer:
    """Base: keeps the (name, param, grad) list and the step's weight."""

    name = None

    def __init__(self, comm, compression="none"):
        if compression not in ("none", "fp16"):
            from pydtnn.errors import ConfigError

            raise ConfigError(f"unknown gradient compression {compression!r}; expected none or fp16")
        self.comm = comm
        self.wire_dtype = np.float16 if compression == "fp16" else None
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

    def _pack(self, views, names):
        """Copy each gradient, times this rank's weight, into its wire buffer view (casting if compressed)."""
        for view, n in zip(views, names):
            array_module(view).multiply(self.grads[n], self.weight, out=view, casting="same_kind")

    def _unpack(self, views, names):
        for view, n in zip(views, names):
            if view is not self.grads[n]:
                self.grads[n][...] = view

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

    def _start(self, buf, label):
        """Start a non-blocking allreduce; returns what _wait needs."""
        self.bytes_reduced += buf.nbytes
        return self.comm.iallreduce(buf, label), label, time.perf_counter_ns(), int(buf.nbytes)

    def _wait(self, pending):
        req, label, start, nbytes = pending
        t_wait = time.perf_counter_ns()
        req.wait()
        if self.tracer is not None:
            end = time.perf_counter_ns()
            self.tracer.add(f"allreduce {label}", "allreduce", start, end, tid=2, bytes=nbytes)
            self.tracer.add(f"wait {label}", "wait", t_wait, end, tid=1)


def flat_buffer(grads, dtype=None):
    """One contiguous buffer large enough for `grads` and views of it shaped like each."""
    dtype = dtype or grads[0].dtype
    buf = array_module(grads[0]).empty(sum(g.size for g in grads), dtype)
    views, off = [], 0
    for g in grads:
        views.append(buf[off : off + g.size].reshape(g.shape))
        off += g.size
    return buf, views
