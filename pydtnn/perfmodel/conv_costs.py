"""What a Conv2D costs by the CPU backend's algorithm: FLOPs and bytes moved per phase.

    algorithm, kernel_class, fwd, bwd_data, bwd_weights = conv2d(layer, n=64, need_dx=True)

Each algorithm's formulas are next to its code in `pydtnn/backends/cpu/conv_*.py`, named by its entry
of conv_algorithms.REGISTRY (`cost`), so the one list of algorithms also lists their costs; this adds
what every algorithm shares. Units, notation and the counting rules are costs.py's; costs.layer_costs
calls conv2d for every Conv2D.
"""

from pydtnn.backends.cpu.conv_algorithms import BY_NAME
from pydtnn.perfmodel.phase_cost import ZERO, PhaseCost


def conv2d(layer, n, need_dx):
    """Conv2D: the cost of the backend's algorithm (the plan in use: a measured plan wins), plus what
    every algorithm shares:
    bias    forward Y flops, 2*Y*s bytes (y += b in place); backward_weights Y flops, Y*s bytes (db = sum dy)
    dW      backward_weights 2*|W|*s bytes: the algorithm's dw copied into the layer's gradient buffer
    """
    plan, g, co = layer.backend.plan_in_use(layer.plan), layer.geometry, layer.filters
    s = layer.dtype.itemsize
    y = n * co * g.ho * g.wo
    tuning, kernels = layer.backend.tuning, layer.backend.kernels
    kernel_class, *phases = BY_NAME[plan.algorithm].cost(g, co, n, s, tuning, kernels, need_dx)
    fwd, bwd_d, bwd_w = (PhaseCost(*phase) for phase in phases)
    bwd_w = bwd_w + PhaseCost(0, 2 * int(layer.params["weight"].nbytes))
    if layer.use_bias:
        fwd = fwd + PhaseCost(y, 2 * y * s)
        bwd_w = bwd_w + PhaseCost(y, y * s)
    return plan.algorithm, kernel_class, fwd, bwd_d if need_dx else ZERO, bwd_w
