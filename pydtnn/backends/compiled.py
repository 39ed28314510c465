"""Compiled CPU kernels (Numba): the direct 3x3 stride-1 convolution used for small channel counts,
and training-mode batch normalization.

im2col + GEMM copies the input nine times into a matrix that does not fit in cache, and with 16-64
channels the GEMM has too small a dimension for BLAS to reach its peak. These kernels never build
that matrix: each sample's input is padded into a small scratch array (in cache), and each output
row is a 9-tap sum over the "wide" grid q = ho*Wp + wo (wo running over the padded width Wp, the
columns wo >= Wo computed and dropped), a loop LLVM vectorizes. The forward and dx work on whole
samples, the weight gradient on output channels, so the CPU backend splits them over its threads
(backends/threads.py) and the result does not depend on the thread count.

Batch normalization takes one channel at a time through all its passes (statistics, then the affine
map; in backward the two sums, then dx), so the channel's values are still in cache for the second
pass; the CPU backend splits it over channels.

The NumPy path (backends/cpu.py, layers/norm.py) stays the reference and the fallback: it is used
when Numba is not installed, when PYDTNN_CPU_KERNELS=numpy, or when a backend is made with
kernels="numpy"; tests/test_cpu_kernels.py and tests/test_layers.py check that both give the same
results. The CPU backend imports this module (and with it Numba and LLVM, about 100 MB of memory)
only when a layer first uses a kernel.
"""

import numba
import numpy as np

_jit = numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True)


@_jit
def _rounded(length):
    """length rounded up to whole vectorized iterations (8 lanes x 4 interleaved): for short rows
    (8x8 images) the scalar remainder loop would otherwise cost as much as the vector loop. The
    extra outputs read the zero tail of the scratch input and are never copied out."""
    return (length + 31) // 32 * 32


@_jit
def _pad_into(xs, xn, pt, pl, hp, wp, c0, c1):
    """Copy channels c0..c1-1 of one sample xn (C, H, W) into the flat padded scratch xs (C, Hp*Wp +
    tail) at (pt, pl); the border of xs is never written, so it stays zero. Rows/columns beyond the
    grid are left out."""
    h, w = xn.shape[1], xn.shape[2]
    cols = min(w, wp - pl)
    for c in range(c0, c1):
        for r in range(min(h, hp - pt)):
            base = (r + pt) * wp + pl
            xs[c, base : base + cols] = xn[c, r, :cols]


@numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True, inline="always")
def _taps(acc, xr, ws, o1, o2, j1, j2, first):
    """acc[q] (=, or += when not first) sum over the 3x3 taps of ws[i, j] * xr[q + i*o1 + j*j1]."""
    u = np.uint64
    w00, w01, w02 = ws[0, 0], ws[0, 1], ws[0, 2]
    w10, w11, w12 = ws[1, 0], ws[1, 1], ws[1, 2]
    w20, w21, w22 = ws[2, 0], ws[2, 1], ws[2, 2]
    # unsigned indices: with signed ones the negative-index check stops LLVM from vectorizing
    if first:
        for q in range(acc.shape[0]):
            a = u(q)
            b = a + o1
            c = a + o2
            acc[a] = (
                w00 * xr[a] + w01 * xr[a + j1] + w02 * xr[a + j2]
                + w10 * xr[b] + w11 * xr[b + j1] + w12 * xr[b + j2]
                + w20 * xr[c] + w21 * xr[c + j1] + w22 * xr[c + j2]
            )  # fmt: skip
    else:
        for q in range(acc.shape[0]):
            a = u(q)
            b = a + o1
            c = a + o2
            acc[a] += (
                w00 * xr[a] + w01 * xr[a + j1] + w02 * xr[a + j2]
                + w10 * xr[b] + w11 * xr[b + j1] + w12 * xr[b + j2]
                + w20 * xr[c] + w21 * xr[c + j1] + w22 * xr[c + j2]
            )  # fmt: skip


@_jit
def conv3x3_forward(x, w, y, pt, pl, dh, dw, depthwise, n0, n1):
    """y[n] = conv(x[n], w) for samples n0..n1-1; x (N, C, H, W), w (Co, C, 3, 3), y (N, Co, Ho, Wo).

    Stride 1, dilation (dh, dw), padding pt/pl at the top/left (bottom/right follow from y's size).
    depthwise: Co == C groups, w (C, 1, 3, 3), output channel c reads input channel c only.
    """
    c_ = x.shape[1]
    co_, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    wp = wo + 2 * dw
    hp = ho + 2 * dh
    length = _rounded(ho * wp)
    xs = np.zeros((c_, length + 2 * dh * wp + 2 * dw), x.dtype)
    acc = np.empty(length, x.dtype)
    o1, o2, j1, j2 = np.uint64(dh * wp), np.uint64(2 * dh * wp), np.uint64(dw), np.uint64(2 * dw)
    for n in range(n0, n1):
        _pad_into(xs, x[n], pt, pl, hp, wp, 0, c_)
        for co in range(co_):
            cs, ce = (co, co + 1) if depthwise else (0, c_)
            for c in range(cs, ce):
                _taps(acc, xs[c], w[co, c - cs], o1, o2, j1, j2, c == cs)
            for r in range(ho):
                y[n, co, r, :] = acc[r * wp : r * wp + wo]


