"""The CPU backend's kernel paths, each against PyTorch and float64 finite differences.

Pooling picks a path per geometry (windows that tile the input exactly, disjoint windows that
leave rows out, overlapping windows, padding); convolution picks one per shape (depthwise direct,
stride-1 dx as a convolution of dy, strided dx by scatter-add, 1x1, and the compiled direct 3x3
kernel). Every path is exercised here; the convolution tests run once with the compiled kernels and
once with the NumPy path alone (PYDTNN_CPU_KERNELS).
"""

import ctypes
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pydtnn import runtime
from pydtnn.backends.cpu import CPUBackend, Tuning, conv_direct, conv_gemm, pooling
from pydtnn.backends.cpu import threads as th
from pydtnn.backends.cpu import tuning as tuning_module
from pydtnn.backends.cpu.conv_plan import ConvPlan
from pydtnn.backends.cpu.conv_pointwise import pointwise_ok
from pydtnn.backends.geometry import ConvGeometry, window_layout
from pydtnn.layers import AvgPool2D, Conv2D, MaxPool2D
from pydtnn.testing import check_against_torch, check_gradients


def both_checks(make, x_shape, torch_fn, tuning=None):
    """check_gradients in float64, check_against_torch in float64 and float32; with tuning given, each
    layer built on a CPUBackend of that Tuning (else the helpers' own backend, tuning.DEFAULT)."""

    def built(dtype):
        layer = make()
        if tuning is not None:
            layer.build(x_shape[1:], dtype, CPUBackend(dtype, seed=0, tuning=tuning))
        return layer

    check_gradients(built(np.float64), x_shape)
    for dtype in (np.float64, np.float32):
        check_against_torch(built(dtype), x_shape, torch_fn, dtype=dtype)


@contextmanager
def thread_count(n):
    """Split kernels over n threads (process-wide), then back to the count before."""
    before = th.threads()
    th.set_threads(n)
    try:
        yield
    finally:
        th.set_threads(before)


def algorithm(backend, g, co):
    """The convolution algorithm backend plans for geometry g with co output channels."""
    return backend.conv2d_plan(g, (co, g.c // g.groups, g.kh, g.kw)).algorithm


# -- pooling -------------------------------------------------------------------------------
POOL_CASES = [
    # (x_shape, pool, stride, padding, layout (disjoint, covering))
    ((2, 3, 8, 8), 2, 2, 0, (True, True)),  # 2x2 stride 2: the compiled kernels
    ((2, 3, 9, 7), 2, 2, 0, (True, False)),  # the same, odd height and width: a row and column left over
    ((2, 3, 9, 7), 3, 3, 0, (True, False)),  # rows and columns left over
    ((2, 2, 9, 9), 2, 3, 0, (True, False)),  # stride > window: gaps
    ((2, 2, 6, 8), (2, 4), (2, 4), 0, (True, True)),
    ((2, 2, 8, 8), 2, 2, 1, (True, False)),  # padding
    ((2, 2, 7, 7), 3, 2, 1, (False, False)),
    ((2, 2, 6, 6), 3, 1, 0, (False, False)),
]


@pytest.mark.parametrize("x_shape,k,s,p,layout", POOL_CASES)
def test_maxpool_paths(x_shape, k, s, p, layout, kernels):
    layer = MaxPool2D(k, stride=s, padding=p)
    layer.build(x_shape[1:])
    assert window_layout(layer.geometry) == layout
    both_checks(lambda: MaxPool2D(k, stride=s, padding=p), x_shape, lambda x, _: F.max_pool2d(x, k, s, p))


@pytest.mark.parametrize("x_shape,k,s,p,layout", POOL_CASES)
def test_avgpool_paths(x_shape, k, s, p, layout, kernels):
    both_checks(lambda: AvgPool2D(k, stride=s, padding=p), x_shape, lambda x, _: F.avg_pool2d(x, k, s, p))


@pytest.mark.parametrize("x_shape,k,s,p", [((2, 2, 9, 9), 2, 2, 0), ((2, 2, 8, 8), 3, 2, 1), ((1, 2, 7, 7), 3, 3, 0)])
def test_maxpool_ceil_mode_paths(x_shape, k, s, p):
    both_checks(
        lambda: MaxPool2D(k, stride=s, padding=p, ceil_mode=True),
        x_shape,
        lambda x, _: F.max_pool2d(x, k, s, p, ceil_mode=True),
    )


@pytest.mark.parametrize("k,s", [(2, 2), (3, 1), (3, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maxpool_ties_route_to_first_maximum_like_torch(k, s, dtype):
    # after a ReLU most windows hold several equal zeros: the gradient must go to the first one only
    rng = np.random.default_rng(1)
    x = np.maximum(rng.integers(-3, 2, size=(2, 3, 9, 9)), 0).astype(dtype)
    dy_shape = (2, 3, (9 - k) // s + 1, (9 - k) // s + 1)
    dy = rng.standard_normal(dy_shape).astype(dtype)
    layer = MaxPool2D(k, stride=s)
    layer.build(x.shape[1:], dtype)
    y = layer.forward(x)
    dx = layer.backward(dy)
    tx = torch.tensor(x, requires_grad=True)
    ty = F.max_pool2d(tx, k, s)
    ty.backward(torch.tensor(dy))
    np.testing.assert_array_equal(y, ty.detach().numpy())
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 3, 9, 7), (5, 1, 33, 17), (1, 2, 2, 3)])
def test_maxpool2x2_compiled_kernels_match_the_numpy_path_bit_for_bit(shape, dtype):
    """The compiled 2x2 kernels against the NumPy passes: ties (a ReLU's zeros, 0.0 against -0.0),
    NaN and infinities in x, NaN and infinities in dy; y, the argmax and dx compared as bits."""
    fast, ref = CPUBackend(kernels="numba"), CPUBackend(kernels="numpy")
    _, c, h, w = shape
    g = ConvGeometry(c, h, w, 2, 2, 2, 2)
    assert pooling.compiled_2x2(fast, g) and not pooling.compiled_2x2(ref, g)
    rng = np.random.default_rng(0)
    x = np.maximum(rng.integers(-3, 3, size=shape), 0).astype(dtype)
    x.flat[::13], x.flat[5::17], x.flat[7::19], x.flat[2::23] = np.nan, -np.inf, np.inf, -0.0
    bits = np.dtype(f"i{x.itemsize}")
    y, idx = fast.maxpool2d_forward(x, g)
    y_ref, idx_ref = ref.maxpool2d_forward(x, g)
    np.testing.assert_array_equal(y.view(bits), y_ref.view(bits))
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_array_equal(fast.maxpool2d_forward(x, g, keep=False)[0].view(bits), y.view(bits))
    dy = rng.standard_normal(y.shape).astype(dtype)
    dy.flat[::5], dy.flat[1::7] = np.nan, -np.inf
    dx = fast.maxpool2d_backward(dy, idx, g)
    np.testing.assert_array_equal(dx.view(bits), ref.maxpool2d_backward(dy, idx_ref, g).view(bits))
    # PyTorch's scatter: each dy at its window's first maximum, exactly +0.0 everywhere else
    want = np.zeros_like(x)
    for i in range(y.shape[2]):
        for j in range(y.shape[3]):
            k = idx[:, :, i, j]
            want[:, :, 2 * i, 2 * j][k == 0] = dy[:, :, i, j][k == 0]
            want[:, :, 2 * i, 2 * j + 1][k == 1] = dy[:, :, i, j][k == 1]
            want[:, :, 2 * i + 1, 2 * j][k == 2] = dy[:, :, i, j][k == 2]
            want[:, :, 2 * i + 1, 2 * j + 1][k == 3] = dy[:, :, i, j][k == 3]
    np.testing.assert_array_equal(dx.view(bits), want.view(bits))


MAXPOOL_WINDOWS = [  # (kh, kw, sh, sw, dh, dw, pt, pb, pl, pr)
    (3, 3, 1, 1, 1, 1, 1, 1, 1, 1),  # Inception's: overlapping, padded
    (3, 3, 2, 2, 1, 1, 1, 1, 1, 1),  # ResNet's stem
    (3, 3, 2, 2, 1, 1, 0, 1, 0, 1),  # ceil mode: an extra row and column of padding at the end
    (2, 3, 2, 1, 1, 1, 0, 0, 0, 0),  # rectangular
    (3, 2, 1, 2, 2, 1, 2, 2, 0, 1),  # dilated, uneven padding
    (2, 2, 1, 1, 1, 1, 1, 1, 1, 1),  # 2x2 at stride 1: windows of padding and one corner
    (2, 2, 2, 2, 1, 1, 1, 1, 1, 1),  # 2x2 at stride 2, padded: not the 2x2 kernels' case
    (1, 1, 1, 1, 1, 1, 0, 0, 0, 0),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("window", MAXPOOL_WINDOWS)
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 3, 9, 7), (2, 2, 2, 3)])
def test_maxpool_compiled_kernels_match_the_numpy_path_bit_for_bit(shape, window, dtype):
    """The generic compiled max pooling against the NumPy passes, every window shape the zoo uses and
    more: ties (a ReLU's zeros, 0.0 against -0.0), NaN and infinities in x and dy, windows that hold
    padding with -inf or NaN; y, the argmax and dx compared as bits (dx sums where windows overlap)."""
    fast, ref = CPUBackend(kernels="numba"), CPUBackend(kernels="numpy")
    _, c, h, w = shape
    g = ConvGeometry(c, h, w, *window)
    if g.ho < 1 or g.wo < 1:
        pytest.skip("no output")
    assert not pooling.compiled_2x2(fast, g)
    rng = np.random.default_rng(0)
    x = np.maximum(rng.integers(-3, 3, size=shape), 0).astype(dtype)
    x.flat[::13], x.flat[5::17], x.flat[7::19], x.flat[2::23] = np.nan, -np.inf, np.inf, -0.0
    x[-1, -1, 0, 0] = -np.inf  # a corner window of padding and -inf
    bits = np.dtype(f"i{x.itemsize}")
    y, idx = fast.maxpool2d_forward(x, g)
    y_ref, idx_ref = ref.maxpool2d_forward(x, g)
    np.testing.assert_array_equal(y.view(bits), y_ref.view(bits))
    np.testing.assert_array_equal(idx, idx_ref)
    assert idx.dtype == idx_ref.dtype
    np.testing.assert_array_equal(fast.maxpool2d_forward(x, g, keep=False)[0].view(bits), y.view(bits))
    dy = rng.standard_normal(y.shape).astype(dtype)
    dy.flat[::5], dy.flat[1::7], dy.flat[3::11] = np.nan, -np.inf, -0.0
    dx = fast.maxpool2d_backward(dy, idx, g)
    np.testing.assert_array_equal(dx.view(bits), ref.maxpool2d_backward(dy, idx_ref, g).view(bits))
    # dx adds up dy where windows overlap: against a float64 sum of the routed dy
    want = np.zeros(x.shape)
    for oi in range(g.ho):
        for oj in range(g.wo):
            i, j = np.divmod(idx[:, :, oi, oj].astype(np.int64), g.kw)
            r, q = oi * g.sh - g.pt + i * g.dh, oj * g.sw - g.pl + j * g.dw
            inside = (r >= 0) & (r < h) & (q >= 0) & (q < w)
            for s_, c_ in zip(*np.nonzero(inside)):
                want[s_, c_, r[s_, c_], q[s_, c_]] += dy[s_, c_, oi, oj]
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("window", [(2, 2, 2, 2), (3, 3, 1, 1, 1, 1, 1, 1, 1, 1)])
def test_compiled_maxpool_refuses_arrays_of_another_shape(window):
    """The compiled kernels do not check bounds: an input or gradient of another shape than the layer's
    would be read and written past its end; it is refused, as the NumPy path refuses it."""
    from pydtnn.errors import ShapeError

    b, g = CPUBackend(kernels="numba"), ConvGeometry(3, 8, 8, *window)
    with pytest.raises(ShapeError, match=r"x of shape \(4, 48, 8, 8\); this layer takes \(N, 3, 8, 8\)"):
        b.maxpool2d_forward(np.zeros((4, 48, 8, 8), np.float32), g)
    y, idx = b.maxpool2d_forward(np.zeros((4, 3, 8, 8), np.float32), g)
    with pytest.raises(ShapeError, match="dy of shape"):
        b.maxpool2d_backward(np.zeros((4, 3, g.ho + 1, g.wo), np.float32), idx, g)
    with pytest.raises(ShapeError, match="argmax of a forward of"):
        b.maxpool2d_backward(np.zeros((8, 3, g.ho, g.wo), np.float32), idx, g)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 3, 9, 7), (1, 2, 2, 3)])
