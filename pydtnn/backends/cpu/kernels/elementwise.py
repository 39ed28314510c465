"""The convolution bias (added to y, summed from dy), ReLU, capped or not, and GELU (one pass each way, no
boolean temporaries)."""

import math

import numba

from pydtnn.backends.cpu.kernels.jit import exact as _exact
from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit


@_exact
def bias_add(y, b, lo, hi):
    """y[n, c] += b[c] for samples lo..hi-1 of y (N, C, P)."""
    for n in range(lo, hi):
        for c in range(y.shape[1]):
            row, v = y[n, c], b[c]
            for k in range(row.shape[0]):
                row[k] += v


@_pjit
def bias_add_chunks(n, t, y, b):
    for i in numba.prange(t):
        bias_add(y, b, n * i // t, n * (i + 1) // t)


@_jit
def bias_grad(dy, out, lo, hi):
    """out[c] = sum of dy[:, c] (N, C, P) for channels lo..hi-1 of float32 dy, in float64 (vectorized:
    fastmath lets LLVM keep several partial sums). The order of the additions depends on N and P
    only, so the bits do not depend on which thread sums a channel."""
    for c in range(lo, hi):
        acc = 0.0
        for n in range(dy.shape[0]):
            row = dy[n, c]
            for k in range(row.shape[0]):
                acc += row[k]
        out[c] = acc


@_pjit
def bias_grad_chunks(n, t, dy, out):
    for i in numba.prange(t):
        bias_grad(dy, out, n * i // t, n * (i + 1) // t)


@_exact
def relu_forward(x, y, lo, hi):
    """y = max(x, 0) over the flat elements lo..hi-1; NaN goes through, as in np.maximum."""
    z = x.dtype.type(0)
    xr, yr = x[lo:hi], y[lo:hi]
    for i in range(xr.shape[0]):  # from 0: no negative-index wraparound to stop the vectorizer
        v = xr[i]
        yr[i] = z if v < z else v  # noqa: FURB136 (max() would not let NaN through)


@_pjit
def relu_forward_chunks(n, t, x, y):
    for i in numba.prange(t):
        relu_forward(x, y, n * i // t, n * (i + 1) // t)


@_exact
def relu_backward(dy, y, dx, lo, hi):
    """dx = dy where y > 0, else 0 (PyTorch's threshold_backward), over the flat elements lo..hi-1."""
    z = dy.dtype.type(0)
    gr, yr, dr = dy[lo:hi], y[lo:hi], dx[lo:hi]
    for i in range(gr.shape[0]):
        dr[i] = gr[i] if yr[i] > z else z


@_pjit
def relu_backward_chunks(n, t, dy, y, dx):
    for i in numba.prange(t):
        relu_backward(dy, y, dx, n * i // t, n * (i + 1) // t)


@_exact
def relu_cap_forward(x, y, cap, lo, hi):
    """y = min(max(x, 0), cap) over the flat elements lo..hi-1 (ReLU6: cap 6); NaN goes through, as in
    np.minimum(np.maximum(x, 0), cap)."""
    z = x.dtype.type(0)
    xr, yr = x[lo:hi], y[lo:hi]
    for i in range(xr.shape[0]):
        v = xr[i]
        v = z if v < z else v
        yr[i] = cap if v > cap else v


@_pjit
def relu_cap_forward_chunks(n, t, x, y, cap):
    for i in numba.prange(t):
        relu_cap_forward(x, y, cap, n * i // t, n * (i + 1) // t)


@_exact
def relu_cap_backward(dy, y, dx, cap, lo, hi):
    """dx = dy where 0 < y < cap, else 0 (PyTorch's hardtanh_backward), over the flat elements lo..hi-1."""
    z = dy.dtype.type(0)
    gr, yr, dr = dy[lo:hi], y[lo:hi], dx[lo:hi]
    for i in range(gr.shape[0]):
        v = yr[i]
        dr[i] = gr[i] if (v > z) & (v < cap) else z


@_pjit
def relu_cap_backward_chunks(n, t, dy, y, dx, cap):
    for i in numba.prange(t):
        relu_cap_backward(dy, y, dx, cap, n * i // t, n * (i + 1) // t)


@_exact
def gelu_forward(x, y, tanh_form, lo, hi):
    """y = GELU(x) over the flat elements lo..hi-1: x * Phi(x) (erf), or with tanh_form PyTorch's tanh
    approximation (backends/base.py's formulas)."""
    xr, yr = x[lo:hi], y[lo:hi]
    for i in range(xr.shape[0]):
        v = xr[i]
        if tanh_form:
            yr[i] = 0.5 * v * (1.0 + math.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
        else:
            yr[i] = 0.5 * v * (1.0 + math.erf(v * 0.7071067811865476))


@_pjit
def gelu_forward_chunks(n, t, x, y, tanh_form):
    for i in numba.prange(t):
        gelu_forward(x, y, tanh_form, n * i // t, n * (i + 1) // t)


@_exact
def gelu_backward(dy, x, dx, tanh_form, lo, hi):
    """dx = dy * GELU'(x) over the flat elements lo..hi-1."""
    gr, xr, dr = dy[lo:hi], x[lo:hi], dx[lo:hi]
    for i in range(gr.shape[0]):
        v = xr[i]
        if tanh_form:
            t = math.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))
            d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * v * v)
        else:
            d = 0.5 * (1.0 + math.erf(v * 0.7071067811865476)) + v * math.exp(-0.5 * v * v) * 0.3989422804014327
        dr[i] = gr[i] * d


@_pjit
def gelu_backward_chunks(n, t, dy, x, dx, tanh_form):
    for i in numba.prange(t):
        gelu_backward(dy, x, dx, tanh_form, n * i // t, n * (i + 1) // t)
