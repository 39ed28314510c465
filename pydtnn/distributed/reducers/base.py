"""The reducer contract: after `finish()`, every rank's gradients hold the global-batch average.

    reducer.attach(model)          # registers the gradients-ready hook
    reducer.begin_step(weight)     # weight = local samples / global samples of this step
    model.backward(dy)             # hooks call reducer.grads_ready(names) layer by layer
    reducer.finish()               # wait for communication; grads are now averaged
    optimizer.step()

Gradient accumulation runs backward several times before one reduction:

    with reducer.no_sync():        # the hooks start no reduction in here
        model.backward(dy)         # once per micro-batch, gradients summed by the caller
    reducer.begin_step(weight)
    reducer.replay()               # every gradient reported ready, in backward's order
    reducer.finish()

Each rank's loss is the mean over its own samples; scaling its gradients by its share of the
global batch before summing makes the result exact for uneven batches (and for empty shards).

Where the model keeps its gradients in one buffer (Model.grad_buffer, reverse parameter order), the
blocking and bucketed reducers scale and reduce contiguous runs of that buffer in place: no copy in,
no copy out. Messages are cut into pieces of at most PIECE_BYTES: on shared-memory MPICH four
16 MB Allreduces, one after the other, take about 40% of the time of one 64 MB Allreduce
(benchmarks/allreduce.py; docs/benchmarks.md).

progress="thread" (per_layer and bucketed) hands the outstanding non-blocking allreduces to a
ProgressThread (pydtnn.distributed.comm), which enters MPI every 0.2 ms from a helper thread while
backward computes; the default, "test", enters MPI with test() between layers instead, so that a
reduction moves only when a layer ends.

compression="fp16" sends half-precision copies of the (already scaled) gradients: half the bytes on
the wire, at the price of fp16 rounding of every gradient and a reduction operator written in Python
(MPI has no half-precision sum). It pays only where the network, not memory, is the bottleneck.
Each gradient travels times a power of two of its own, the same on every rank, chosen so that its sum
over the ranks stays under 2^15 (fp16's largest value is 65504) with its largest entries just below:
fp16 keeps 11 significant bits from 2^15 down to its smallest normal value 2^-14, and unscaled
gradients lie mostly under that (19-90% of a ResNet-20's entries per rank, where fp16 keeps fewer
bits, or none under 6e-8). The powers come from one small reduction per message before it (the sum
over the ranks of each gradient's largest magnitude, a bound on every partial sum; not counted in
bytes_reduced); multiplying and dividing by them is exact.
"""

import itertools
import time
import weakref
from contextlib import contextmanager

import numpy as np

from pydtnn.backends import array_module, is_device_array

PIECE_BYTES = 16 * 2**20  # largest single message; see the module docstring
WIRE_TOP = 15  # fp16 wire: every gradient's sum over the ranks is scaled under 2^WIRE_TOP (fp16's largest: 65504)
WIRE_SHIFT_LIMIT = 64  # and by at most 2^+-64, which float32 gradients take without leaving their normal range


