"""Training-mode batch normalization: every pass over one channel's samples while they are in cache; layer
normalization: every pass over one row (a token's features) while it is in cache."""

import numba
import numpy as np

from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit


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


@_pjit
def batchnorm_forward_chunks(n, t, x, weight, bias, eps, y, mean, var):
    for i in numba.prange(t):
        batchnorm_forward(x, weight, bias, eps, y, mean, var, n * i // t, n * (i + 1) // t)


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


@_pjit
def batchnorm_backward_chunks(n, t, dy, x, mean, inv_std, weight, dx, db, dw):
    for i in numba.prange(t):
        batchnorm_backward(dy, x, mean, inv_std, weight, dx, db, dw, n * i // t, n * (i + 1) // t)


@_jit
def layernorm_forward(x, weight, bias, eps, y, xhat, inv_std, lo, hi):
    """Layer normalization of rows lo..hi-1 of x (R, D): the row's mean and biased variance (centered) in
    float64, xhat = (x - mean) * inv_std and y = xhat * weight + bias in x's dtype; inv_std (R,) receives
    1 / sqrt(var + eps) in x's dtype."""
    d = x.shape[1]
    t = x.dtype.type
    for r in range(lo, hi):
        xr, hr, yr = x[r], xhat[r], y[r]
        s = 0.0
        for j in range(d):
            s += np.float64(xr[j])
        mu = s / d
        q = 0.0
        for j in range(d):
            c = np.float64(xr[j]) - mu
            q += c * c
        mf, inv = t(mu), t(1.0 / np.sqrt(q / d + eps))
        for j in range(d):
            h = (xr[j] - mf) * inv
            hr[j] = h
            yr[j] = h * weight[j] + bias[j]
        inv_std[r] = inv


@_pjit
def layernorm_forward_chunks(n, t, x, weight, bias, eps, y, xhat, inv_std):
    for i in numba.prange(t):
        layernorm_forward(x, weight, bias, eps, y, xhat, inv_std, n * i // t, n * (i + 1) // t)


@_jit
def layernorm_backward(dy, xhat, inv_std, weight, dx, lo, hi):
    """dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight, for rows lo..hi-1 of (R, D), the
    two means accumulated in float64."""
    d = dy.shape[1]
    t = dy.dtype.type
    for r in range(lo, hi):
        gr, hr, dr = dy[r], xhat[r], dx[r]
        s1, s2 = 0.0, 0.0
        for j in range(d):
            g = gr[j] * weight[j]
            s1 += np.float64(g)
            s2 += np.float64(g * hr[j])
        m1, m2, inv = t(s1 / d), t(s2 / d), inv_std[r]
        for j in range(d):
            dr[j] = inv * (gr[j] * weight[j] - m1 - hr[j] * m2)


@_pjit
def layernorm_backward_chunks(n, t, dy, xhat, inv_std, weight, dx):
    for i in numba.prange(t):
        layernorm_backward(dy, xhat, inv_std, weight, dx, n * i // t, n * (i + 1) // t)