def test_avgpool2x2_compiled_kernels_match_the_numpy_path_bit_for_bit(shape, dtype):
    fast, ref = CPUBackend(kernels="numba"), CPUBackend(kernels="numpy")
    _, c, h, w = shape
    g = ConvGeometry(c, h, w, 2, 2, 2, 2)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[::11], x.flat[3::13] = np.nan, np.inf
    bits = np.dtype(f"i{x.itemsize}")
    y = fast.avgpool2d_forward(x, g)[0]
    np.testing.assert_array_equal(y.view(bits), ref.avgpool2d_forward(x, g)[0].view(bits))
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = fast.avgpool2d_backward(dy, None, g)
    np.testing.assert_array_equal(dx.view(bits), ref.avgpool2d_backward(dy, None, g).view(bits))


def test_maxpool_with_nan_dy_routes_it_like_torch(kernels):
    """A NaN or infinite gradient reaches the window's maximum only; the other inputs get 0."""
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6))
    for k, s in ((2, 2), (3, 2), (3, 1)):
        layer = MaxPool2D(k, stride=s)
        layer.build(x.shape[1:], np.float64)
        y = layer.forward(x)
        dy = np.ones_like(y)
        dy.flat[::3], dy.flat[1::4] = np.nan, np.inf
        tx = torch.tensor(x, requires_grad=True)
        F.max_pool2d(tx, k, s).backward(torch.tensor(dy))
        np.testing.assert_array_equal(layer.backward(dy), tx.grad.numpy())


def test_maxpool_forward_without_keep_gives_the_same_output():
    backend, g = CPUBackend(), ConvGeometry(3, 7, 7, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1)
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 7)).astype(np.float32)
    y_keep, idx = backend.maxpool2d_forward(x, g)
    y_eval, none = backend.maxpool2d_forward(x, g, keep=False)
    np.testing.assert_array_equal(y_keep, y_eval)
    assert none is None and idx.dtype == np.uint8


# -- convolution ---------------------------------------------------------------------------
CONV_CASES = [
    # (x_shape, filters, kwargs): which path each takes is in the comment
    ((2, 4, 8, 8), 4, {"kernel_size": 3, "groups": 4, "padding": 1}),  # depthwise, stride 1
    ((2, 4, 9, 9), 4, {"kernel_size": 3, "groups": 4, "stride": 2, "padding": 1}),  # depthwise, stride 2
    ((2, 3, 8, 9), 3, {"kernel_size": 3, "groups": 3, "stride": 2}),  # depthwise, stride 2, no padding
    ((2, 4, 10, 7), 4, {"kernel_size": 3, "groups": 4, "stride": 2, "padding": (1, 0)}),  # uneven padding
    ((2, 3, 9, 8), 3, {"kernel_size": 3, "groups": 3, "stride": 3}),  # depthwise, stride 3, no padding
    ((2, 4, 9, 9), 4, {"kernel_size": 3, "groups": 4, "dilation": 2, "padding": 2}),  # depthwise, dilated
    ((2, 3, 7, 7), 6, {"kernel_size": 3, "groups": 3, "padding": 1}),  # depthwise, channel multiplier 2
    ((2, 2, 8, 7), 4, {"kernel_size": (3, 2), "groups": 2, "stride": 2, "padding": (1, 0)}),  # multiplier 2, stride 2
    (
        (2, 3, 8, 8),
        3,
        {"kernel_size": 3, "groups": 3, "stride": (2, 1), "padding": 1},
    ),  # depthwise, uneven stride: GEMM
    ((2, 4, 8, 8), 3, {"kernel_size": 4, "groups": 1, "padding": "same"}),  # asymmetric padding
    ((2, 3, 9, 9), 5, {"kernel_size": 3, "stride": 2, "padding": 1}),  # one group, stride 2: col2im
    ((2, 2, 8, 7), 3, {"kernel_size": 3, "stride": 2}),  # stride 2, no padding
    ((2, 6, 7, 7), 4, {"kernel_size": 3, "groups": 2, "padding": 1}),  # grouped, stride 1
    ((2, 6, 9, 9), 4, {"kernel_size": 3, "groups": 2, "stride": 2, "padding": 1}),  # grouped, strided
    ((2, 4, 6, 6), 6, {"kernel_size": 1}),  # 1x1: dx is one GEMM
    ((7, 4, 3, 3), 6, {"kernel_size": 1}),  # 1x1 on 9 pixels: dx in blocks of samples (5 + 2 at 40 columns)
    ((2, 4, 7, 7), 6, {"kernel_size": 1, "stride": 2}),  # 1x1 strided: scatter path
    ((2, 3, 6, 6), 4, {"kernel_size": 1, "padding": 1}),  # 1x1 padded: transposed padding is a crop
    ((2, 3, 6, 6), 4, {"kernel_size": 3, "padding": 3}),  # padding beyond k-1: transposed crop
    ((2, 3, 8, 8), 5, {"kernel_size": 3, "dilation": (2, 1), "padding": (1, 2)}),
    ((1, 2, 5, 5), 3, {"kernel_size": 5}),  # kernel as large as the input: dx by W^T dy and col2im
    ((3, 2, 6, 6), 4, {"kernel_size": 5}),  # 2x2 output from 6x6 (9x the pixels): W^T dy in blocks of samples
    ((3, 3, 5, 4), 4, {"kernel_size": 3, "padding": 1}),  # 20 pixels: 2-sample GEMM blocks at 40 columns
    ((2, 3, 7, 9), 5, {"kernel_size": 3, "padding": 1}),  # direct 3x3 (compiled)
    ((2, 2, 6, 5), 3, {"kernel_size": 3}),  # direct, no padding: dx padded by 2
    ((2, 2, 6, 6), 3, {"kernel_size": 3, "padding": (2, 0)}),  # direct, padding up to the kernel's reach
    ((2, 3, 9, 9), 2, {"kernel_size": 3, "dilation": (2, 1), "padding": (2, 1)}),  # direct, dilated
]


