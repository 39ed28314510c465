"""The CPU convolution algorithms as one registry (backends/cpu/conv_algorithms.py): every entry is
complete, the threshold choice, the autotuner's candidates, the backend and the performance model all
read it, and the threshold choice is what it has been for every kind of layer. Also the one reading
of the CPU's features (isa.cpu_features) behind the kernels' width and the autotune cache key."""

import numpy as np
import pytest

from pydtnn.backends.cpu import CPUBackend, Tuning, autotune, conv_plan, isa
from pydtnn.backends.cpu.conv_algorithms import BY_NAME, REGISTRY
from pydtnn.backends.geometry import ConvGeometry
from pydtnn.layers import Conv2D
from pydtnn.model import Model
from pydtnn.perfmodel.costs import layer_costs
from pydtnn.perfmodel.machine import KERNEL_CLASSES

TUNING = Tuning()


def geom(c, hw, k, s=1, p=0, d=1, groups=1):
    """A square geometry: c channels of hw x hw, k x k kernel, stride s, padding p on every side (or a
    (top, bottom, left, right) tuple), dilation d."""
    pt, pb, pl, pr = p if isinstance(p, tuple) else (p,) * 4
    return ConvGeometry(c, hw, hw, k, k, s, s, d, d, pt, pb, pl, pr, groups)


# (geometry, output channels, threshold choice with kernels 'numba', with kernels 'numpy'), default Tuning:
# direct_min_width 8, direct_narrow_max_channels 256, gemm_min_columns 128
CHOICES = {
    "depthwise 3x3 s1": (geom(32, 16, 3, p=1, groups=32), 32, "direct", "depthwise"),
    "depthwise 3x3 s2": (geom(32, 16, 3, s=2, p=1, groups=32), 32, "direct_stride2", "depthwise"),
    "depthwise 3x3 s2, 2 outputs per channel": (geom(32, 16, 3, s=2, p=1, groups=32), 64, "depthwise", "depthwise"),
    "depthwise 3x3 s1, 2 outputs per channel": (geom(32, 16, 3, p=1, groups=32), 64, "depthwise", "depthwise"),
    "depthwise 5x5 s1": (geom(16, 16, 5, p=2, groups=16), 16, "depthwise", "depthwise"),
    "depthwise 3x3 dilated": (geom(8, 16, 3, p=2, d=2, groups=8), 8, "direct", "depthwise"),
    "depthwise 3x3, stride 2x1": (ConvGeometry(8, 16, 16, 3, 3, 2, 1, groups=8), 8, "gemm", "gemm"),
    "3x3 16->16 at 32x32": (geom(16, 32, 3, p=1), 16, "direct", "gemm"),
    "3x3 16->16 at 4x4: narrower than direct_min_width": (geom(16, 4, 3, p=1), 16, "gemm", "gemm"),
    "3x3 128->128 at 8x8": (geom(128, 8, 3, p=1), 128, "direct", "gemm"),
    "3x3 256->256 at 8x8: narrow with many channels": (geom(256, 8, 3, p=1), 256, "gemm", "gemm"),
    "3x3 256->256 at 16x16": (geom(256, 16, 3, p=1), 256, "direct", "gemm"),
    "3x3 16->120 at 3x3 unpadded: one output pixel": (geom(16, 3, 3), 120, "gemm", "gemm"),
    "5x5 8->16": (geom(8, 16, 5, p=2), 16, "direct", "gemm"),
    "7x7 3->8": (geom(3, 16, 7, p=3), 8, "direct", "gemm"),
    "1x1 32->64 at 16x16": (geom(32, 16, 1), 64, "pointwise", "pointwise"),
    "1x1 32->64 at 8x8: fewer pixels than gemm_min_columns": (geom(32, 8, 1), 64, "gemm", "gemm"),
    "1x1 512->512 at 16x16: weight larger than x and dy": (geom(512, 16, 1), 512, "gemm", "gemm"),
    "1x1 32->64 padded": (geom(32, 16, 1, p=1), 64, "gemm", "gemm"),
    "1x1 stride 2": (geom(32, 16, 1, s=2), 64, "gemm", "gemm"),
    "3x3 stride 2 one group": (geom(16, 32, 3, s=2, p=1), 32, "gemm", "gemm"),
    "3x3 4 groups": (geom(16, 16, 3, p=1, groups=4), 16, "gemm", "gemm"),
    "3x3 dilated 2": (geom(8, 16, 3, p=2, d=2), 8, "direct", "gemm"),
    "3x3 padded past the kernel's reach": (geom(8, 16, 3, p=3), 8, "gemm", "gemm"),
    "3x3 padded unevenly": (geom(16, 16, 3, p=(0, 1, 0, 1)), 16, "direct", "gemm"),
    "3x1 kernel": (ConvGeometry(8, 16, 16, 3, 1, pt=1, pb=1), 8, "gemm", "gemm"),
}


