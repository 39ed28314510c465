"""The CPU backend's convolution algorithms: one entry each, in one ordered tuple, REGISTRY.

    direct_stride2  a stride-2 depthwise 3x3 layer computed at stride 1 by the compiled kernels: 4x the
                    multiply-adds of the strided layer, but compiled and on all threads (conv_direct.py)
    direct          compiled direct stride-1 kernels (conv_direct.py): depthwise 3x3 layers, and one-group
                    3x3, 5x5 and 7x7 layers at least tuning.direct_min_width outputs wide (twice that
                    from tuning.direct_narrow_max_channels input channels on)
    winograd        Winograd F(2x2, 3x3) for one-group 3x3 stride-1 layers (conv_winograd.py): only where
                    the measured choice (autotune.py) finds it faster, never by threshold
    depthwise       NumPy depthwise convolution on the wide grid (conv_depthwise.py)
    pointwise       one-group 1x1 stride-1 layers: one GEMM per sample on x and dy as they lie
                    (conv_pointwise.py)
    gemm            im2col + GEMM, everything else (conv_gemm.py)

Everything that must agree about an algorithm is in its entry: which layers it computes, when the
threshold choice takes it, its forward and backward, the geometry it runs and its cost. Whoever needs
the algorithms reads this tuple: conv_plan.choose (the first eligible entry it prefers; the order is the
preference), autotune.candidates (every eligible entry), CPUBackend (the plan's entry computes) and the
performance model (perfmodel/conv_costs.py: the plan's entry's cost). A new algorithm is one entry here
and its module.
"""

from collections.abc import Callable
from dataclasses import dataclass

from pydtnn.backends.cpu import conv_depthwise, conv_direct, conv_gemm, conv_pointwise, conv_winograd


@dataclass(frozen=True)
class ConvAlgorithm:
    """One convolution algorithm; g: the layer's ConvGeometry, co: its output channels, kernels: 'numba'
    or 'numpy', tuning: a Tuning.

    eligible(g, co, kernels, tuning) -> bool: it computes this layer.
    preferred(g, co, tuning) -> bool: conv_plan.choose takes it where eligible (and no earlier entry
        is taken).
    run_geometry(g) -> the geometry it computes: g, or direct_stride2's stride-1 twin (ConvPlan.run).
    forward(b, x, w, run, keep) -> (y, ctx); backward(b, dy, w, ctx, run, need_dx) -> (dx or None, dw):
        b a Workspace, run = run_geometry(g); x (N, C, H, W), w (Co, C/groups, kh, kw), y and dy
        (N, Co, Ho, Wo) of the layer.
    cost(g, co, n, itemsize, tuning, kernels, need_dx) -> (kernel class, forward, backward_data,
        backward_weights): each phase (FLOPs, bytes) for n samples, as perfmodel/costs.py counts them.
    """

    name: str
    eligible: Callable
    preferred: Callable
    run_geometry: Callable
    forward: Callable
    backward: Callable
    cost: Callable


def always(*_):
    return True


def never(*_):
    return False


def same(g):
    return g


REGISTRY = (
    ConvAlgorithm("direct_stride2", eligible=conv_direct.stride2_eligible, preferred=always,
                  run_geometry=conv_direct.stride1_twin, forward=conv_direct.forward_stride2,
                  backward=conv_direct.backward_stride2, cost=conv_direct.stride2_cost),
    ConvAlgorithm("direct", eligible=conv_direct.eligible, preferred=conv_direct.preferred, run_geometry=same,
                  forward=conv_direct.forward, backward=conv_direct.backward, cost=conv_direct.cost),
    ConvAlgorithm("winograd", eligible=conv_winograd.eligible, preferred=never, run_geometry=same,
                  forward=conv_winograd.forward, backward=conv_winograd.backward, cost=conv_winograd.cost),
    ConvAlgorithm("depthwise", eligible=conv_depthwise.eligible, preferred=always, run_geometry=same,
                  forward=conv_depthwise.forward, backward=conv_depthwise.backward, cost=conv_depthwise.cost),
    ConvAlgorithm("pointwise", eligible=conv_pointwise.eligible, preferred=always, run_geometry=same,
                  forward=conv_pointwise.forward, backward=conv_pointwise.backward, cost=conv_pointwise.cost),
    ConvAlgorithm("gemm", eligible=always, preferred=always, run_geometry=same,
                  forward=conv_gemm.forward, backward=conv_gemm.backward, cost=conv_gemm.cost),
)

BY_NAME = {a.name: a for a in REGISTRY}  # the dispatch of CPUBackend and the performance model