def torch_conv(kwargs):
    stride, dilation, groups = kwargs.get("stride", 1), kwargs.get("dilation", 1), kwargs.get("groups", 1)
    padding = kwargs.get("padding", 0)
    return lambda x, p: F.conv2d(x, p["weight"], p.get("bias"), stride, padding, dilation, groups)


@pytest.mark.parametrize("gemm_columns", [1, 40, 10000])
@pytest.mark.parametrize("x_shape,filters,kwargs", CONV_CASES)
def test_conv_paths(x_shape, filters, kwargs, kernels, gemm_columns):
    """gemm_columns 1: one GEMM per sample, written into NCHW; 40: samples share a GEMM, blocks of
    2 to 40 samples (with the batch of 3 below: a full block and a short one), then reordered, and
    where one block holds the whole batch, the GEMM in two halves of its rows; 10000: always so."""
    # row_step 1: the small layers here have 2 to 6 output rows to halve; tuning.DEFAULT as the kernels
    # fixture set it (the direct kernels at any width, the compiled bias at any size)
    tuning = replace(tuning_module.DEFAULT, gemm_min_columns=gemm_columns, row_step=1)
    both_checks(lambda: Conv2D(filters, **kwargs), x_shape, torch_conv(kwargs), tuning=tuning)


@pytest.mark.parametrize("kwargs", [{"kernel_size": 3, "padding": 1}, {"kernel_size": 3, "groups": 4, "padding": 1}])
def test_conv_first_layer_skips_dx(kwargs, kernels):
    layer = Conv2D(4, **kwargs)
    layer.build((4, 6, 6), np.float64)
    layer.need_dx = False
    check_gradients(layer, (2, 4, 6, 6))
    assert layer.backward(np.ones((2, 4, 6, 6))) is None


DIRECT_CASES = [
    # (N, C, Co, H, W, (pt, pb, pl, pr), (dh, dw), groups): widths that leave vector remainders, every padding
    (3, 5, 7, 11, 13, (1, 1, 1, 1), (1, 1), 1),
    (2, 16, 16, 8, 8, (1, 1, 1, 1), (1, 1), 1),
    (2, 3, 4, 9, 6, (0, 0, 0, 0), (1, 1), 1),
    (2, 4, 3, 7, 7, (2, 0, 1, 2), (1, 1), 1),
    (2, 4, 6, 12, 10, (2, 2, 1, 1), (2, 1), 1),
    (1, 2, 2, 3, 3, (1, 1, 1, 1), (1, 1), 1),
    (3, 19, 10, 8, 16, (1, 1, 1, 1), (1, 1), 1),  # output channels not a multiple of the block of 4
    (3, 6, 6, 9, 11, (1, 1, 1, 1), (1, 1), 6),  # depthwise
    (2, 5, 5, 10, 7, (0, 2, 2, 1), (1, 2), 5),  # depthwise, uneven padding, dilated
]