@pytest.mark.parametrize("name", list(CHOICES))
def test_the_threshold_choice_is_unchanged_for_every_kind_of_layer(name):
    g, co, numba, numpy = CHOICES[name]
    for kernels, want in (("numba", numba), ("numpy", numpy)):
        plan = conv_plan.choose(g, co, kernels, TUNING)
        assert plan.algorithm == want, (kernels, plan.algorithm)
        assert plan.geometry == g
        assert plan.run == (ConvGeometry(**{**vars(g), "sh": 1, "sw": 1}) if want == "direct_stride2" else g)


def test_the_registry_is_the_one_list_of_algorithms():
    """Every entry names its eligibility, threshold rule, run geometry, forward, backward and cost; the
    plan's names are the registry's, in its order; im2col + GEMM, last, takes any layer."""
    names = [a.name for a in REGISTRY]
    assert len(set(names)) == len(names) and conv_plan.ALGORITHMS == tuple(names) and list(BY_NAME) == names
    for a in REGISTRY:
        for part in (a.eligible, a.preferred, a.run_geometry, a.forward, a.backward, a.cost):
            assert callable(part), (a.name, part)
    assert names[-1] == "gemm"
    assert all(REGISTRY[-1].eligible(g, co, k, TUNING) for g, co, *_ in CHOICES.values() for k in ("numba", "numpy"))
    assert not any(BY_NAME["winograd"].preferred(g, co, TUNING) for g, co, *_ in CHOICES.values())


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_candidates_are_the_eligible_entries_threshold_choice_first(kernels):
    for name, (g, co, *_) in CHOICES.items():
        found = autotune.candidates(g, co, kernels, TUNING)
        assert found[0] == conv_plan.choose(g, co, kernels, TUNING).algorithm, name
        assert sorted(found) == sorted(a.name for a in REGISTRY if a.eligible(g, co, kernels, TUNING)), name


