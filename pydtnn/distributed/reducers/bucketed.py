"""Gradients packed into fixed-size buckets in reverse layer order, each reduced once full.

Buckets are laid out once, identically on every rank, from the model's parameter order reversed
(backward produces gradients roughly in that order), by layout.bucket_layout, which the performance
model calls too. The first bucket is small so communication starts early; the others hold about
`bucket_mb` MB. A bucket's non-blocking allreduce starts as soon as all its gradients are ready, and
outstanding ones are progressed with test() each time a layer finishes, since MPI makes no progress in
the background here. Where the model's gradients live in one buffer in that same order, a bucket is a
slice of it, scaled and reduced in place.
"""

from pydtnn.distributed.reducers.base import Reducer, flat_buffer
from pydtnn.distributed.reducers.layout import bucket_layout


class BucketedReducer(Reducer):
    name = "bucketed"

    def __init__(self, comm, bucket_mb=25.0, first_bucket_mb=1.0, compression="none", progress="test"):
        super().__init__(comm, compression, progress)
        self.bucket_bytes, self.first_bytes = bucket_mb * 2**20, first_bucket_mb * 2**20

    def setup(self):
        order = [n for n, _ in reversed(self.gradients)]
        spans = bucket_layout([self.grads[n].nbytes for n in order], self.bucket_bytes, self.first_bytes)
        self.buckets = [order[a:b] for a, b in spans]  # [names]
        self.bucket_of = {n: i for i, names in enumerate(self.buckets) for n in names}
        self.buffers = []  # (wire buffer, views of it per gradient, or None when the buffer is the gradients)
        for names in self.buckets:
            span = self._span(names)
            if span is not None:
                self.buffers.append((self.flat[span[0] : span[1]], None))
            else:
                self.buffers.append(flat_buffer([self.grads[n] for n in names], self.compression.wire_dtype))
        self.missing = [len(names) for names in self.buckets]
        self.pending = []

    def grads_ready(self, names):
        for i in self._bucket_ready(names):
            self._start_bucket(i)

    def _start_bucket(self, i):
        buf, views = self.buffers[i]
        if views is None:
            self._scale(buf)
        else:
            self._pack(views, self.buckets[i])
        self.pending.append((i, self._start(buf, f"bucket {i}")))

    def finish(self):
        self.order_done = True
        if len(self.pending) != len(self.buckets):
            raise RuntimeError(f"bucketed reducer: {len(self.pending)} of {len(self.buckets)} buckets were started; "
                               "some gradients never reported ready")
        for i, p in self.pending:
            self._wait(p)
            if self.buffers[i][1] is not None:
                self._unpack(self.buffers[i][1], self.buckets[i])
        self.pending = []
        self.missing = [len(names) for names in self.buckets]
