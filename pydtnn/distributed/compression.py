"""Gradient compression on the wire, composable with the reducers (Horovod's Compressor, PyTorch's
fp16_compress_wrapper): compress before the collective, decompress after it.

    reducer = reducers.create("bucketed", comm, compression="fp16")          # or FP16Compression()

A reducer hands its compression the gradients of one message and the views of the message buffer they
travel in: compress() writes each gradient, times this rank's share of the global batch (`weight`), into
its view; the reducer sums the buffer over the ranks; decompress() writes the sums back into the
gradients. A compression whose wire format is the gradients' own (`in_place`) lets the reducers send the
model's gradient buffer itself, scaled in place, with no copy in or out.

- NoCompression ("none"): the gradients' dtype on the wire.
- FP16Compression ("fp16"): half-precision copies of the (already scaled) gradients: half the bytes on the
  wire, at the price of fp16 rounding of every gradient and, over MPI, a reduction operator written in
  Python (MPI has no half-precision sum). It pays only where the network, not memory, is the bottleneck.
  Each gradient travels times a power of two of its own, the same on every rank, chosen so that its sum
  over the ranks stays under 2^15 (fp16's largest value is 65504) with its largest entries just below:
  fp16 keeps 11 significant bits from 2^15 down to its smallest normal value 2^-14, and unscaled
  gradients lie mostly under that (19-90% of a ResNet-20's entries per rank, where fp16 keeps fewer
  bits, or none under 6e-8). The powers come from one small reduction per message before it (the sum
  over the ranks of each gradient's largest magnitude, a bound on every partial sum; not counted in
  bytes_reduced); multiplying and dividing by them is exact.
"""

import numpy as np

from pydtnn.backends import array_module, is_device_array
from pydtnn.errors import ConfigError


class NoCompression:
    """The gradients travel in their own dtype."""

    name = "none"
    wire_dtype = None  # the gradients' own
    in_place = True  # the reducers may send the gradients' own memory

    def compress(self, grads, names, views, weight, comm):
        """views[i] = weight x grads[names[i]] (a view may be the gradient itself: scaled in place)."""
        for view, n in zip(views, names):
            array_module(view).multiply(grads[n], weight, out=view, casting="same_kind")

    def decompress(self, views, grads, names):
        """grads[names[i]] = views[i], the reduced sums (nothing to copy where the view is the gradient)."""
        for view, n in zip(views, names):
            if view is not grads[n]:
                grads[n][...] = view


class FP16Compression:
    """Half precision on the wire, each gradient scaled by a power of two into fp16's range (module docstring)."""

    name = "fp16"
    wire_dtype = np.float16
    in_place = False
    TOP = 15  # every gradient's sum over the ranks is scaled under 2^TOP (fp16's largest: 65504)
    SHIFT_LIMIT = 64  # and by at most 2^+-64, which float32 gradients take without leaving their normal range

    def __init__(self):
        self.scales = {}  # name: the power of two its gradient was last sent times

    def compress(self, grads, names, views, weight, comm):
        """views[i] = fp16(weight x scale_i x grads[names[i]]); the scales take one small collective over comm."""
        scales = self._scales(grads, names, weight, comm)
        for view, n, s in zip(views, names, scales):
            array_module(view).multiply(grads[n], weight * s, out=view, casting="same_kind")

    def decompress(self, views, grads, names):
        """grads[names[i]] = views[i] / scale_i (exact: a power of two)."""
        for view, n in zip(views, names):
            g = grads[n]
            g[...] = view
            s = self.scales.get(n, 1.0)
            if s != 1.0:
                array_module(g).multiply(g, 1.0 / s, out=g, casting="same_kind")

    def _scales(self, grads, names, weight, comm):
        """A power of two per gradient, the same on every rank, that puts the gradient's sum over the ranks
        (and every partial sum on the way) under 2^TOP and its largest entries above 2^(TOP - 1): the sum over
        the ranks of each gradient's largest magnitude, times this rank's weight, bounds them. 1 where that
        bound is 0 or not finite. Remembered for decompress()."""
        arrays = [grads[n] for n in names]
        xp = array_module(arrays[0])
        local = xp.stack([xp.abs(g).max() if g.size else xp.zeros((), g.dtype) for g in arrays])
        local = np.asarray(local.get() if is_device_array(local) else local, np.float64) * abs(weight)
        bound = np.asarray(comm.allreduce_sum(local, "fp16 scales"), np.float64)
        ok = np.isfinite(bound) & (bound > 0)
        _, exponent = np.frexp(np.where(ok, bound, 1.0))  # bound < 2^exponent
        powers = np.where(ok, np.clip(self.TOP - exponent, -self.SHIFT_LIMIT, self.SHIFT_LIMIT), 0)
        scales = [float(np.ldexp(1.0, int(e))) for e in powers]
        self.scales.update(zip(names, scales))
        return scales


_BY_NAME = {c.name: c for c in (NoCompression, FP16Compression)}
COMPRESSIONS = tuple(_BY_NAME)


def compression_of(spec):
    """The compression `spec` names (COMPRESSIONS), or `spec` itself when it is a compression object
    (a new one per name: FP16Compression keeps its reducer's scales)."""
    if isinstance(spec, str):
        if spec not in _BY_NAME:
            raise ConfigError(f"unknown gradient compression {spec!r}; expected {' or '.join(COMPRESSIONS)}")
        return _BY_NAME[spec]()
    return spec
