"""Gradient compression as an object of its own (pydtnn/distributed/compression.py): compress before the wire,
decompress after it, taken by any reducer; the registry refuses the combinations that cannot carry it.
Multi-process equivalence (N processes against one, fp16 on every strategy that takes it) is in
tests/test_distributed.py."""

import numpy as np
import pytest

from pydtnn.distributed import reducers
from pydtnn.distributed.comm import SingleProcess
from pydtnn.distributed.compression import COMPRESSIONS, FP16Compression, NoCompression, compression_of
from pydtnn.errors import ConfigError


class Counting(SingleProcess):
    """One process that counts the small sums it is asked for (the fp16 scales' collective)."""

    def __init__(self):
        self.sums = 0

    def allreduce_sum(self, values, label="metrics"):
        self.sums += 1
        return super().allreduce_sum(values, label)


def test_no_compression_scales_into_the_wire_or_in_place_and_copies_back_only_a_separate_wire():
    grads = {"a": np.array([1.0, -2.0]), "b": np.array([4.0])}
    wire = np.empty(2)
    c = NoCompression()
    c.compress(grads, ["a", "b"], [wire, grads["b"]], 0.5, Counting())
    np.testing.assert_array_equal(wire, [0.5, -1.0])
    np.testing.assert_array_equal(grads["b"], [2.0])  # the gradient itself was the wire: scaled in place
    wire *= 3  # the "sum over the ranks"
    c.decompress([wire, grads["b"]], grads, ["a", "b"])
    np.testing.assert_array_equal(grads["a"], [1.5, -3.0])
    assert (c.name, c.wire_dtype, c.in_place) == ("none", None, True)


def test_fp16_compression_sends_half_precision_scaled_by_a_power_of_two_and_restores_it():
    """Gradients of 1e-6 would keep few bits in fp16 (its normal range starts at 6e-5): each is sent times a
    power of two, the same on every rank, that puts its largest entry just under 2^15; one collective per
    message finds the powers; decompress divides exactly."""
    rng = np.random.default_rng(0)
    grads = {"w": (rng.standard_normal(50) * 1e-6).astype(np.float32), "b": np.zeros(3, np.float32)}
    sent = {n: g.copy() for n, g in grads.items()}
    views = [np.empty(50, np.float16), np.empty(3, np.float16)]
    c, comm = FP16Compression(), Counting()
    c.compress(grads, ["w", "b"], views, 1.0, comm)
    assert comm.sums == 1 and c.scales["b"] == 1.0
    top = np.abs(views[0].astype(np.float64)).max()
    assert 2.0**14 <= top <= 2.0**15 and np.log2(c.scales["w"]).is_integer()
    c.decompress(views, grads, ["w", "b"])
    np.testing.assert_allclose(grads["w"], sent["w"], rtol=2.0**-10)
    np.testing.assert_array_equal(grads["b"], 0)
    assert (c.name, c.wire_dtype, c.in_place) == ("fp16", np.float16, False)


@pytest.mark.parametrize("name", reducers.NAMES)
def test_every_reducer_takes_a_compression_object_it_accepts(name):
    """The compression is the reducer's collaborator, by name or as an object; a new FP16Compression per reducer
    made from a name (it keeps that reducer's scales)."""
    accepted = [c for c in COMPRESSIONS if c in reducers.STRATEGIES[name].compressions]
    for c in accepted:
        obj = compression_of(c)
        assert reducers.create(name, SingleProcess(), compression=obj).compression is obj
    if "fp16" in accepted:
        a, b = (reducers.create(name, SingleProcess(), compression="fp16") for _ in range(2))
        assert isinstance(a.compression, FP16Compression) and a.compression is not b.compression


def test_topk_refuses_fp16_in_one_line_naming_the_strategies_that_take_it():
    with pytest.raises(ConfigError) as e:
        reducers.create("topk", SingleProcess(), compression="fp16")
    msg = str(e.value)
    assert msg == ("topk reducer: compression 'fp16'; expected none (compression fp16 is taken by blocking, "
                   "per_layer, bucketed, hierarchical)")
    with pytest.raises(ConfigError, match=r"^unknown gradient compression 'bf16'; expected none or fp16$"):
        reducers.create("bucketed", SingleProcess(), compression="bf16")
