"""Host-to-device copies that do not make the host wait for the GPU.

A copy from pageable host memory is synchronous: the host waits until everything queued on the
stream has run. Copies from page-locked (pinned) memory are asynchronous. Two ways are used:

- BatchCopier, for training batches: its own CUDA stream and, per batch array and shape, a ring of
  pinned host buffers and device buffers used in turn. The copy of batch n+1 runs while the GPU
  computes step n; the computing stream waits for it through an event, the host never does, except
  for a pinned buffer whose previous copy is still running (two batches back). The arrays returned
  are ring buffers: the caller queues every use of a step's batch before it asks for the next one,
  as the trainer does.
- Uploader, for arrays made on the host during a step (dropout masks drawn from per-sample streams):
  a fresh device array, copied on the computing stream from a pinned buffer taken from a pool; the
  host waits only for an earlier copy out of the same pinned buffer.

Both take the `cupy` module as an argument, so their ordering can be checked with a stand-in.
"""

import numpy as np


class _Slot:
    __slots__ = ("host", "device", "copied", "released")

    def __init__(self, host, device):
        self.host, self.device = host, device
        self.copied = None  # event on the copy stream: the copy out of `host` into `device` is over
        self.released = None  # event on the computing stream: every use of `device` has run


class BatchCopier:
    """Training batches to the GPU on a copy stream (see the module docstring).

    Each call is one step's batch: `copier(x, y)` returns their device copies. Every use of a step's
    arrays must be queued before the next call: the call records, on the computing stream, the point
    after which the previous call's buffers are free, and a buffer is refilled only after that point
    (with `depth` 2, two calls later). Rings are kept per (position in the call, shape, dtype), so
    inputs and targets of one shape never share a ring.
    """

    def __init__(self, cp, depth=2, max_shapes=16, empty_pinned=None):
        self.cp, self.empty_pinned = cp, empty_pinned or _empty_pinned()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.depth, self.max_shapes = depth, max_shapes
        self.rings = {}  # (position, shape, dtype) -> slots, the next one to use first
        self.handed = []  # the slots the previous call handed out

    def __call__(self, *arrays):
        cp = self.cp
        compute = cp.cuda.get_current_stream()
        now = cp.cuda.Event(disable_timing=True)
        now.record(compute)  # every use of the previous call's batches is queued before this point
        for slot in self.handed:
            slot.released = now
        self.handed = []
        return [self._copy(i, np.ascontiguousarray(a), compute) for i, a in enumerate(arrays)]

    def _copy(self, position, a, compute):
        cp = self.cp
        key = (position, a.shape, a.dtype.str)
        ring = self.rings.get(key)
        if ring is None:
            if len(self.rings) >= self.max_shapes:  # batches come in a few shapes; others are not kept forever
                self._drop(next(iter(self.rings)))
            ring = self.rings[key] = [_Slot(self.empty_pinned(a.shape, a.dtype), cp.empty(a.shape, a.dtype))
                                      for _ in range(self.depth)]
            fresh = cp.cuda.Event(disable_timing=True)
            fresh.record(compute)  # memory from the pool may still be read by work queued before this point
            for slot in ring:
                slot.released = fresh
        slot = ring.pop(0)
        ring.append(slot)
        self.handed.append(slot)
        if slot.copied is not None:
            slot.copied.synchronize()  # the pinned buffer's last copy has left it
        slot.host[...] = a
        if slot.released is not None:
            self.stream.wait_event(slot.released)  # the device buffer's last batch has been used
        slot.device.set(slot.host, stream=self.stream)
        slot.copied = cp.cuda.Event(disable_timing=True)
        slot.copied.record(self.stream)
        compute.wait_event(slot.copied)  # the computation reads the batch after it has arrived
        slot.released = None
        return slot.device

    def _drop(self, key):
        for slot in self.rings.pop(key):
            if slot.copied is not None:
                slot.copied.synchronize()


class Uploader:
    """Host arrays made during a step to fresh device arrays, through pinned buffers (module docstring)."""

    def __init__(self, cp, per_size=4, empty_pinned=None):
        self.cp, self.empty_pinned = cp, empty_pinned or _empty_pinned()
        self.per_size = per_size
        self.pool = {}  # (nbytes, dtype) -> [[pinned buffer, event of its last copy or None], ...]

    def __call__(self, a):
        cp = self.cp
        a = np.ascontiguousarray(a)
        key = (a.nbytes, a.dtype.str)
        if key not in self.pool and len(self.pool) >= 32:  # a few mask sizes per model; others are not kept
            for _, event in self.pool.pop(next(iter(self.pool))):
                if event is not None:
                    event.synchronize()
        buffers = self.pool.setdefault(key, [])
        if len(buffers) < self.per_size:  # a new buffer, used at once
            entry = [self.empty_pinned(a.size, a.dtype), None]
        else:  # the least recently used one
            entry = buffers.pop(0)
        buffers.append(entry)
        if entry[1] is not None:
            entry[1].synchronize()
        host = entry[0].reshape(a.shape)
        host[...] = a
        stream = cp.cuda.get_current_stream()
        out = cp.empty(a.shape, a.dtype)
        out.set(host, stream=stream)
        entry[1] = cp.cuda.Event(disable_timing=True)
        entry[1].record(stream)
        return out


def _empty_pinned():
    import cupyx

    return cupyx.empty_pinned