@_jit
def conv3x3_weight_grad(x, dy, dwt, pt, pl, dh, dw, depthwise, co0, co1):
    """dwt[co] = sum over samples of the correlation of dy[:, co] with x, for co0 <= co < co1.

    x (N, C, H, W), dy (N, Co, Ho, Wo), dwt (Co, C, 3, 3), or (C, 1, 3, 3) when depthwise. Each tap
    is a dot product over the wide grid (dy is zero in the dropped columns); per-sample partial sums
    are added in float64.
    """
    n_, c_ = x.shape[0], x.shape[1]
    ho, wo = dy.shape[2], dy.shape[3]
    wp = wo + 2 * dw
    hp = ho + 2 * dh
    length = _rounded(ho * wp)
    xs = np.zeros((c_, length + 2 * dh * wp + 2 * dw), x.dtype)
    ds = np.zeros((co1 - co0, length), x.dtype)
    tot = np.zeros((co1 - co0, dwt.shape[1], 9), np.float64)
    p0, p1 = (co0, co1) if depthwise else (0, c_)  # input channels this call reads
    zero = x.dtype.type(0)
    u = np.uint64
    o1, o2, j1, j2 = u(dh * wp), u(2 * dh * wp), u(dw), u(2 * dw)
    for n in range(n_):
        _pad_into(xs, x[n], pt, pl, hp, wp, p0, p1)
        for co in range(co0, co1):
            for r in range(ho):
                ds[co - co0, r * wp : r * wp + wo] = dy[n, co, r, :]
        for k in range(co1 - co0):
            dr = ds[k]
            cs, ce = (co0 + k, co0 + k + 1) if depthwise else (0, c_)
            for c in range(cs, ce):
                xr = xs[c]
                s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = s8 = zero
                for q in range(length):
                    a = u(q)
                    b = a + o1
                    e = a + o2
                    d = dr[a]
                    s0 += d * xr[a]
                    s1 += d * xr[a + j1]
                    s2 += d * xr[a + j2]
                    s3 += d * xr[b]
                    s4 += d * xr[b + j1]
                    s5 += d * xr[b + j2]
                    s6 += d * xr[e]
                    s7 += d * xr[e + j1]
                    s8 += d * xr[e + j2]
                t = tot[k, c - cs]
                t[0] += s0
                t[1] += s1
                t[2] += s2
                t[3] += s3
                t[4] += s4
                t[5] += s5
                t[6] += s6
                t[7] += s7
                t[8] += s8
    for k in range(co1 - co0):
        for c in range(dwt.shape[1]):
            for i in range(3):
                for j in range(3):
                    dwt[co0 + k, c, i, j] = tot[k, c, i * 3 + j]


# -- batch normalization: every pass over one channel's samples while they are in cache ----------------
@_jit
def _row_sum(r):
    """Sum of a row in its dtype (vectorized, lanes reassociated), returned as float64."""
    s = r.dtype.type(0)
    for i in range(r.shape[0]):
        s += r[i]
    return np.float64(s)


@_jit
def batchnorm_forward(x, weight, bias, eps, y, mean, var, c0, c1):
    """Training-mode batch normalization of channels c0..c1-1 of x (N, C, L) into y.

    Per channel: its mean (per-sample row sums added in float64), its biased variance (centered,
    same accumulation), then y = a * x + b with a = weight / sqrt(var + eps), b = bias - mean * a
    computed in float64 and applied in x's dtype. mean and var (float64, (C,)) receive the statistics.
    """
    n_, l_ = x.shape[0], x.shape[2]
    m = n_ * l_
    t = x.dtype.type
    for c in range(c0, c1):
        s = 0.0
        for n in range(n_):
            s += _row_sum(x[n, c])
        mu = s / m
        mf = t(mu)
        v = 0.0
        for n in range(n_):
            r = x[n, c]
            q = t(0)
            for i in range(l_):
                d = r[i] - mf
                q += d * d
            v += np.float64(q)
        # the mean rounded to x's dtype is what was subtracted; correct for the difference
        v = v / m - (mu - np.float64(mf)) ** 2
        mean[c], var[c] = mu, v
        a = weight[c] / np.sqrt(v + eps)
        b = bias[c] - mu * a
        af, bf = t(a), t(b)
        for n in range(n_):
            r, o = x[n, c], y[n, c]
            for i in range(l_):
                o[i] = af * r[i] + bf


@_jit
def batchnorm_backward(dy, x, mean, inv_std, weight, dx, db, dw, c0, c1):
    """Gradients of batchnorm_forward for channels c0..c1-1: db = sum(dy), dw = sum(dy * xhat)
    (float64, (C,)), and dx = k1 * dy + k2 * x + k0 with the per-channel coefficients of
    dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), scale = weight * inv_std."""
    n_, l_ = x.shape[0], x.shape[2]
    m = n_ * l_
    t = x.dtype.type
    for c in range(c0, c1):
        mu, inv = mean[c], inv_std[c]
        mf = t(mu)
        sdy = sdx = 0.0
        for n in range(n_):
            g, r = dy[n, c], x[n, c]
            p = q = t(0)
            for i in range(l_):
                p += g[i]
                q += g[i] * (r[i] - mf)
            sdy += np.float64(p)
            sdx += np.float64(q)
        sdx -= (mu - np.float64(mf)) * sdy  # centered on the float64 mean
        db[c], dw[c] = sdy, sdx * inv
        scale = weight[c] * inv
        k2 = -scale * inv * (sdx * inv / m)
        k0 = -scale * (sdy / m) - k2 * mu
        k1f, k2f, k0f = t(scale), t(k2), t(k0)
        for n in range(n_):
            g, r, o = dy[n, c], x[n, c], dx[n, c]
            for i in range(l_):
                o[i] = k1f * g[i] + k2f * r[i] + k0f
