"""Which algorithm computes a convolution on the CPU: chosen once per layer, when it is built.

    direct          compiled direct stride-1 kernels (conv_direct.py): depthwise 3x3 layers, and one-group
                    3x3, 5x5 and 7x7 layers at least tuning.direct_min_width outputs wide (twice that
                    from tuning.direct_narrow_max_channels input channels on)
    direct_stride2  a stride-2 depthwise 3x3 layer computed at stride 1 by the compiled kernels: 4x the
                    multiply-adds of the strided layer, but compiled and on all threads
    depthwise       NumPy depthwise convolution on the wide grid (conv_depthwise.py)
    pointwise       one-group 1x1 stride-1 layers: one GEMM per sample on x and dy as they lie
                    (conv_pointwise.py)
    gemm            im2col + GEMM, everything else (conv_gemm.py)
    winograd        Winograd F(2x2, 3x3) for one-group 3x3 stride-1 layers (conv_winograd.py): only where
                    the measured choice (autotune.py) finds it faster, never by threshold
"""

from dataclasses import dataclass, replace

from pydtnn.backends.geometry import ConvGeometry

ALGORITHMS = ("direct", "direct_stride2", "depthwise", "pointwise", "gemm", "winograd")


@dataclass(frozen=True)
class ConvPlan:
    """geometry: the layer's; algorithm: one of ALGORITHMS; run: the geometry the algorithm computes
    (the stride-1 twin for direct_stride2, else geometry)."""

    geometry: ConvGeometry
    algorithm: str
    run: ConvGeometry


def direct_ok(g, co):
    """Whether the compiled direct kernels compute geometry g with co output channels: stride 1, 3x3
    with one group or depthwise (one input and one output channel per group), or 5x5 or 7x7 with one
    group; and padding at most the kernel's reach on every side (so that dx, a convolution of dy, is
    padded too)."""
    eh, ew = (g.kh - 1) * g.dh, (g.kw - 1) * g.dw
    return (
        g.kh == g.kw
        and (g.sh, g.sw) == (1, 1)
        and ((g.kh == 3 and (g.groups == 1 or g.groups == g.c == co)) or (g.kh in (5, 7) and g.groups == 1))
        and 0 <= min(g.pt, g.pb) <= max(g.pt, g.pb) <= eh
        and 0 <= min(g.pl, g.pr) <= max(g.pl, g.pr) <= ew
    )


def pointwise_ok(g, co, tuning):
    """A one-group 1x1 convolution, stride 1, no padding, with at least tuning.gemm_min_columns pixels,
    whose weight (co x c) is at most half the size of one sample's x and dy together. Its weight
    gradient adds a weight-sized product per sample; past that size those additions cost more than
    regrouping x and dy for im2col (512 -> 512 at 16x16, batch 64, one thread: 375 against 330 ms a
    forward and backward)."""
    p = g.ho * g.wo
    return (
        (g.kh, g.kw, g.sh, g.sw, g.groups) == (1, 1, 1, 1, 1)
        and not g.padded
        and p >= tuning.gemm_min_columns
        and 2 * co * g.c <= p * (g.c + co)
    )


def choose(g, co, kernels, tuning):
    """The ConvPlan of geometry g with co output channels, for kernels 'numba' or 'numpy'."""
    compiled = kernels == "numba"
    if compiled and (g.sh, g.sw) == (2, 2) and g.groups == g.c == co:
        g1 = replace(g, sh=1, sw=1)
        if direct_ok(g1, co):
            return ConvPlan(g, "direct_stride2", g1)
    if compiled and direct_ok(g, co):
        wide = g.wo >= tuning.direct_min_width and (
            g.wo >= 2 * tuning.direct_min_width or g.c < tuning.direct_narrow_max_channels
        )
        if g.groups > 1 or wide:
            return ConvPlan(g, "direct", g)
    if g.c == g.groups and g.sh == g.sw:
        return ConvPlan(g, "depthwise", g)
    if pointwise_ok(g, co, tuning):
        return ConvPlan(g, "pointwise", g)
    return ConvPlan(g, "gemm", g)


def plan_for(g, algorithm):
    """The ConvPlan computing geometry g with `algorithm` (one of ALGORITHMS), which the caller knows to
    be eligible (autotune.candidates): the measured choice, where choose() gives the threshold one."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"convolution algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return ConvPlan(g, algorithm, replace(g, sh=1, sw=1) if algorithm == "direct_stride2" else g)