class Reducer:
    """Base: keeps the (name, param, grad) list and the step's weight.

    Gradients may be read only after finish(): between the first gradients-ready hook and then,
    reductions run in place on them (scaled, and being summed by non-blocking collectives).
    """

    name = None
    PROGRESS = ("test",)  # the ways outstanding reductions are progressed that this reducer offers

    def __init__(self, comm, compression="none", progress="test"):
        from pydtnn.errors import ConfigError

        if compression not in ("none", "fp16"):
            raise ConfigError(f"unknown gradient compression {compression!r}; expected none or fp16")
        if progress not in self.PROGRESS:
            raise ConfigError(f"{self.name} reducer: progress {progress!r}; expected {' or '.join(self.PROGRESS)}")
        self.comm = comm
        self.progress = progress
        self._thread = None
        if progress == "thread" and comm.size > 1:
            if not hasattr(comm, "progress_thread"):
                raise ConfigError(f"progress thread: this run's communicator is "
                                  f"{getattr(comm, 'name', type(comm).__name__)}; expected mpi (CPU training)")
            self._thread = comm.progress_thread()
        if self._thread is not None:
            weakref.finalize(self, self._thread.close)  # the thread ends with the reducer
        self.wire_dtype = np.float16 if compression == "fp16" else None
        self.wire_scales = {}  # name: the power of two its gradient was last sent times (fp16 wire)
        self.weight = 1.0
        self.tracer = None
        self.bytes_reduced = 0
        self._paused = False

    def attach(self, model):
        self.params = model.parameters()
        self.grads = {n: g for n, _, g in self.params}
        flat = getattr(model, "grad_buffer", None)
        # in place only when the wire format is the gradients' own and the buffer really backs them
        self.flat, self.offsets = None, {}
        if self.wire_dtype is None and flat is not None:
            self.flat, self.offsets = flat, model.grad_offsets
        self.order, self.order_done = [], False
        model.add_grad_ready_hook(self._hook)
        self.setup()
        return self

    def _hook(self, names):
        if not self.order_done:  # learn backward's order (the same on every rank) from the first pass
            if names in self.order:
                self.order_done = True
            else:
                self.order.append(names)
        if not self._paused:
            self.grads_ready(names)

    @contextmanager
    def no_sync(self):
        """Inside: backward's gradients-ready hooks start no reduction (they still learn backward's
        order); replay() reports the gradients afterwards. Restored on exit, on an exception too."""
        was, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = was

    def replay(self):
        """Report every gradient ready, in backward's order (after backward ran inside no_sync(), e.g. to
        accumulate micro-batches)."""
        for names in self.order:
            self.grads_ready(names)

    def setup(self):
        """Allocate buffers once the parameters are known."""

    def begin_epoch(self, epoch):
        """Called by the trainer before each epoch (0-based); topk's density warm-up follows it."""

    def begin_step(self, weight):
        self.weight = weight

    def grads_ready(self, names):
        """Called during backward as soon as these gradients are final."""

    def finish(self):
        raise NotImplementedError

    def state_dict(self):
        """This rank's own state that a resumed run needs ({name: array}); none for the dense reducers."""
        return {}

    def load_state_dict(self, state):
        """Restore what state_dict() gave."""

    def _pack(self, views, names):
        """Copy each gradient, times this rank's weight, into its wire buffer view (casting if compressed:
        times the gradient's wire scale too, a collective)."""
        scales = self._wire_scales(names) if self.wire_dtype is not None else [1.0] * len(names)
        for view, n, s in zip(views, names, scales):
            array_module(view).multiply(self.grads[n], self.weight * s, out=view, casting="same_kind")

    def _wire_scales(self, names):
        """A power of two per gradient, the same on every rank, that puts the gradient's sum over the ranks
        (and every partial sum on the way) under 2^15 and its largest entries above 2^14: the sum over the
        ranks of each gradient's largest magnitude, times this rank's weight, bounds them. 1 where that
        bound is 0 or not finite. Remembered for _unpack."""
        grads = [self.grads[n] for n in names]
        xp = array_module(grads[0])
        local = xp.stack([xp.abs(g).max() if g.size else xp.zeros((), g.dtype) for g in grads])
        local = np.asarray(local.get() if is_device_array(local) else local, np.float64) * abs(self.weight)
        bound = np.asarray(self.comm.allreduce_sum(local, "fp16 scales"), np.float64)
        ok = np.isfinite(bound) & (bound > 0)
        _, exponent = np.frexp(np.where(ok, bound, 1.0))  # bound < 2^exponent
        powers = np.where(ok, np.clip(WIRE_TOP - exponent, -WIRE_SHIFT_LIMIT, WIRE_SHIFT_LIMIT), 0)
        scales = [float(np.ldexp(1.0, int(e))) for e in powers]
        self.wire_scales.update(zip(names, scales))
        return scales

    def _scale(self, buf):
        """Multiply buf, a run of the model's own gradients, by this rank's weight in place."""
        if self.weight != 1.0:
            array_module(buf).multiply(buf, self.weight, out=buf)

    def _unpack(self, views, names):
        for view, n in zip(views, names):
            if view is not self.grads[n]:
                g = self.grads[n]
                g[...] = view
                s = self.wire_scales.get(n, 1.0)
                if s != 1.0:
                    array_module(g).multiply(g, 1.0 / s, out=g, casting="same_kind")  # exact: a power of two

    def _span(self, names):
        """(start, stop) of these gradients in the flat buffer when they fill one contiguous run, else None."""
        if self.flat is None:
            return None
        spans = sorted(self.offsets[n] for n in names)
        if any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
            return None
        return spans[0][0], spans[-1][1]

    def _reduce(self, buf, label):
        """Blocking allreduce of buf, piece after piece, traced when a tracer is set."""
        self.bytes_reduced += buf.nbytes
        start = time.perf_counter_ns()
        for piece in self._pieces(buf):
            self.comm.allreduce(piece, label)
        if self.tracer is not None:
            end = time.perf_counter_ns()
            self.tracer.add(label, "allreduce", start, end, tid=2, bytes=int(buf.nbytes))
            self.tracer.add(label, "blocking", start, end, tid=1)  # nothing overlaps a blocking reduction
        return buf

    @staticmethod
    def _pieces(buf):
        """Contiguous flat views of buf of at most PIECE_BYTES each (at least one, even when empty)."""
        flat = buf.reshape(-1)  # a view: wire buffers and gradients are contiguous
        step = max(1, PIECE_BYTES // buf.itemsize)
        return [flat[i : i + step] for i in range(0, max(flat.size, 1), step)]

    def _start(self, buf, label):
        """Start non-blocking allreduces of buf, in pieces of at most PIECE_BYTES; returns what _wait needs."""
        self.bytes_reduced += buf.nbytes
        reqs = [self.comm.iallreduce(piece, label) for piece in self._pieces(buf)]
        if self._thread is not None:
            self._thread.watch(reqs)
        return reqs, label, time.perf_counter_ns(), int(buf.nbytes)

    def _progress(self, pending):
        """Let MPI move outstanding messages along (it has no progress of its own here); with a progress
        thread, that thread does."""
        if self._thread is None:
            for req in pending[0]:
                req.test()

    def _wait(self, pending):
        reqs, label, start, nbytes = pending
        t_wait = time.perf_counter_ns()
        if self._thread is not None:
            self._thread.release(reqs)
        for req in reqs:
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
