"""Host-to-device copies that do not make the host wait for the GPU.

A copy from pageable host memory is synchronous: the host waits until everything queued on the
stream has run. Copies from page-locked (pinned) memory are asynchronous. Two ways are used:

- BatchCopier, for training batches: its own CUDA stream and, per batch shape, a ring of pinned host
  buffers and device buffers used in turn. The copy of batch n+1 runs while the GPU computes step n;
  the computing stream waits for it through an event, the host never does, except for a pinned buffer
  whose previous copy is still running (two batches back). The array returned is one of the ring's
  device buffers: valid until `depth` more batches of that shape have been copied, which is how the
  trainer uses it (one batch of each shape per step).
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
    """Training batches to the GPU on a copy stream (see the module docstring)."""

    def __init__(self, cp, depth=2, max_shapes=8, empty_pinned=None):
        self.cp, self.empty_pinned = cp, empty_pinned or _empty_pinned()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.depth, self.max_shapes = depth, max_shapes
        self.rings = {}  # (shape, dtype) -> slots, the next one to use first
        self.last = {}  # (shape, dtype) -> the slot handed out most recently

    def __call__(self, a):
        cp = self.cp
        a = np.ascontiguousarray(a)
        key = (a.shape, a.dtype.str)
        ring = self.rings.get(key)
        if ring is None:
            if len(self.rings) >= self.max_shapes:  # batches come in a few shapes; others are not kept forever
                self._drop(next(iter(self.rings)))
            ring = self.rings[key] = [_Slot(self.empty_pinned(a.shape, a.dtype), cp.empty(a.shape, a.dtype))
                                      for _ in range(self.depth)]
        compute = cp.cuda.get_current_stream()
        previous = self.last.get(key)
        if previous is not None:  # the batch before this one: its uses are all queued by now
            previous.released = cp.cuda.Event(disable_timing=True)
            previous.released.record(compute)
        slot = ring.pop(0)
        ring.append(slot)
        self.last[key] = slot
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
        self.last.pop(key, None)


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
        if len(buffers) < self.per_size:
            buffers.append([self.empty_pinned(a.size, a.dtype), None])
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