@pytest.mark.parametrize("case", DIRECT_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20])
def test_direct_kernel_matches_the_numpy_path(case, dtype, chunk_bytes):
    """The compiled direct 3x3 convolution and im2col + GEMM give the same y, dx and dw (up to rounding:
    they add in different orders). chunk_bytes 1: the weight gradient sums one sample at a time."""
    tuning = Tuning(direct_min_width=1, direct_chunk_bytes=chunk_bytes)
    n, c, co, h, w, pads, (dh, dw), groups = case
    g = ConvGeometry(c, h, w, 3, 3, 1, 1, dh, dw, *pads, groups=groups)
    fast = CPUBackend(dtype, kernels="numba", tuning=tuning)
    ref = CPUBackend(dtype, kernels="numpy", tuning=tuning)
    assert algorithm(fast, g, co) == "direct" and algorithm(ref, g, co) != "direct"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((co, c // groups, 3, 3)).astype(dtype)
    dy = rng.standard_normal((n, co, g.ho, g.wo)).astype(dtype)
    assert_same_convolution(fast, ref, x, wt, dy, g, dtype)


def assert_same_convolution(fast, ref, x, wt, dy, g, dtype):
    """y, dx and dw of one convolution on two backends agree to float32's or float64's tolerance."""
    got, want = [], []
    for be, out in ((fast, got), (ref, want)):
        y, ctx = be.conv2d_forward(x, wt, g)
        out += [y, *be.conv2d_backward(dy, wt, ctx, g)]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("o,c,groups,k", [(40, 24, 1, 3), (12, 8, 2, 3), (8, 6, 2, 5), (4, 3, 1, 1), (6, 40, 1, 3)])
def test_flipped_weights_compiled_match_numpy(o, c, groups, k):
    """The compiled copy of dx's weights (per group transposed, both kernel axes reversed) gives
    NumPy's, split over threads or not."""
    tuning = Tuning(flip_compiled_min_bytes=0, split_min_bytes=0)
    w = np.random.default_rng(0).standard_normal((o, c // groups, k, k)).astype(np.float32)
    g = ConvGeometry(c, 8, 8, k, k, groups=groups)
    want = conv_gemm.flipped(CPUBackend(kernels="numpy", tuning=tuning), w, groups, g)
    assert want.shape == (groups, c // groups, o // groups * k * k)
    for threads in (1, 3):
        with thread_count(threads):
            got = conv_gemm.flipped(CPUBackend(kernels="numba", tuning=tuning), w, groups, g)
        np.testing.assert_array_equal(got, want)
        assert np.shares_memory(got, w) == (k == 1)  # 1x1: a transposed view, never a copy


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "x_shape,k,s,p,d",
    [
        ((2, 3, 32, 32), 3, 2, 1, 1),  # ResNet's stride-2 3x3: whole vectors both ways
        ((2, 2, 33, 37), 3, 2, 1, 1),  # odd width: the last column from one phase alone
        ((2, 2, 17, 40), 1, 2, 0, 1),  # 1x1 stride 2: odd columns never written but zeroed
        ((2, 2, 25, 50), 3, (2, 3), 1, 1),  # stride 3 across: three phases
        ((2, 2, 40, 41), 3, 2, 2, 2),  # dilated, padding beyond one phase's shift
        ((1, 2, 20, 36), 5, 2, 2, 1),
        ((1, 2, 11, 11), 2, 2, 0, 1),  # rows shorter than a vector
    ],
)
def test_col2im_compiled_matches_the_numpy_path_bit_for_bit(x_shape, k, s, p, d, dtype):
    """A strided convolution's dx: the compiled col2im (phase-split rows, vector adds, interleaved
    at the end) adds each position's share in the NumPy path's order, so the bits are its bits,
    signed zeros included."""
    tuning = Tuning(split_min_bytes=1 << 40)  # one chunk: the two paths take the same GEMM
    n, c, h, w = x_shape
    sh, sw = s if isinstance(s, tuple) else (s, s)
    g = ConvGeometry(c, h, w, k, k, sh=sh, sw=sw, pt=p, pb=p, pl=p, pr=p, dh=d, dw=d)
    rng = np.random.default_rng(5)
    co = 3
    wts = rng.standard_normal((co, c, k, k)).astype(dtype)
    dyk = rng.standard_normal((1, co, n, g.ho * g.wo)).astype(dtype)
    dyk[0, :, 0, :3] = -0.0  # a sample whose first pixels get only negative zeros
    wts[:, 0] = np.where(wts[:, 0] > 0, 0.0, -0.0)
    got = conv_gemm.strided_data_grad(CPUBackend(dtype, kernels="numba", tuning=tuning), dyk, wts, g)
    want = conv_gemm.strided_data_grad(CPUBackend(dtype, kernels="numpy", tuning=tuning), dyk, wts, g)
    assert got.shape == (n, c, h, w)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def test_conv_bias_compiled_kernels_match_numpy(monkeypatch):
    """The compiled bias add gives NumPy's bits; the compiled float32 sum (float64 partial sums) is
    within 1 ulp of the exact sum on zero-mean gradients, where NumPy's float32 sum is not better.
    float64 sums, non-contiguous outputs, small arrays keep NumPy's path; an empty batch works."""
    rng = np.random.default_rng(3)
    dy = rng.standard_normal((9, 5, 7, 6)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    tuning = Tuning(bias_compiled_min_bytes=0)
    fast, ref = CPUBackend(kernels="numba", tuning=tuning), CPUBackend(kernels="numpy", tuning=tuning)
    y, y_ref = dy.copy(), dy.copy()
    fast.bias_forward(y, b)
    ref.bias_forward(y_ref, b)
    np.testing.assert_array_equal(y, y_ref)
    db = np.empty_like(b)
    fast.bias_backward(dy, db)
    exact = dy.astype(np.float64).sum(axis=(0, 2, 3))
    np.testing.assert_array_less(np.abs(db - exact), np.spacing(np.abs(exact).astype(np.float32)) * 1.0001)
    # an empty batch, and a transposed (non-contiguous) y: the add lands in y itself
    fast.bias_forward(np.empty((0, 5, 7, 6), np.float32), b)
    fast.bias_backward(np.empty((0, 5, 7, 6), np.float32), db)
    np.testing.assert_array_equal(db, 0)
    yt = np.zeros((6, 7, 5, 9), np.float32).transpose(3, 2, 1, 0)
    fast.bias_forward(yt, b)
    np.testing.assert_array_equal(yt[0, :, 0, 0], b)
    calls = []
    monkeypatch.setattr(CPUBackend, "split_compiled", lambda *a, **k: calls.append(a))
    dy64 = dy.astype(np.float64)
    fast.bias_backward(dy64, np.empty(5))  # float64: NumPy's pairwise sum
    small = CPUBackend(kernels="numba", tuning=Tuning(bias_compiled_min_bytes=dy.nbytes + 1))
    small.bias_forward(y, b)
    small.bias_backward(dy, db)
    assert calls == []
    fast.bias_backward(dy, db)  # the counter counts: the compiled path goes through it
    assert len(calls) == 1


@pytest.mark.parametrize("itemsize", [4, 8])
def test_dense_layout_covers_the_wide_grid_in_blocks_of_three_vectors_then_two(itemsize):
    """Every output size: the computed columns cover Ho*Wp with less than one vector to spare (at
    least two vectors), as blocks of three vectors and then at most two blocks of two, and lx holds
    them plus the taps' reach."""
    from pydtnn.backends.cpu.isa import VECTOR_BYTES

    lanes = VECTOR_BYTES // itemsize
    rests = set()
    for ho in range(1, 20):
        for wo in range(1, 40):
            for dh, dw in ((1, 1), (2, 1)):
                wp, cols = wo + 2 * dw, ho * (wo + 2 * dw)
                threes, length, lx, tail = conv_direct.dense_layout(ho, wo, dh, dw, itemsize)
                rest = length - threes * 3 * lanes
                assert threes >= 0 and rest in (0, 2 * lanes, 4 * lanes), (ho, wo, threes, length)
                assert length >= cols and (length - cols < lanes or length == 2 * lanes), (ho, wo, length)
                reach = 2 * dh * wp + 2 * dw
                assert lx % lanes == 0 and length + reach <= lx < length + reach + lanes
                assert tail % lanes == 0 and reach <= tail < reach + lanes
                rests.add(rest // lanes)
    assert rests == {0, 2, 4}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_size": 3, "padding": 1},  # register-blocked direct (compiled) or im2col
        {"kernel_size": 3, "padding": 1, "groups": 8},  # depthwise
        {"kernel_size": 3, "stride": 2, "padding": 1},  # im2col, col2im
        {"kernel_size": 1},  # 1x1 on x as it lies
    ],
)
def test_convolution_takes_float64_arrays_in_its_own_dtype(kwargs, kernels):
    """A float32 layer given float64 x and dy returns what it returns for them rounded to float32, in
    float32: the compiled kernels read every array as the weight's dtype."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8, 12, 12))
    layer = Conv2D(8, use_bias=False, **kwargs)
    layer.build(x.shape[1:], np.float32)
    dy = rng.standard_normal((3, *layer.output_shape))
    y64, dx64 = layer.forward(x), layer.backward(dy)
    dw64 = layer.grads["weight"].copy()
    y32, dx32 = layer.forward(x.astype(np.float32)), layer.backward(dy.astype(np.float32))
    assert y64.dtype == dx64.dtype == np.float32
    np.testing.assert_array_equal(y64, y32)
    np.testing.assert_array_equal(dx64, dx32)
    np.testing.assert_array_equal(dw64, layer.grads["weight"])


def test_vector_intrinsics_refuse_arrays_of_two_dtypes():
    """They load and store through vectors of the first array's element type: float64 memory read as
    float32 would be garbage, so a mixed call must fail to compile."""
    import numba

    from pydtnn.backends.cpu.kernels import vectors

    with pytest.raises(numba.core.errors.TypingError):
        vectors.copy(np.zeros(16, np.float32), 0, np.zeros(16), 0, 16)
    dst = np.zeros(16, np.float32)
    vectors.copy(dst, 0, np.arange(16, dtype=np.float32), 0, 16)
    np.testing.assert_array_equal(dst, np.arange(16))


def test_direct_kernel_is_chosen_only_where_it_applies():
    fast, ref = CPUBackend(kernels="numba"), CPUBackend(kernels="numpy")

    def geom(**kw):
        base = {"c": 16, "h": 8, "w": 8, "kh": 3, "kw": 3, "pt": 1, "pb": 1, "pl": 1, "pr": 1}
        return ConvGeometry(**{**base, **kw})

    def direct(b, g, co):
        return algorithm(b, g, co) == "direct"

    assert direct(fast, geom(), 16) and direct(fast, geom(pt=0, pb=2), 16)
    assert direct(fast, geom(c=128), 256) and direct(fast, geom(c=3, h=32, w=32), 16)
    assert direct(fast, geom(c=512, h=16, w=16), 512)  # many channels: from 16 wide
    assert direct(fast, geom(groups=16), 16) and direct(fast, geom(c=512, groups=512), 512)  # depthwise
    assert direct(fast, geom(c=64, h=4, w=4, groups=64), 64)  # depthwise: any width
    # stride-2 depthwise: the stride-1 kernels, every other output kept
    g2 = geom(sh=2, sw=2, groups=16)
    assert fast.conv2d_plan(g2, (16, 1, 3, 3)) == ConvPlan(g2, "direct_stride2", geom(groups=16))
    assert algorithm(fast, geom(sh=2, sw=2, groups=16), 32) != "direct_stride2"  # channel multiplier
    assert algorithm(fast, geom(sh=2, sw=1, groups=16), 16) != "direct_stride2"  # uneven stride
    assert algorithm(fast, geom(sh=2, sw=2), 16) != "direct_stride2"  # one group
    assert algorithm(ref, geom(sh=2, sw=2, groups=16), 16) != "direct_stride2"
    assert not direct(ref, geom(), 16) and not direct(ref, geom(groups=16), 16)
    for g, co in (
        (geom(sh=2, sw=2, h=16, w=16), 16),  # strided (8 outputs wide)
        (geom(kh=5, kw=5), 16),  # not 3x3
        (geom(groups=2), 16),  # grouped
        (geom(groups=16), 32),  # depthwise with a channel multiplier
        (geom(pt=3), 16),  # padding beyond the kernel's reach: dx would need a crop
        (geom(h=4, w=4), 16),  # narrow images: GEMM is faster
        (geom(w=7), 16),
        (geom(c=256), 256),  # many channels, under 16 wide: GEMM's weight gradient is faster
    ):
        assert not direct(fast, g, co), (g, co)


def test_kernel_choice_errors(monkeypatch):
    """A bad choice names itself and the valid ones; 'auto' falls back to NumPy without Numba."""
    with pytest.raises(ValueError, match="one of auto, numba, numpy, got 'fortran'"):
        CPUBackend(kernels="fortran")
    monkeypatch.setenv("PYDTNN_CPU_KERNELS", "numpy")
    assert CPUBackend().kernels == "numpy"
    monkeypatch.setattr("pydtnn.backends.cpu.backend.numba_installed", lambda: False)
    monkeypatch.setenv("PYDTNN_CPU_KERNELS", "auto")
    assert CPUBackend().kernels == "numpy"  # no numba: the NumPy path, silently
    with pytest.raises(ValueError, match="numba is not installed"):
        CPUBackend(kernels="numba")


# -- buffer reuse --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"kernel_size": 3, "padding": 1}, {"kernel_size": 3, "groups": 4, "padding": 1}])
def test_conv_outputs_never_alias_reused_buffers(kwargs, kernels):
    """Pooled scratch is reused step after step; what a caller keeps must not change under it."""
    rng = np.random.default_rng(0)
    layer = Conv2D(4, **kwargs)
    layer.build((4, 6, 6))
    xs = [rng.standard_normal((2, 4, 6, 6)).astype(np.float32) for _ in range(3)]
    dy = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    kept = []
    for x in xs:
        y = layer.forward(x)
        dx = layer.backward(dy)
        kept.append((x, y, y.copy(), dx, dx.copy(), layer.grads["weight"].copy()))
    for x, y, y0, dx, dx0, dw in kept:
        np.testing.assert_array_equal(y, y0)
        np.testing.assert_array_equal(dx, dx0)
        fresh = Conv2D(4, **kwargs)
        fresh.build((4, 6, 6))
        fresh.params["weight"][...] = layer.params["weight"]
        fresh.params["bias"][...] = layer.params["bias"]
        np.testing.assert_array_equal(fresh.forward(x), y0)
        np.testing.assert_array_equal(fresh.backward(dy), dx0)
        np.testing.assert_array_equal(fresh.grads["weight"], dw)


def test_conv_repeated_forwards_then_one_backward(kernels):
    # a forward without backward (e.g. a forward-only timing loop) hands its buffer back when dropped
    rng = np.random.default_rng(0)
    layer = Conv2D(3, 3, padding=1)
    layer.build((2, 5, 5), np.float64)
    x1, x2 = rng.standard_normal((2, 2, 2, 5, 5))
    dy = rng.standard_normal((2, 3, 5, 5))
    for x in (x1, x2, x1, x2):
        layer.forward(x)
    dx = layer.backward(dy)
    fresh = Conv2D(3, 3, padding=1)
    fresh.build((2, 5, 5), np.float64)
    fresh.params["weight"][...] = layer.params["weight"]
    fresh.params["bias"][...] = layer.params["bias"]
    fresh.forward(x2)
    np.testing.assert_array_equal(fresh.backward(dy), dx)
    np.testing.assert_array_equal(fresh.grads["weight"], layer.grads["weight"])


def test_conv_second_backward_without_forward_is_an_error(kernels):
    layer = Conv2D(3, 3, padding=1)
    layer.build((2, 5, 5))
    layer.forward(np.ones((1, 2, 5, 5), np.float32))
    layer.backward(np.ones((1, 3, 5, 5), np.float32))
    with pytest.raises(RuntimeError, match="run forward"):
        layer.backward(np.ones((1, 3, 5, 5), np.float32))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Conv2D(4, 3, padding=1),
        lambda: Conv2D(4, 3, stride=2, padding=1),
        lambda: Conv2D(4, 3, padding=1, groups=4),
        lambda: MaxPool2D(2),
        lambda: MaxPool2D(3, stride=2, padding=1),
        lambda: AvgPool2D(2),
        lambda: AvgPool2D(3, stride=1, padding=1),
    ],
)
def test_float32_in_float32_out(make):
    layer = make()
    layer.build((4, 8, 8), np.float32)
    x = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    y = layer.forward(x)
    dx = layer.backward(np.ones_like(y))
    assert y.dtype == np.float32 and dx.dtype == np.float32
    for g in layer.grads.values():
        assert g.dtype == np.float32


# -- threaded batch chunks ---------------------------------------------------------------------
def _kernels_run(x, dy_rng, tuning):
    """Forward and backward of every threaded kernel on x, on backends of this Tuning; returns all
    outputs and gradients."""
    be = CPUBackend(np.float32, tuning=tuning)
    numpy_path = CPUBackend(np.float32, kernels="numpy", tuning=tuning)
    out = []
    for k, s, p in ((2, 2, 0), (3, 2, 1), (3, 1, 0)):
        g = ConvGeometry(c=x.shape[1], h=x.shape[2], w=x.shape[3], kh=k, kw=k, sh=s, sw=s, pt=p, pb=p, pl=p, pr=p)
        dy = dy_rng.standard_normal((x.shape[0], g.c, g.ho, g.wo)).astype(np.float32)
        for b in (be, numpy_path):  # compiled (every max pooling window) and NumPy
            y, ctx = b.maxpool2d_forward(x, g)
            out += [y, b.maxpool2d_backward(dy, ctx, g)]
        y, ctx = be.avgpool2d_forward(x, g)
        out += [y, be.avgpool2d_backward(dy, ctx, g)]
    for mult, s in ((1, 1), (2, 1), (1, 2)):
        c = x.shape[1]
        g = ConvGeometry(c=c, h=x.shape[2], w=x.shape[3], kh=3, kw=3, sh=s, sw=s, pt=1, pb=1, pl=1, pr=1, groups=c)
        w = dy_rng.standard_normal((c * mult, 1, 3, 3)).astype(np.float32)
        dy = dy_rng.standard_normal((x.shape[0], c * mult, g.ho, g.wo)).astype(np.float32)
        y, ctx = be.conv2d_forward(x, w, g)
        out += [y, *be.conv2d_backward(dy, w, ctx, g)]
    fast = CPUBackend(np.float32, kernels="numba", tuning=tuning)  # direct 3x3: samples, then output channels, split
    c = x.shape[1]
    g = ConvGeometry(c=c, h=x.shape[2], w=x.shape[3], kh=3, kw=3, pt=1, pb=1, pl=1, pr=1)
    w = dy_rng.standard_normal((5, c, 3, 3)).astype(np.float32)
    dy = dy_rng.standard_normal((x.shape[0], 5, g.ho, g.wo)).astype(np.float32)
    y, ctx = fast.conv2d_forward(x, w, g)
    out += [y, *fast.conv2d_backward(dy, w, ctx, g)]
    # compiled BatchNorm: channels split
    weight, bias = dy_rng.standard_normal((2, c)).astype(np.float32)
    dy = dy_rng.standard_normal(x.shape).astype(np.float32)
    y, mean, var, inv_std = fast.batchnorm_forward(x, weight, bias, 1e-5)
    out += [y, mean, var, inv_std, *fast.batchnorm_backward(dy, x, mean, inv_std, weight)]
    # compiled ReLU: runs of elements split
    y = fast.relu_forward(x)
    out += [y, fast.relu_backward(dy, y)]
    # compiled convolution bias: added over samples, summed over channels
    y = x.copy()
    fast.bias_forward(y, bias)
    db = np.empty_like(bias)
    fast.bias_backward(dy, db)
    out += [y, db]
    # im2col + GEMM: y and dx split over samples; dw over its columns, each thread's GEMM rounding in
    # its own blocking (rounding-level differences, checked apart by the caller)
    gemm = CPUBackend(np.float32, kernels="numpy", tuning=tuning)
    for co, k, s, p, groups in ((6, 3, 1, 1, 1), (6, 3, 2, 1, 1), (6, 1, 2, 0, 1), (4, 1, 1, 0, 1), (6, 3, 1, 1, 2)):
        g = ConvGeometry(c=c, h=x.shape[2], w=x.shape[3], kh=k, kw=k, sh=s, sw=s, pt=p, pb=p, pl=p, pr=p, groups=groups)
        w = dy_rng.standard_normal((co, c // groups, k, k)).astype(np.float32)
        dy = dy_rng.standard_normal((x.shape[0], co, g.ho, g.wo)).astype(np.float32)
        y, ctx = gemm.conv2d_forward(x, w, g)
        dx, dw = gemm.conv2d_backward(dy, w, ctx, g)
        out += [y, dx, BlasRounded(dw)]
        if s > 1:  # strided dx with the compiled col2im
            y, ctx = fast.conv2d_forward(x, w, g)
            dx, dw = fast.conv2d_backward(dy, w, ctx, g)
            out += [y, dx, BlasRounded(dw)]
    return out


class BlasRounded(np.ndarray):
    """An output that may differ from the one-thread result by BLAS rounding only."""

    def __new__(cls, a):
        return np.asarray(a).view(cls)


@pytest.mark.parametrize("gemm_columns", [128, 10000])
@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_kernels_give_bit_identical_results(threads, gemm_columns, monkeypatch):
    """Pooling, BatchNorm and every convolution path split their work over threads: every thread count
    gives the same bits as one thread, but for the GEMM path's dw (a batch of 7 leaves uneven chunks;
    every call splits, whatever its size). gemm_columns 10000: each GEMM-path convolution is one
    GEMM cut into two halves of its rows."""
    tuning = Tuning(
        split_min_bytes=0, gemm_min_columns=gemm_columns, row_step=1, batchnorm_split_bytes=0, bias_compiled_min_bytes=0
    )
    x = np.random.default_rng(0).standard_normal((7, 4, 9, 9)).astype(np.float32)
    with thread_count(1):
        want = _kernels_run(x, np.random.default_rng(1), tuning)
    calls, compiled_calls, chunked = [], [], []
    real, real_compiled = CPUBackend.split, CPUBackend.split_compiled

    def counted_split(self, n, fn, nbytes=None):
        calls.append(n)

        def chunk(lo, hi):
            chunked.append((lo, hi) != (0, n))
            fn(lo, hi)

        real(self, n, chunk, nbytes)

    def counted(self, kernel, chunks, n, args, nbytes=None):
        compiled_calls.append(kernel)
        real_compiled(self, kernel, chunks, n, args, nbytes)

    monkeypatch.setattr(CPUBackend, "split", counted_split)
    monkeypatch.setattr(CPUBackend, "split_compiled", counted)
    with thread_count(threads):
        got = _kernels_run(x, np.random.default_rng(1), tuning)
    assert any(chunked)  # the pool's splits did cut their work
    # every pooling, convolution, BatchNorm and ReLU call went through a splitter: the pool's, or
    # Numba's threads for the compiled kernels (forward, dw and dx of the stride-1 and stride-2
    # depthwise layers and the dense 3x3 layer, BatchNorm, ReLU, 2x2 max and average pooling, bias,
    # max pooling's other windows)
    assert len(calls) >= 10 + 2 * 5
    assert len(compiled_calls) == 3 + 3 + 3 + 2 + 2 + 4 + 2 + 4
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, BlasRounded):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"output {i}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cap", [None, 6.0])
def test_compiled_relu_matches_numpy_and_torch_at_the_edges(cap, dtype):
    """ReLU and ReLU6 (cap 6), compiled and split over 3 threads, against the NumPy path and PyTorch at
    0, -0.0, the cap, just either side of it, infinities and NaN: y equal (NaN goes through); dx
    is dy where 0 < y < cap, else 0 (0 at NaN), as PyTorch's threshold and hardtanh backward give it
    away from NaN (where PyTorch's ReLU passes dy through, and its ReLU6 does or not depending on
    where the NaN falls in its vector loop). Equal values: the compiled ReLU keeps -0.0's sign,
    NumPy's maximum gives +0.0."""
    edges = [0.0, -0.0, 6.0, np.nextafter(dtype(6), dtype(0)), np.nextafter(dtype(6), dtype(7)), 1e-30, -1e-30,
             np.inf, -np.inf, np.nan, 3.5, -2.0, 7.0]
    x = np.concatenate([np.array(edges, dtype), np.random.default_rng(2).uniform(-3, 9, 1000).astype(dtype)])
    x = x.reshape(1, -1)
    dy = np.random.default_rng(3).standard_normal(x.shape).astype(dtype)
    fast = CPUBackend(dtype, kernels="numba", tuning=Tuning(split_min_bytes=0))
    ref = CPUBackend(dtype, kernels="numpy")
    with thread_count(3):
        y = fast.relu_forward(x, cap)
        dx = fast.relu_backward(dy, y, cap)
    y_ref = ref.relu_forward(x, cap)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, ref.relu_backward(dy, y_ref, cap))
    tx = torch.from_numpy(x.copy()).requires_grad_()
    ty = F.relu(tx) if cap is None else F.relu6(tx)
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_array_equal(y, ty.detach().numpy())
    nan = np.isnan(x)
    assert nan.any() and np.all(dx[nan] == 0)
    np.testing.assert_array_equal(dx[~nan], tx.grad.numpy()[~nan])


def kept_x_runs(be, x, w, dy, plan):
    """[(y, dx, dw)] on 1 and 3 threads of a convolution whose forward keeps x itself for its backward,
    which releases it."""
    runs = []
    for threads in (1, 3):
        with thread_count(threads):
            y, ctx = be.conv2d_forward(x, w, plan)
            assert ctx.array is x
            runs.append((y, *be.conv2d_backward(dy, w, ctx, plan)))
            assert ctx.array is None
    return runs


def test_pointwise_convolution_works_on_x_and_dy_as_they_lie():
    """A one-group 1x1 stride-1 layer with enough pixels takes one GEMM per sample and keeps x itself
    (no im2col matrix); its results match the im2col path's, and every thread count gives the same
    bits (dw: whole blocks of samples per thread, their partial sums added in block order). Large
    weights on few pixels keep im2col."""
    t = Tuning()
    assert pointwise_ok(ConvGeometry(256, 16, 16, 1, 1), 64, t)
    assert not pointwise_ok(ConvGeometry(512, 16, 16, 1, 1), 512, t)  # weight as large as x and dy
    assert not pointwise_ok(ConvGeometry(16, 8, 8, 1, 1), 16, t)  # 64 pixels: blocks of samples
    assert not pointwise_ok(ConvGeometry(16, 16, 16, 1, 1, sh=2, sw=2), 16, t)
    assert not pointwise_ok(ConvGeometry(16, 16, 16, 1, 1, groups=2), 16, t)
    assert not pointwise_ok(ConvGeometry(16, 16, 16, 1, 1, pt=1, pb=1, pl=1, pr=1), 16, t)
    rng = np.random.default_rng(4)
    g = ConvGeometry(12, 12, 11, 1, 1)
    x = rng.standard_normal((19, 12, 12, 11)).astype(np.float32)  # 19 samples: blocks of 8, 8, 3
    w = rng.standard_normal((10, 12, 1, 1)).astype(np.float32)
    dy = rng.standard_normal((19, 10, 12, 11)).astype(np.float32)
    be = CPUBackend(np.float32, tuning=Tuning(split_min_bytes=0))
    assert be.conv2d_plan(g, w.shape).algorithm == "pointwise"
    (y1, dx1, dw1), (y3, dx3, dw3) = kept_x_runs(be, x, w, dy, g)
    np.testing.assert_array_equal(y1, y3)
    np.testing.assert_array_equal(dx1, dx3)
    np.testing.assert_array_equal(dw1, dw3)
    gemm = ConvPlan(g, "gemm", g)  # the im2col path, which the plan passed over
    y, ctx = be.conv2d_forward(x, w, gemm)
    assert ctx.array is not x  # the im2col matrix
    dx, dw = be.conv2d_backward(dy, w, ctx, gemm)
    for got, want in ((y1, y), (dx1, dx), (dw1, dw)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("threads", [1, 3])
def test_matmul_split_over_columns_matches_numpy(threads, monkeypatch):
    """CPUBackend.matmul (Dense's three GEMMs) splits the product's columns over threads: each chunk's
    GEMM rounds in its own blocking, so the result matches NumPy's to float32 rounding; out= is filled."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 40)).astype(np.float32)
    b = rng.standard_normal((40, 11)).astype(np.float32)
    be = CPUBackend(tuning=Tuning(split_min_bytes=0))
    calls = []
    real = be.split
    monkeypatch.setattr(be, "split", lambda n, fn, nbytes=None: (calls.append(n), real(n, fn, nbytes)))
    with thread_count(threads):
        got = be.matmul(a, b)
        out = np.full((7, 11), np.nan, np.float32)
        assert be.matmul(a, b, out=out) is out
    assert calls == [11, 11]
    want = a.astype(np.float64) @ b.astype(np.float64)
    for r in (got, out):
        assert r.dtype == np.float32
        np.testing.assert_allclose(r, want, rtol=1e-5, atol=1e-5)


def test_split_runs_chunks_in_other_threads_and_raises_their_errors():
    import threading

    small = Tuning().split_min_bytes  # the backend's default: calls under it run unsplit
    with thread_count(3):
        seen = []
        th.split(10, lambda lo, hi: seen.append((lo, hi, threading.current_thread().name)), 1 << 30, small)
        assert sorted((lo, hi) for lo, hi, _ in seen) == [(0, 3), (3, 6), (6, 10)]
        names = {name for _, _, name in seen}
        assert threading.current_thread().name in names and len(names) >= 2  # the first chunk runs here
        with pytest.raises(ValueError, match="chunk 6"):
            th.split(
                10, lambda lo, hi: (_ for _ in ()).throw(ValueError(f"chunk {lo}")) if lo == 6 else None, 1 << 30, small
            )
        seen.clear()
        th.split(10, lambda lo, hi: seen.append((lo, hi)), nbytes=100, min_bytes=small)  # small: no hand-off
        assert seen == [(0, 10)]


def test_numba_is_imported_only_by_models_that_use_a_compiled_kernel():
    """Numba and LLVM cost about 100 MB of memory: a model that runs no compiled kernel (direct
    convolution, BatchNorm, ReLU, col2im) never loads them."""
    code = (
        "import sys, numpy as np\n"
        "from pydtnn.backends.cpu import CPUBackend\n"
        "from pydtnn.layers import Conv2D\n"
        "be = CPUBackend(kernels='numba')\n"
        "x = np.ones((2, 8, 6, 6), np.float32)\n"
        "narrow = Conv2D(8, 3, padding=1)\n"
        "narrow.build((8, 6, 6), backend=be)\n"
        "narrow.backward(narrow.forward(x))\n"
        "before = 'numba' in sys.modules\n"
        "wide = Conv2D(8, 3, padding=1)\n"
        "wide.build((8, 8, 8), backend=be)\n"
        "wide.forward(np.ones((2, 8, 8, 8), np.float32))\n"
        "print(before, 'numba' in sys.modules, narrow.plan.algorithm, wide.plan.algorithm)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # the 6-pixel-wide layer runs im2col + GEMM without Numba; the 8-pixel-wide one loads it
    assert r.stdout.split() == ["False", "True", "gemm", "direct"], r.stdout


def _clean_environment(**extra):
    """This process's environment without the user's libgomp and malloc settings, plus extra."""
    drop = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


@pytest.mark.parametrize(
    "env,want",
    [({}, runtime.GOMP_SPINCOUNT), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "passive"}, None)],
)
def test_configure_makes_numba_threads_spin_briefly_unless_the_user_chose(env, want):
    """runtime.configure() sets libgomp's spin count (runtime.GOMP_SPINCOUNT), unless GOMP_SPINCOUNT or
    OMP_WAIT_POLICY is already set; making a backend and running a compiled kernel split over two
    threads does not set it."""
    code = (
        "import os, numpy as np\n"
        "from pydtnn import runtime\n"
        "from pydtnn.backends.cpu import CPUBackend, Tuning, threads\n"
        "threads.set_threads(2)\n"
        "CPUBackend(kernels='numba', tuning=Tuning(split_min_bytes=0)).relu_forward(np.ones(64, np.float32))\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
        "runtime.configure(threads=2)\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_environment(**env),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(env.get("GOMP_SPINCOUNT")), str(want)], r.stdout


_FAULTS = """
import os, resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from pydtnn import runtime
    assert runtime.configure(threads=1, blas_threads=None, gomp_spincount=None)["keep_freed_memory"] is True
elif sys.argv[1] == "backend":  # a backend alone changes no process-wide setting
    from threadpoolctl import threadpool_info
    blas = lambda: sorted((i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas")
    before = blas()
    assert before, threadpool_info()
    from pydtnn import runtime
    from pydtnn.backends.cpu import CPUBackend, threads
    be = CPUBackend()
    be.matmul(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32))
    assert runtime.configured() is None
    assert "GOMP_SPINCOUNT" not in os.environ
    assert blas() == before, (blas(), before)
    assert threads.threads() == 1
first = np.ones(5 << 20, np.float32)  # 20 MB: glibc's dynamic thresholds move up to it
del first
faults = []
for step in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(5 << 19, np.float32) for _ in range(6)]  # 60 MB in 10 MB blocks, then all freed
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(min(faults[1:]))
"""


@pytest.mark.skipif(getattr(ctypes.CDLL(None), "mallopt", None) is None, reason="not glibc: no mallopt to call")
def test_keep_freed_memory_spares_page_faults_on_reuse(monkeypatch):
    """With runtime.configure's malloc settings, memory freed at the end of a step serves the next step
    without touching fresh pages; by default glibc hands it back and faults it in again, and making a
    CPUBackend leaves glibc's default (and every other process-wide setting) alone. The user's own
    MALLOC_* settings take precedence."""
    run = [sys.executable, "-c", _FAULTS]

    def faults(mode):
        r = subprocess.run(
            [*run, mode], env=_clean_environment(), check=False, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        return int(r.stdout)

    default, kept, backend = faults("default"), faults("keep"), faults("backend")
    assert default >= 1_000  # glibc trims the freed top of the heap: megabytes of fresh pages each step
    assert kept <= default // 20
    assert backend >= 1_000  # no mallopt called by the backend
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert runtime._keep_freed_memory() is False


# -- one-group 5x5 and 7x7 stride-1 layers (kernels/convkxk.py) -----------------------------
KXK_CASES = [
    # (N, C, Co, H, W, k, pad (pt, pb, pl, pr), (dh, dw))
    (1, 1, 6, 28, 28, 5, (2, 2, 2, 2), (1, 1)),  # LeNet-5's first layer
    (3, 6, 16, 14, 14, 5, (0, 0, 0, 0), (1, 1)),  # LeNet-5's second layer
    (3, 5, 7, 11, 13, 5, (1, 1, 1, 1), (1, 1)),  # odd sizes, channels not a multiple of 4
    (1, 16, 9, 9, 17, 5, (2, 1, 0, 2), (1, 1)),  # uneven padding
    (3, 3, 4, 5, 5, 5, (0, 0, 0, 0), (1, 1)),  # a 1x1 output (LeNet-5's third layer)
    (1, 4, 5, 13, 9, 5, (4, 2, 3, 4), (1, 1)),  # padding up to the reach
    (3, 2, 4, 15, 12, 5, (2, 2, 2, 2), (2, 1)),  # dilated
    (3, 3, 5, 12, 11, 7, (3, 3, 3, 3), (1, 1)),  # 7x7
]


@pytest.mark.parametrize("case", KXK_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_kxk_direct_kernel_matches_the_numpy_path(case, dtype, threads):
    """The compiled one-group 5x5 and 7x7 kernels and im2col + GEMM give the same y, dx and dw (to
    rounding), whole or split over two threads, the weight gradient summed one sample at a time."""
    tuning = Tuning(direct_min_width=1, direct_chunk_bytes=1, split_min_bytes=0)
    n, c, co, h, w, k, pads, (dh, dw) = case
    g = ConvGeometry(c, h, w, k, k, 1, 1, dh, dw, *pads)
    fast = CPUBackend(dtype, kernels="numba", tuning=tuning)
    ref = CPUBackend(dtype, kernels="numpy", tuning=tuning)
    assert algorithm(fast, g, co) == "direct" and algorithm(ref, g, co) != "direct"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((co, c, k, k)).astype(dtype)
    dy = rng.standard_normal((n, co, g.ho, g.wo)).astype(dtype)
    with thread_count(threads):
        assert_same_convolution(fast, ref, x, wt, dy, g, dtype)


@pytest.mark.parametrize(
    "x_shape,filters,kwargs",
    [
        ((2, 3, 9, 8), 5, {"kernel_size": 5, "padding": 2}),
        ((3, 2, 7, 7), 4, {"kernel_size": 5}),
        ((1, 2, 8, 9), 3, {"kernel_size": 7, "padding": (3, 1)}),
    ],
)
def test_conv_kxk_direct_layer_matches_finite_differences_and_torch(x_shape, filters, kwargs):
    """A Conv2D layer on the compiled 5x5 / 7x7 path passes the layer checks."""
    tuning = Tuning(direct_min_width=1)
    k = kwargs["kernel_size"]
    p = kwargs.get("padding", 0)
    pt, pl = p if isinstance(p, tuple) else (p, p)
    g = ConvGeometry(x_shape[1], *x_shape[2:], k, k, pt=pt, pb=pt, pl=pl, pr=pl)
    assert algorithm(CPUBackend(kernels="numba", tuning=tuning), g, filters) == "direct"
    both_checks(lambda: Conv2D(filters, **kwargs), x_shape, torch_conv(kwargs), tuning=tuning)


def test_kxk_direct_plan_takes_one_group_odd_kernels_up_to_their_reach():
    """5x5 and 7x7 stride-1 one-group layers at least direct_min_width wide take the compiled kernels;
    depthwise, strided, non-square, 4x4 or over-padded ones, and LeNet-5's 1-pixel C5, do not."""
    fast = CPUBackend(kernels="numba")

    def geom(k=5, p=2, **kw):
        return ConvGeometry(**{"c": 6, "h": 14, "w": 14, "kh": k, "kw": k, "pt": p, "pb": p, "pl": p, "pr": p, **kw})

    assert algorithm(fast, geom(p=0), 16) == "direct"  # LeNet-5's C3
    assert algorithm(fast, geom(k=7, p=3), 16) == "direct"
    assert algorithm(fast, geom(p=4), 16) == "direct"  # padding up to the reach
    assert algorithm(fast, geom(p=5), 16) != "direct"
    assert algorithm(fast, geom(c=16, h=5, w=5, p=0), 120) == "gemm"  # C5: one pixel wide
    assert algorithm(fast, geom(groups=6), 6) != "direct"  # depthwise 5x5
    assert algorithm(fast, geom(sh=2, sw=2), 16) != "direct"
    assert algorithm(fast, geom(kw=3, pl=1, pr=1), 16) != "direct"
    assert algorithm(fast, geom(k=4, p=1), 16) != "direct"
    assert algorithm(CPUBackend(kernels="numpy"), geom(), 16) == "gemm"


# the kernel tests that every vector width runs (in a process of its own: the width is chosen once per process):
# the direct convolutions (forward, dx, dw; both dtypes), col2im's vector adds and interleaving, the layout
WIDTH_TESTS = ("(direct_kernel_matches and 1048576) or (col2im_compiled and float32) or dense_layout "
               "or kernels_use_the_chosen_vector_width")


def test_the_kernels_use_the_chosen_vector_width():
    """$PYDTNN_VECTOR_BITS, when set, is the width of the kernels' vectors and of the direct layout."""
    from pydtnn.backends.cpu import isa

    forced = os.environ.get("PYDTNN_VECTOR_BITS")
    assert isa.VECTOR_BITS == (int(forced) if forced else isa.native_bits())
    lanes = isa.VECTOR_BITS // 32
    assert conv_direct.dense_layout(1, 1, 1, 1, 4)[1] == 2 * lanes  # one output column: two whole vectors


def test_vector_width_follows_the_cpu_flags_and_a_bad_override_is_one_line(monkeypatch):
    from pydtnn.backends.cpu import isa
    from pydtnn.errors import ConfigError

    assert isa.native_bits(frozenset({"sse2", "avx", "avx2", "fma", "avx512f"})) == 512
    assert isa.native_bits(frozenset({"sse2", "avx", "avx2", "fma"})) == 256
    assert isa.native_bits(frozenset({"sse2", "avx"})) == 128  # AVX without FMA: the portable path
    monkeypatch.setenv("PYDTNN_VECTOR_BITS", "128")
    assert isa.chosen_bits() == 128
    monkeypatch.delenv("PYDTNN_VECTOR_BITS")
    assert isa.chosen_bits() == isa.native_bits()
    monkeypatch.setenv("PYDTNN_VECTOR_BITS", "384")
    with pytest.raises(ConfigError, match=r"^environment variable PYDTNN_VECTOR_BITS=384: expected 128, 256 or 512"):
        isa.chosen_bits()


@pytest.mark.slow
def test_every_vector_width_matches_the_numpy_path():
    """The compiled kernels at the two widths this CPU does not pick (of 128, 256, 512 bits; a width wider
    than the CPU's runs split into its vectors) pass the direct convolution, col2im and layout tests
    against the NumPy path (float32 and float64 for the convolutions, float32 for col2im: fewer
    kernels to compile). Both run at once, each in its own pytest process and kernel cache."""
    from pydtnn.backends.cpu import isa

    widths = [w for w in isa.WIDTHS if w != isa.native_bits()]
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                               "-k", WIDTH_TESTS], env={**os.environ, "PYDTNN_VECTOR_BITS": str(w)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for w in widths]
    for w, p in zip(widths, procs):
        try:
            out = p.communicate(timeout=900)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"{w}-bit vectors:\n{out[-3000:]}"
        import re

        passed = re.search(r"(\d+) passed", out)
        assert passed and int(passed.group(1)) >= 25 and "failed" not in out, f"{w}-bit vectors:\n{out[-3000:]}"


NO_FMA_SCRIPT = r"""
import re, numpy as np
from pydtnn.backends.cpu.backend import CPUBackend
from pydtnn.backends.cpu.kernels import conv3x3
from pydtnn.layers import Conv2D
from pydtnn.model import Model
x = np.random.default_rng(0).standard_normal((2, 8, 12, 12)).astype(np.float32)
y = [Model([Conv2D(8, 3, padding=1)], (8, 12, 12), backend=CPUBackend(np.float32, kernels=k, seed=0)).forward(x)
     for k in ("numba", "numpy")]
asm = "".join(conv3x3.conv3x3_dense_forward.inspect_asm(s) for s in conv3x3.conv3x3_dense_forward.signatures)
print(float(np.abs(y[0] - y[1]).max()), len(re.findall("fmadd", asm)), len(re.findall(r"\bfmaf\b", asm)),
      len(re.findall("mulps", asm)))
"""


def test_a_cpu_without_fma_gets_a_multiply_and_an_add(tmp_path):
    """Compiled for the baseline x86-64 CPU (SSE2, no FMA) at 128 bits, the direct kernel's multiply-adds are
    multiplies and adds (no FMA instruction, no call to the C library's fma per lane), and it computes what
    the NumPy path does."""
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "PYDTNN_VECTOR_BITS": "128",
           "NUMBA_CACHE_DIR": str(tmp_path)}  # a cache of its own: the code is compiled, so it can be read
    r = subprocess.run([sys.executable, "-c", NO_FMA_SCRIPT], env=env, check=False, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    diff, fused, calls, multiplies = r.stdout.split()
    assert float(diff) < 1e-5 and int(fused) == 0 and int(calls) == 0 and int(multiplies) > 0, r.stdout


# -- Winograd F(2x2, 3x3) ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("c,h,w,k,pads", [
    (3, 8, 8, 5, (1, 1, 1, 1)),   # same padding, even sizes
    (4, 7, 9, 6, (0, 0, 0, 0)),   # no padding: odd output rows and columns, dx padded by 2
    (5, 6, 5, 3, (2, 2, 2, 2)),   # padding of the kernel's reach
    (2, 5, 6, 4, (0, 1, 1, 0)),   # uneven padding
    (8, 1, 1, 4, (1, 1, 1, 1)),   # one pixel: a single tile, mostly padding
    (17, 12, 10, 33, (1, 1, 1, 1)),
])
def test_winograd_equals_im2col_gemm(c, h, w, k, pads, dtype, rtol):
    """y, dx and dw of the Winograd plan equal im2col + GEMM's; the forward without keep gives the same y."""
    from pydtnn.backends.cpu import conv_plan

    g = ConvGeometry(c, h, w, 3, 3, pt=pads[0], pb=pads[1], pl=pads[2], pr=pads[3])
    rng = np.random.default_rng(c * h + w)
    x = rng.standard_normal((3, c, h, w)).astype(dtype)
    wt = rng.standard_normal((k, c, 3, 3)).astype(dtype)
    dy = rng.standard_normal((3, k, g.ho, g.wo)).astype(dtype)
    b = CPUBackend(dtype)
    got = {}
    for alg in ("gemm", "winograd"):
        plan = conv_plan.plan_for(g, alg)
        y, ctx = b.conv2d_forward(x, wt, plan)
        got[alg] = (y, *b.conv2d_backward(dy, wt, ctx, plan))
        y2, _ = b.conv2d_forward(x, wt, plan, keep=False)
        np.testing.assert_array_equal(y2, y)
    for name, a, want in zip(("y", "dx", "dw"), got["winograd"], got["gemm"]):
        assert a.shape == want.shape and a.dtype == want.dtype, name
        np.testing.assert_allclose(a, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=name)


