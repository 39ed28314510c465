"""The convolution bias, ReLU (capped too: ReLU6), GELU and softmax over the last axis on the CPU: compiled one-pass kernels
(kernels/elementwise.py) split over the threads in contiguous runs, or NumPy."""

import numpy as np

from pydtnn.backends.base import Backend, check_causal


def bias_forward(b, y, bias):
    """y (N, C, H, W) += bias (C,) in place: from tuning.bias_compiled_min_bytes on by a compiled kernel
    (a C-contiguous y), else NumPy's broadcast add."""
    if b.kernels != "numba" or y.nbytes < b.tuning.bias_compiled_min_bytes or not y.flags.c_contiguous:
        y += bias.reshape(1, -1, 1, 1)
        return
    from pydtnn.backends.cpu.kernels import elementwise

    n, c, h, w = y.shape
    b.split_compiled(elementwise.bias_add, elementwise.bias_add_chunks, n, (y.reshape(n, c, h * w), bias), y.nbytes)


def bias_backward(b, dy, out):
    """out (C,) = dy summed over samples and pixels: float32 from tuning.bias_compiled_min_bytes on by a
    compiled kernel split over channels, accumulated in float64; else (and float64, which NumPy's
    pairwise sum adds more accurately) NumPy's sum."""
    if b.kernels != "numba" or dy.nbytes < b.tuning.bias_compiled_min_bytes or dy.dtype != np.float32:
        dy.sum(axis=(0, 2, 3), out=out)
        return
    from pydtnn.backends.cpu.kernels import elementwise

    n, c, h, w = dy.shape
    args = (np.ascontiguousarray(dy).reshape(n, c, h * w), out)
    b.split_compiled(elementwise.bias_grad, elementwise.bias_grad_chunks, c, args, dy.nbytes)


def relu_forward(b, x, cap=None):
    """max(x, 0), and with a cap min(that, cap): one compiled pass; in NumPy, against a contiguous sample
    of zeros (NumPy's maximum against a scalar runs an unvectorized loop, against a contiguous array it
    is about twice as fast), then the cap in place."""
    if b.kernels != "numba":
        per_sample = x[0].size if x.shape[0] else 0
        key, zeros = b.pool.take("relu_zeros", (per_sample,), x.dtype)  # never written: stays zero
        y = np.maximum(x.reshape(x.shape[0], per_sample), zeros).reshape(x.shape)
        b.pool.give(key, zeros)
        if cap is not None:
            np.minimum(y, x.dtype.type(cap), out=y)
        return y
    from pydtnn.backends.cpu.kernels import elementwise

    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    args = (x.reshape(-1), y.reshape(-1))
    kernels = elementwise.relu_forward, elementwise.relu_forward_chunks
    if cap is not None:
        kernels, args = (elementwise.relu_cap_forward, elementwise.relu_cap_forward_chunks), (*args, x.dtype.type(cap))
    b.split_compiled(*kernels, x.size, args, 2 * x.nbytes)
    return y


def relu_backward(b, dy, y, cap=None):
    """dy where y > 0 (and, with a cap, y < cap), else 0."""
    if b.kernels != "numba":
        return dy * (y > 0) if cap is None else dy * ((y > 0) & (y < cap))
    from pydtnn.backends.cpu.kernels import elementwise

    dy, y = np.ascontiguousarray(dy), np.ascontiguousarray(y)
    dx = np.empty_like(dy)
    args = (dy.reshape(-1), y.reshape(-1), dx.reshape(-1))
    kernels = elementwise.relu_backward, elementwise.relu_backward_chunks
    if cap is not None:
        kernels, args = (elementwise.relu_cap_backward, elementwise.relu_cap_backward_chunks), (*args, dy.dtype.type(cap))
    b.split_compiled(*kernels, dy.size, args, 3 * dy.nbytes)
    return dx


def gelu_forward(b, x, approximate="none"):
    """GELU (backends/base.py's formulas): one compiled pass (float32's exact form with a rational erf within
    4.2e-7 of erf, which vectorizes; libm's erf otherwise), or the generic NumPy form."""
    if b.kernels != "numba":
        return Backend.gelu_forward(b, x, approximate)
    from pydtnn.backends.cpu.kernels import elementwise

    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    if x.dtype == np.float32 and approximate == "none":  # erf by kernels.elementwise.erf32: vectorized
        kernels, args = (elementwise.gelu32_forward, elementwise.gelu32_forward_chunks), (x.reshape(-1), y.reshape(-1))
    else:
        kernels = elementwise.gelu_forward, elementwise.gelu_forward_chunks
        args = (x.reshape(-1), y.reshape(-1), approximate == "tanh")
    b.split_compiled(*kernels, x.size, args, 2 * x.nbytes)
    return y


def gelu_backward(b, dy, x, approximate="none"):
    """dy * GELU'(x): one compiled pass, or the generic NumPy form."""
    if b.kernels != "numba":
        return Backend.gelu_backward(b, dy, x, approximate)
    from pydtnn.backends.cpu.kernels import elementwise

    dy, x = np.ascontiguousarray(dy), np.ascontiguousarray(x)
    dx = np.empty_like(dy)
    args = (dy.reshape(-1), x.reshape(-1), dx.reshape(-1))
    if x.dtype == np.float32 and approximate == "none":
        kernels = elementwise.gelu32_backward, elementwise.gelu32_backward_chunks
    else:
        kernels, args = (elementwise.gelu_backward, elementwise.gelu_backward_chunks), (*args, approximate == "tanh")
    b.split_compiled(*kernels, dy.size, args, 3 * dy.nbytes)
    return dx


def softmax_forward(b, x, scale=1.0, causal=False):
    """Softmax of scale * x over the last axis, causal as backends/base.py's: a compiled pass per row (rows
    split over the threads; float32's exp by kernels.elementwise.exp32), or NumPy's."""
    if b.kernels != "numba":
        return Backend.softmax_forward(b, x, scale, causal)
    from pydtnn.backends.cpu.kernels import elementwise

    check_causal(x, causal)
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])
    b.split_compiled(elementwise.softmax_rows, elementwise.softmax_rows_chunks, rows.shape[0],
                     (rows, y.reshape(rows.shape), x.dtype.type(scale), bool(causal)), 2 * x.nbytes)
    return y


def softmax_backward(b, dy, y, scale=1.0):
    """scale * y * (dy - sum(dy * y)) over the last axis: compiled per row, or NumPy's."""
    if b.kernels != "numba":
        return Backend.softmax_backward(b, dy, y, scale)
    from pydtnn.backends.cpu.kernels import elementwise

    dy, y = np.ascontiguousarray(dy), np.ascontiguousarray(y)
    dx = np.empty_like(dy)
    k = dy.shape[-1]
    b.split_compiled(elementwise.softmax_rows_backward, elementwise.softmax_rows_backward_chunks, dy.size // k,
                     (dy.reshape(-1, k), y.reshape(-1, k), dx.reshape(-1, k), dy.dtype.type(scale)), 3 * dy.nbytes)
    return dx