@pytest.mark.parametrize("name", list(CHOICES))
def test_every_eligible_entry_has_a_cost_in_a_kernel_class(name):
    """cost() of each entry that computes the layer: a known kernel class and (FLOPs, bytes) per phase;
    forward and backward_weights do at least the multiply-adds of the geometry it runs (Winograd: / 2.25),
    and forward reads x."""
    g, co, *_ = CHOICES[name]
    for a in (a for a in REGISTRY if a.eligible(g, co, "numba", TUNING)):
        kernel_class, fwd, bwd_d, bwd_w = a.cost(g, co, 4, 4, TUNING, "numba", True)
        assert kernel_class in KERNEL_CLASSES, (a.name, kernel_class)
        run = a.run_geometry(g)
        least = 2 * 4 * co * run.ho * run.wo * (g.c // g.groups) * g.kh * g.kw
        least = int(least / 2.25) if a.name == "winograd" else least
        assert all(isinstance(v, int) and v > 0 for v in (*fwd, *bwd_d, *bwd_w)), (a.name, fwd, bwd_d, bwd_w)
        assert fwd[0] >= least and bwd_w[0] >= least and fwd[1] >= 4 * 4 * g.c * g.h * g.w, a.name


@pytest.mark.parametrize("algorithm", [a.name for a in REGISTRY])
def test_backend_and_perfmodel_take_the_plans_entry(algorithm):
    """A layer planned with any algorithm computes what im2col + GEMM computes through its entry, and the
    performance model costs it with that entry's cost."""
    g, co = {"direct_stride2": (geom(8, 9, 3, s=2, p=1, groups=8), 8), "depthwise": (geom(8, 9, 3, p=1, groups=8), 8),
             "pointwise": (geom(8, 12, 1), 8)}.get(algorithm, (geom(8, 9, 3, p=1), 8))
    backend = CPUBackend(np.float64, kernels="numba")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, g.c, g.h, g.w))
    w = rng.standard_normal((co, g.c // g.groups, g.kh, g.kw))
    dy = rng.standard_normal((2, co, g.ho, g.wo))
    got = {}
    for a in (algorithm, "gemm"):
        y, ctx = backend.conv2d_forward(x, w, conv_plan.plan_for(g, a))
        got[a] = (y, *backend.conv2d_backward(dy, w, ctx, conv_plan.plan_for(g, a)))
    for want, have in zip(got["gemm"], got[algorithm]):
        np.testing.assert_allclose(have, want, rtol=1e-10, atol=1e-10)

    layer = Conv2D(co, g.kh, stride=g.sh, padding=g.pt, groups=g.groups, use_bias=False)
    model = Model([layer], (g.c, g.h, g.w), backend)
    layer.plan = conv_plan.plan_for(g, algorithm)
    cost = next(c for c in layer_costs(model, 3) if c.kind == "Conv2D")
    kernel_class, fwd, _, bwd_w = BY_NAME[algorithm].cost(g, co, 3, 8, backend.tuning, "numba", False)
    assert (cost.algorithm, cost.kernel_class) == (algorithm, kernel_class)
    assert (cost.forward.flops, cost.forward.bytes) == fwd
    assert cost.backward_weights.flops == bwd_w[0] and cost.backward_weights.bytes == bwd_w[1] + 2 * w.nbytes


# -- the one reading of the CPU ------------------------------------------------------------------------------
def test_cpu_features_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test  CPU @ 2.0GHz\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: avx512f\n")
    assert isa.cpu_features(str(info)) == ("Test CPU @ 2.0GHz", frozenset({"fpu", "sse2", "avx", "avx2", "fma"}))
    assert isa.cpu_features(str(tmp_path / "missing")) == ("unknown", frozenset())


@pytest.mark.parametrize("flags,bits,name", [({"avx512f", "avx2", "fma"}, 512, "avx512f"),
                                             ({"avx2", "fma"}, 256, "avx2"),
                                             ({"avx2"}, 128, "avx2"),  # no FMA: portable kernels, same cache key
                                             ({"sse2", "avx"}, 128, "other")])
def test_the_vector_width_and_the_cache_key_read_the_same_features(monkeypatch, flags, bits, name):
    """native_bits (the kernels), autotune.cpu_info, describe_cpu and the cache key all take isa.cpu_features;
    the key keeps its ISA names ('avx512f', 'avx2', 'other'), so caches written before stay valid."""
    monkeypatch.setattr(isa, "cpu_features", lambda path="/proc/cpuinfo": ("Test CPU", frozenset(flags)))
    assert isa.native_bits() == bits and isa.isa_name() == name
    assert autotune.cpu_info() == ("Test CPU", name)
    assert autotune.describe_cpu().startswith(f"Test CPU ({name}; kernels: ")
    key = autotune.key(geom(8, 8, 3, p=1), 8, np.float32, 1, "numba", 32, bits=256)
    assert key.startswith(f"Test CPU | {name} 256-bit | 1 threads | float32 | numba | batch 32 | ")
