"""Which algorithm computes a convolution on the CPU: chosen once per layer, when it is built, from the
entries of conv_algorithms.REGISTRY (their list and what each takes is there)."""

from dataclasses import dataclass

from pydtnn.backends.cpu.conv_algorithms import BY_NAME, REGISTRY
from pydtnn.backends.geometry import ConvGeometry

ALGORITHMS = tuple(a.name for a in REGISTRY)


@dataclass(frozen=True)
class ConvPlan:
    """geometry: the layer's; algorithm: one of ALGORITHMS; run: the geometry the algorithm computes
    (the stride-1 twin for direct_stride2, else geometry)."""

    geometry: ConvGeometry
    algorithm: str
    run: ConvGeometry


def choose(g, co, kernels, tuning):
    """The ConvPlan of geometry g with co output channels, for kernels 'numba' or 'numpy': the first
    entry of the registry that is eligible and preferred (gemm takes what no other does)."""
    for a in REGISTRY:
        if a.eligible(g, co, kernels, tuning) and a.preferred(g, co, tuning):
            return ConvPlan(g, a.name, a.run_geometry(g))
    raise AssertionError(f"no convolution algorithm takes {g} with {co} output channels")  # gemm takes all


def plan_for(g, algorithm):
    """The ConvPlan computing geometry g with `algorithm` (one of ALGORITHMS), which the caller knows to
    be eligible (autotune.candidates): the measured choice, where choose() gives the threshold one."""
    if algorithm not in BY_NAME:
        raise ValueError(f"convolution algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return ConvPlan(g, algorithm, BY_NAME[algorithm].run_geometry(g))
