"""The geometry of a 2-D convolution or pooling window, and the index arithmetic every backend shares."""

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes of one 2-D convolution or pooling window, fixed at build time.

    c, h, w: input channels and size; kh, kw: kernel; sh, sw: stride; dh, dw: dilation;
    pt, pb, pl, pr: zero padding top/bottom/left/right; ho, wo: output size; groups.
    """

    c: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int = 1
    sw: int = 1
    dh: int = 1
    dw: int = 1
    pt: int = 0
    pb: int = 0
    pl: int = 0
    pr: int = 0
    groups: int = 1

    @property
    def ho(self):
        return (self.h + self.pt + self.pb - self.dh * (self.kh - 1) - 1) // self.sh + 1

    @property
    def wo(self):
        return (self.w + self.pl + self.pr - self.dw * (self.kw - 1) - 1) // self.sw + 1

    @property
    def padded(self):
        return self.pt or self.pb or self.pl or self.pr


def _span(n_out, n_in, offset, pad, stride):
    """Outputs o in [lo, hi) whose input index o*stride + offset - pad lies in [0, n_in).

    Returns (output slice, input slice), or None when every output of this kernel offset reads padding.
    """
    first = offset - pad  # input index read by output 0
    lo = max(0, -(first // stride))
    hi = min(n_out, (n_in - 1 - first) // stride + 1)
    if hi <= lo:
        return None
    start = lo * stride + first
    return slice(lo, hi), slice(start, start + (hi - lo - 1) * stride + 1, stride)


@cache
def positions(g):
    """Kernel positions (k, i, j, out_rows, out_cols, in_rows, in_cols), k = i*kw + j in increasing order.

    For position (i, j), output[..., out_rows, out_cols] reads input[..., in_rows, in_cols] of the
    unpadded input; outputs outside these slices read zero padding. Positions that read only
    padding are left out. Padding may be negative (a crop): the transposed convolution uses that.
    """
    rows = [_span(g.ho, g.h, i * g.dh, g.pt, g.sh) for i in range(g.kh)]
    cols = [_span(g.wo, g.w, j * g.dw, g.pl, g.sw) for j in range(g.kw)]
    return tuple(
        (i * g.kw + j, i, j, r[0], c[0], r[1], c[1])
        for i, r in enumerate(rows)
        for j, c in enumerate(cols)
        if r is not None and c is not None
    )


@cache
def window_layout(g):
    """(disjoint, covering) for pooling windows: no input element in two windows; every element in one."""
    disjoint = g.sh >= g.dh * (g.kh - 1) + 1 and g.sw >= g.dw * (g.kw - 1) + 1
    covering = (
        disjoint
        and not g.padded
        and (g.sh, g.sw, g.dh, g.dw) == (g.kh, g.kw, 1, 1)
        and (g.h, g.w) == (g.ho * g.kh, g.wo * g.kw)
    )
    return disjoint, covering


def transposed(g, co):
    """Geometry of dx = conv(dy, flipped and transposed w) for a stride-1 convolution.

    Its input is dy (co channels, ho x wo); its output is x's shape. Padding becomes d*(k-1) - p,
    negative (a crop) where the forward padded more than d*(k-1).
    """
    et, ew = g.dh * (g.kh - 1), g.dw * (g.kw - 1)
    return ConvGeometry(
        co, g.ho, g.wo, g.kh, g.kw, 1, 1, g.dh, g.dw, et - g.pt, et - g.pb, ew - g.pl, ew - g.pr, groups=g.groups
    )


def macs(g, co, n=1):
    """Multiply-adds of convolution geometry g with co output channels over n samples."""
    return n * co * g.ho * g.wo * (g.c // g.groups) * g.kh * g.kw


def touched(g):
    """Outputs each kernel position of g covers, per sample and channel (its output view and its strided
    input view have that many elements each; positions that read only padding are left out)."""
    return [len(range(r.start, r.stop, r.step or 1)) * len(range(c.start, c.stop, c.step or 1))
            for _, _, _, r, c, _, _ in positions(g)]
