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

compression (pydtnn.distributed.compression) is what each message carries: "none", the gradients as they
are, or "fp16", half-precision copies scaled into fp16's range; the reducer calls its compress() before a
message and decompress() after it. Which reducer takes which compression, progress and device is the
registry's to say (reducers/__init__.py: validate()).
"""

import itertools
import time
import weakref
from contextlib import contextmanager

from pydtnn.backends import array_module
from pydtnn.distributed.compression import compression_of
from pydtnn.distributed.reducers.layout import piece_bounds

PIECE_BYTES = 16 * 2**20  # largest single message; see the module docstring
PROGRESS = ("test", "thread")  # how outstanding reductions are progressed: test() between layers, or a thread


class Reducer:
    """Base: keeps the (name, param, grad) list and the step's weight.

    Gradients may be read only after finish(): between the first gradients-ready hook and then,
    reductions run in place on them (scaled, and being summed by non-blocking collectives).
    """

    name = None
    has_update = True  # after finish(): whether the gradients hold an update to apply (the stale reducer's first
    # reduction of an epoch leaves none: the optimizer's step is skipped)
    shared_state = ()  # names in state_dict() that every rank holds alike (restored from any rank's row)

    def __init__(self, comm, compression="none", progress="test"):
        """comm: a Communicator; compression: "none", "fp16" or a compression object; progress: "test" or
        "thread" (reducers.create() checks first that this reducer takes them)."""
        self.comm = comm
        self.compression = compression_of(compression)
        self.progress = progress
        self._thread = None
        if progress == "thread" and comm.size > 1:
            self._thread = comm.progress_thread()
            weakref.finalize(self, self._thread.close)  # the thread ends with the reducer
        self.weight = 1.0
        self.tracer = None
        self.bytes_reduced = 0
        self._paused = False

    def attach(self, model):
        self.gradients = model.gradients()  # [(name, grad)]: the parameters are not held
        self.grads = dict(self.gradients)
        # in place only when the wire format is the gradients' own and the buffer really backs them
        self.flat, self.offsets = None, {}
        if self.compression.in_place and model.grad_buffer is not None:
            self.flat, self.offsets = model.grad_buffer, model.grad_offsets
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

    def after_update(self, optimizer):
        """Called after each optimizer step (reduce_and_update); local SGD averages the replicas here."""

    def epoch_sent(self):
        """Bytes this process sent per step since the epoch began, as its collectives send them; None for a reducer
        that does not count them (the sparse ones, topk and oktopk, do)."""
        return None

    def end_epoch(self, optimizer):
        """Called by the trainer at the end of each epoch, before evaluation."""

    def resume_at(self, step):
        """Called on resume with the updates done so far (the optimizer's count); powersgd's start follows it."""

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

    def param_spans(self):
        """{parameter name: (start, stop)} of each gradient in the flat arrays state_dict() gives (none here)."""
        return {}

    def _pack(self, views, names):
        """Write each gradient, times this rank's weight, into its wire buffer view (compressed)."""
        self.compression.compress(self.grads, names, views, self.weight, self.comm)

    def _scale(self, buf):
        """Multiply buf, a run of the model's own gradients, by this rank's weight in place."""
        if self.weight != 1.0:
            array_module(buf).multiply(buf, self.weight, out=buf)

    def _unpack(self, views, names):
        """Write the reduced wire buffer views back into the gradients (decompressed)."""
        self.compression.decompress(views, self.grads, names)

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
        return [flat[a:b] for a, b in piece_bounds(flat.size, buf.itemsize, PIECE_BYTES)]

    def _start(self, buf, label):
        """Start non-blocking allreduces of buf, in pieces of at most PIECE_BYTES; returns what _wait needs."""
        self.bytes_reduced += buf.nbytes
        reqs = [self.comm.iallreduce(piece, label) for piece in self._pieces(buf)]
        if self._thread is not None:
            self._thread.watch(reqs)
        return reqs, label, time.perf_counter_ns(), int(buf.nbytes)

    def _bucket_ready(self, names):
        """[the buckets these gradients complete], after letting every outstanding message move: the bucketed
        reducers' count of each bucket's gradients still to come (self.bucket_of: name -> bucket, self.missing:
        per bucket; self.pending: [(bucket, what _wait takes)])."""
        for _, p in self.pending:
            self._progress(p)
        done = []
        for n in names:
            i = self.bucket_of[n]
            self.missing[i] -= 1
            if self.missing[i] == 0:
                done.append(i)
        return done

    def _progress(self, pending):
        """Let MPI move outstanding messages along (it has no progress of its own here); with a progress
        thread, that thread does."""
        if self._thread is None:
            for req in pending[0]:
                req.test()

    def _wait(self, pending, collective="allreduce"):
        reqs, label, start, nbytes = pending
        t_wait = time.perf_counter_ns()
        if self._thread is not None:
            self._thread.release(reqs)
        for req in reqs:
            req.wait()
        if self.tracer is not None:
            end = time.perf_counter_ns()
            self.tracer.add(f"{collective} {label}", collective, start, end, tid=2, bytes=nbytes)
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
