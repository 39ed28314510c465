"""PhaseCost, the FLOPs and bytes of one phase of one layer, and the window counts that the cost formulas
of costs.py (pooling) and conv_costs.py (im2col) share.

    PhaseCost(flops=2 * macs, bytes=(x + y) * s) + ZERO    # sums phase by phase
    touched(layer.geometry)                                # [outputs per kernel position], per sample and channel

costs.py's docstring gives the units and the counting rules.
"""

from dataclasses import dataclass

from pydtnn.backends.geometry import positions


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs (a multiply-add is 2) and bytes moved by one phase of one layer, for the whole batch."""

    flops: int = 0
    bytes: int = 0

    def __add__(self, other):
        return PhaseCost(self.flops + other.flops, self.bytes + other.bytes)


ZERO = PhaseCost()


def _len(sl):
    return len(range(sl.start, sl.stop, sl.step or 1))


def touched(g):
    """Outputs each kernel position of g covers, per sample and channel (its output view and its strided
    input view have that many elements each; positions that read only padding are left out)."""
    return [_len(orows) * _len(ocols) for _, _, _, orows, ocols, _, _ in positions(g)]
