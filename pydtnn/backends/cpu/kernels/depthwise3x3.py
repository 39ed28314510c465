"""Depthwise 3x3 stride-1 convolution: each output row a 9-tap sum over one channel, a loop LLVM vectorizes."""

import numba
import numpy as np

from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit
from pydtnn.backends.cpu.kernels.vectors import pad_into, rounded


@numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True, inline="always")
def _taps(acc, xr, ws, o1, o2, j1, j2):
    """acc[q] = sum over the 3x3 taps of ws[i, j] * xr[q + i*o1 + j*j1]."""
    u = np.uint64
    w00, w01, w02 = ws[0, 0], ws[0, 1], ws[0, 2]
    w10, w11, w12 = ws[1, 0], ws[1, 1], ws[1, 2]
    w20, w21, w22 = ws[2, 0], ws[2, 1], ws[2, 2]
    # unsigned indices: with signed ones the negative-index check stops LLVM from vectorizing
    for q in range(acc.shape[0]):
        a = u(q)
        b = a + o1
        c = a + o2
        acc[a] = (
            w00 * xr[a] + w01 * xr[a + j1] + w02 * xr[a + j2]
            + w10 * xr[b] + w11 * xr[b + j1] + w12 * xr[b + j2]
            + w20 * xr[c] + w21 * xr[c + j1] + w22 * xr[c + j2]
        )  # fmt: skip


@_jit
def depthwise3x3_forward(x, w, y, pt, pl, dh, dw, n0, n1):
    """y[n] = conv(x[n], w) for samples n0..n1-1 of a depthwise 3x3 stride-1 convolution: x (N, C,
    H, W), w (C, 1, 3, 3), y (N, C, Ho, Wo); output channel c reads input channel c only.

    Dilation (dh, dw), padding pt/pl at the top/left (bottom/right follow from y's size).
    """
    c_ = x.shape[1]
    ho, wo = y.shape[2], y.shape[3]
    wp = wo + 2 * dw
    hp = ho + 2 * dh
    length = rounded(ho * wp)
    xs = np.zeros((c_, length + 2 * dh * wp + 2 * dw), x.dtype)
    acc = np.empty(length, x.dtype)
    o1, o2, j1, j2 = np.uint64(dh * wp), np.uint64(2 * dh * wp), np.uint64(dw), np.uint64(2 * dw)
    for n in range(n0, n1):
        pad_into(xs, 0, x[n], pt, pl, hp, wp, 0, c_)
        for c in range(c_):
            _taps(acc, xs[c], w[c, 0], o1, o2, j1, j2)
            for r in range(ho):
                y[n, c, r, :] = acc[r * wp : r * wp + wo]


@_pjit
def depthwise3x3_forward_chunks(n, t, x, w, y, pt, pl, dh, dw):
    for i in numba.prange(t):
        depthwise3x3_forward(x, w, y, pt, pl, dh, dw, n * i // t, n * (i + 1) // t)


@_jit
def depthwise3x3_weight_grad(x, dy, dwt, pt, pl, dh, dw, c0, c1):
    """dwt[c] = sum over samples of the correlation of dy[:, c] with x[:, c], for c0 <= c < c1.

    x (N, C, H, W), dy (N, C, Ho, Wo), dwt (C, 1, 3, 3). Each tap is a dot product over the wide grid
    (dy is zero in the dropped columns); per-sample partial sums are added in float64.
    """
    n_ = x.shape[0]
    ho, wo = dy.shape[2], dy.shape[3]
    wp = wo + 2 * dw
    hp = ho + 2 * dh
    length = rounded(ho * wp)
    xs = np.zeros((x.shape[1], length + 2 * dh * wp + 2 * dw), x.dtype)
    dr = np.zeros(length, x.dtype)
    tot = np.zeros((c1 - c0, 9), np.float64)
    zero = x.dtype.type(0)
    u = np.uint64
    o1, o2, j1, j2 = u(dh * wp), u(2 * dh * wp), u(dw), u(2 * dw)
    for n in range(n_):
        pad_into(xs, 0, x[n], pt, pl, hp, wp, c0, c1)
        for c in range(c0, c1):
            for r in range(ho):
                dr[r * wp : r * wp + wo] = dy[n, c, r, :]
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
            t = tot[c - c0]
            t[0] += s0
            t[1] += s1
            t[2] += s2
            t[3] += s3
            t[4] += s4
            t[5] += s5
            t[6] += s6
            t[7] += s7
            t[8] += s8
    for c in range(c0, c1):
        for i in range(3):
            for j in range(3):
                dwt[c, 0, i, j] = tot[c - c0, i * 3 + j]


@_pjit
def depthwise3x3_weight_grad_chunks(n, t, x, dy, dwt, pt, pl, dh, dw):
    for i in numba.prange(t):
        depthwise3x3_weight_grad(x, dy, dwt, pt, pl, dh, dw, n * i // t, n * (i + 1) // t)