def test_winograd_keeps_x_and_splits_over_threads_bit_identically():
    """The forward keeps x itself for the F(3x3, 2x2) weight gradient (released by backward); 1 and 3
    threads give the same bits (transforms split over samples, each position's GEMMs on one thread)."""
    from pydtnn.backends.cpu import conv_plan

    g = ConvGeometry(6, 9, 7, 3, 3, pt=1, pb=1, pl=1, pr=1)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 6, 9, 7)).astype(np.float32)
    w = rng.standard_normal((8, 6, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((5, 8, 9, 7)).astype(np.float32)
    be = CPUBackend(np.float32, tuning=Tuning(split_min_bytes=0))
    runs = kept_x_runs(be, x, w, dy, conv_plan.plan_for(g, "winograd"))
    for name, a, b in zip(("y", "dx", "dw"), *runs):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_winograd_is_a_candidate_only_for_one_group_3x3_stride_1():
    from pydtnn.backends.cpu.conv_winograd import winograd_ok

    assert winograd_ok(ConvGeometry(8, 8, 8, 3, 3, pt=1, pb=1, pl=1, pr=1), 8)
    assert winograd_ok(ConvGeometry(8, 8, 8, 3, 3, pt=2, pb=0, pl=0, pr=2), 8)
    for g in (ConvGeometry(8, 8, 8, 3, 3, 2, 2, pt=1, pb=1, pl=1, pr=1),  # stride 2
              ConvGeometry(8, 8, 8, 3, 3, dh=2, dw=2, pt=2, pb=2, pl=2, pr=2),  # dilated
              ConvGeometry(8, 8, 8, 3, 3, pt=1, pb=1, pl=1, pr=1, groups=8),  # depthwise
              ConvGeometry(8, 8, 8, 5, 5, pt=2, pb=2, pl=2, pr=2),  # 5x5
              ConvGeometry(8, 8, 8, 3, 3, pt=3, pb=3, pl=3, pr=3)):  # padding past the kernel's reach
        assert not winograd_ok(g, 8), g


@pytest.mark.parametrize("first,threads,warned", [("gomp", 2, True), ("none", 2, False), ("gomp", 1, False)])
def test_configure_says_when_libgomp_came_first(first, threads, warned):
    """A libgomp loaded before configure (torch imported first) read its environment without pydtnn's spin
    count: its threads then spin on the cores the pool needs, and configure says so where threads > 1."""
    code = ("import ctypes, ctypes.util, warnings\n"
            + ("ctypes.CDLL(ctypes.util.find_library('gomp'))\n" if first == "gomp" else "")
            + "from pydtnn import runtime\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    runtime.configure(threads={threads})\n"
            "print(runtime.gomp_loaded(), [str(x.message) for x in w])\n")
    if first == "gomp" and not __import__("ctypes.util").util.find_library("gomp"):
        pytest.skip("no libgomp on this system")
    r = subprocess.run([sys.executable, "-c", code], env=_clean_environment(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(first == "gomp")), r.stdout
    assert ("libgomp was loaded before GOMP_SPINCOUNT could be set" in r.stdout) == warned, r.stdout
