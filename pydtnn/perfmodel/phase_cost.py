"""PhaseCost, the FLOPs and bytes of one phase of one layer, which every cost formula of costs.py and
conv_costs.py returns.

    PhaseCost(flops=2 * macs, bytes=(x + y) * s) + ZERO    # sums phase by phase

costs.py's docstring gives the units and the counting rules.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs (a multiply-add is 2) and bytes moved by one phase of one layer, for the whole batch."""

    flops: int = 0
    bytes: int = 0

    def __add__(self, other):
        return PhaseCost(self.flops + other.flops, self.bytes + other.bytes)


ZERO = PhaseCost()
