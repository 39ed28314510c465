"""The convolution bias (added to y, summed from dy), ReLU, capped or not, GELU (one pass each way, no
boolean temporaries), and softmax over rows (attention weights)."""

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

from pydtnn.backends.cpu.kernels.jit import exact as _exact
from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit
from pydtnn.backends.cpu.kernels.jit import reassoc as _reassoc


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
    approximation (backends/base.py's formulas), in x's own precision (erff and tanhf for float32)."""
    f = x.dtype.type
    half, one, r2, k, c = f(0.5), f(1.0), f(0.7071067811865476), f(0.044715), f(0.7978845608028654)
    xr, yr = x[lo:hi], y[lo:hi]
    for i in range(xr.shape[0]):
        v = xr[i]
        if tanh_form:
            yr[i] = half * v * (one + math.tanh(c * (v + k * v * v * v)))
        else:
            yr[i] = half * v * (one + math.erf(v * r2))


@_pjit
def gelu_forward_chunks(n, t, x, y, tanh_form):
    for i in numba.prange(t):
        gelu_forward(x, y, tanh_form, n * i // t, n * (i + 1) // t)


@_exact
def gelu_backward(dy, x, dx, tanh_form, lo, hi):
    """dx = dy * GELU'(x) over the flat elements lo..hi-1, in x's own precision."""
    f = x.dtype.type
    half, one, r2, k, c = f(0.5), f(1.0), f(0.7071067811865476), f(0.044715), f(0.7978845608028654)
    k3, rpi = f(0.134145), f(0.3989422804014327)
    gr, xr, dr = dy[lo:hi], x[lo:hi], dx[lo:hi]
    for i in range(gr.shape[0]):
        v = xr[i]
        if tanh_form:
            t = math.tanh(c * (v + k * v * v * v))
            d = half * (one + t) + half * v * (one - t * t) * c * (one + k3 * v * v)
        else:
            d = half * (one + math.erf(v * r2)) + v * math.exp(-half * v * v) * rpi
        dr[i] = gr[i] * d


@_pjit
def gelu_backward_chunks(n, t, dy, x, dx, tanh_form):
    for i in numba.prange(t):
        gelu_backward(dy, x, dx, tanh_form, n * i // t, n * (i + 1) // t)


# float32 erf as a rational function of x on [-4, 4] (erf is +-1 in float32 beyond): Eigen's
# generic_fast_erf_float, whose only operations vectorize; within 4.2e-7 of the exact erf.
_ERF_P = (-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, -5.69250639462346e-05,
          -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10)
_ERF_Q = (-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03, -2.13374055278905e-04,
          -1.45660718464996e-05)


@_jit
def erf32(v):
    """erf of a float32 value by the rational function above (no libm call: loops over it vectorize)."""
    f = numba.float32
    x = min(max(v, f(-4.0)), f(4.0))
    x2 = x * x
    p = f(_ERF_P[6])
    p = p * x2 + f(_ERF_P[5])
    p = p * x2 + f(_ERF_P[4])
    p = p * x2 + f(_ERF_P[3])
    p = p * x2 + f(_ERF_P[2])
    p = p * x2 + f(_ERF_P[1])
    p = p * x2 + f(_ERF_P[0])
    q = f(_ERF_Q[4])
    q = q * x2 + f(_ERF_Q[3])
    q = q * x2 + f(_ERF_Q[2])
    q = q * x2 + f(_ERF_Q[1])
    q = q * x2 + f(_ERF_Q[0])
    return x * p / q


@_jit
def gelu32_forward(x, y, lo, hi):
    """y = x * Phi(x) over the flat float32 elements lo..hi-1, erf by erf32."""
    f = numba.float32
    xr, yr = x[lo:hi], y[lo:hi]
    for i in range(xr.shape[0]):
        v = xr[i]
        yr[i] = f(0.5) * v * (f(1.0) + erf32(v * f(0.7071067811865476)))


@_pjit
def gelu32_forward_chunks(n, t, x, y):
    for i in numba.prange(t):
        gelu32_forward(x, y, n * i // t, n * (i + 1) // t)


@_jit
def gelu32_backward(dy, x, dx, lo, hi):
    """dx = dy * (Phi(x) + x * phi(x)) over the flat float32 elements lo..hi-1, erf by erf32, exp by exp32."""
    f = numba.float32
    gr, xr, dr = dy[lo:hi], x[lo:hi], dx[lo:hi]
    for i in range(gr.shape[0]):
        v = xr[i]
        d = f(0.5) * (f(1.0) + erf32(v * f(0.7071067811865476))) + v * exp32(f(-0.5) * v * v) * f(0.3989422804014327)
        dr[i] = gr[i] * d


@_pjit
def gelu32_backward_chunks(n, t, dy, x, dx):
    for i in numba.prange(t):
        gelu32_backward(dy, x, dx, n * i // t, n * (i + 1) // t)


@_exact
def exp32(v):
    """exp of a float32 value without a libm call (loops over it vectorize): v = n ln2 + r with |r| <= ln2 / 2,
    exp(r) by Cephes' expf polynomial and 2^n written into the exponent bits; within 1e-7 relative of exp.
    Below -87.3 (where float32's exp turns subnormal) it gives 0; NaN and +inf pass through, as exp's.
    Compiled without fastmath, whoever calls it (jit.exact): reassociated, n ln2's two parts would merge."""
    f = numba.float32
    c = min(max(v, f(-87.3)), f(88.3))
    biased = np.int32(c * f(1.4426950408889634) + f(128.5))  # n + 128, n = round(c / ln 2): positive, so truncated
    n = f(biased) - f(128.0)
    r = c - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)  # ln 2 in two parts: n * ln 2 exactly enough for every n in range
    p = f(1.9875691500e-4)
    p = p * r + f(1.3981999507e-3)
    p = p * r + f(8.3334519073e-3)
    p = p * r + f(4.1665795894e-2)
    p = p * r + f(1.6666665459e-1)
    p = p * r + f(5.0000001201e-1)
    e = (p * r * r + r + f(1.0)) * np.int32((biased - np.int32(1)) << np.int32(23)).view(np.float32)
    if v < f(-87.3):
        e = f(0.0)
    if v > f(88.3) or math.isnan(v):
        e = v if math.isnan(v) else f(np.inf)
    return e


def fexp(v):
    """exp in the value's own precision: exp32 for float32, libm's exp for float64 (compiled code only)."""
    return math.exp(v)


@overload(fexp, jit_options={"cache": True})
def _fexp(v):
    if isinstance(v, types.Float) and v.bitwidth == 32:
        return lambda v: exp32(v)
    return lambda v: math.exp(v)


@numba.njit(nogil=True, fastmath={"nnan", "nsz", "reassoc"}, error_model="numpy", cache=True)
def _row_max(r, n):
    """max of r[:n], n >= 1 (vectorized: NaN need not win here, the caller's exp of it gives NaN)."""
    m = r[0]
    for j in range(1, n):
        m = max(m, r[j])
    return m


@_reassoc
def softmax_rows(x, y, scale, causal, lo, hi):
    """y[r] = softmax(scale * x[r]) for rows lo..hi-1 of x (R, K), scale > 0, a row of -inf giving zeros
    (backends/base.py's). causal: x holds square blocks of attention scores (R a multiple of K), row r the
    scores of query r % K, which sees its first r % K + 1 keys only: the rest read as -inf (not read at
    all) and come out 0."""
    z = x.dtype.type(0)
    k = x.shape[1]
    for r in range(lo, hi):
        xr, yr = x[r], y[r]
        n = r % k + 1 if causal else k
        m = _row_max(xr, n)
        if m == -np.inf:  # every entry -inf (a NaN among them is not seen by _row_max: it is looked for here)
            yr[:] = z
            for j in range(n):
                if math.isnan(xr[j]):
                    yr[:] = xr[j]
                    break
            continue
        s = z
        for j in range(n):
            e = fexp((xr[j] - m) * scale)
            yr[j] = e
            s += e
        inv = x.dtype.type(1) / s
        for j in range(n):
            yr[j] *= inv
        for j in range(n, k):
            yr[j] = z


@_pjit
def softmax_rows_chunks(n, t, x, y, scale, causal):
    for i in numba.prange(t):
        softmax_rows(x, y, scale, causal, n * i // t, n * (i + 1) // t)


@_jit
def softmax_rows_backward(dy, y, dx, scale, lo, hi):
    """dx[r] = scale * y[r] * (dy[r] - sum(dy[r] * y[r])) for rows lo..hi-1 of (R, K): the gradient of
    softmax(scale * x) (y's zeros, a causal mask's included, give zeros)."""
    for r in range(lo, hi):
        gr, yr, dr = dy[r], y[r], dx[r]
        s = gr.dtype.type(0)
        for j in range(gr.shape[0]):
            s += gr[j] * yr[j]
        for j in range(gr.shape[0]):
            dr[j] = scale * yr[j] * (gr[j] - s)


@_pjit
def softmax_rows_backward_chunks(n, t, dy, y, dx, scale):
    for i in numba.prange(t):
        softmax_rows_backward(dy, y, dx, scale, n * i // t, n * (i + 1) // t)
