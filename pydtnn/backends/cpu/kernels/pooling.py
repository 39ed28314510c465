"""Max and average pooling over 2x2 windows at stride 2: one pass each way; max pooling over any other
windows (size, stride, dilation, padding): one pass each way too."""

import numba
import numpy as np

from pydtnn.backends.cpu.kernels.jit import exact as _exact
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit


@numba.njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _max(a, b):
    """np.maximum(a, b) bit for bit: NaN in either goes through; of two equal values (0.0 and -0.0)
    b, as x86's maxps gives."""
    return a if (a > b or np.isnan(a)) else b


@numba.njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _window_max(xf, a0, a1):
    """(max, i*2 + j of the first maximum) of the 2x2 window at flat indices a0, a0+1 (row 0) and
    a1, a1+1 (row 1); the NumPy path's steps: positions in order, a position wins when it is greater
    than the running maximum, which np.maximum's rule updates (NaN sticks)."""
    u = np.uint64
    a, b, d, e = xf[a0], xf[a0 + u(1)], xf[a1], xf[a1 + u(1)]
    k = np.uint8(1) if b > a else np.uint8(0)
    m = _max(a, b)
    k = np.uint8(2) if d > m else k
    m = _max(m, d)
    return _max(m, e), (np.uint8(3) if e > m else k)


@numba.njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _windows(p, h, w, ho, wo):
    """(first input index, first output index, outputs) of channel plane p, and the jump from the
    end of an output row's windows to the next row's start."""
    u = np.uint64
    return u(p * h * w), u(p * ho * wo), u(ho * wo), u(2 * w - 2 * wo)


@numba.njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _next_window(a0, j, wo, jump):
    """(first input index, output column) of the window after (a0, j): two columns on, and past the
    second input row at the end of an output row."""
    if j + 1 == wo:
        return a0 + np.uint64(2) + jump, 0
    return a0 + np.uint64(2), j + 1


@_exact
def maxpool2x2_forward(x, y, idx, keep, lo, hi):
    """y = max over each 2x2 window of x (N, C, H, W) and, with keep, idx (uint8) = i*2 + j of its
    first maximum, for samples lo..hi-1. One running index per plane (no views, no row loops:
    VGG's last planes are 2x2, where those cost more than the work)."""
    c_, h, w = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = y.shape[2], y.shape[3]
    xf, yf, kf = x.reshape(-1), y.reshape(-1), idx.reshape(-1)
    u = np.uint64
    for p in range(lo * c_, hi * c_):
        a0, o0, size, jump = _windows(p, h, w, ho, wo)
        j = 0
        for o in range(o0, o0 + size):
            m, k = _window_max(xf, a0, a0 + u(w))
            yf[o] = m
            if keep:
                kf[o] = k
            a0, j = _next_window(a0, j, wo, jump)


@_pjit
def maxpool2x2_forward_chunks(n, t, x, y, idx, keep):
    for i in numba.prange(t):
        maxpool2x2_forward(x, y, idx, keep, n * i // t, n * (i + 1) // t)


@_exact
def maxpool2x2_backward(dy, idx, dx, lo, hi):
    """dx = dy at the window position idx names, +0.0 elsewhere (rows and columns no window covers
    included), for samples lo..hi-1. dy and dx are the float arrays' bits as integers of the same
    width: dy's bits and'ed with an all-ones or all-zeros mask, no float compare or branch."""
    c_, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    h, w = dx.shape[2], dx.shape[3]
    gf, kf, xf = dy.reshape(-1), idx.reshape(-1), dx.reshape(-1)
    t = dx.dtype.type
    zero = t(0)
    u = np.uint64
    for p in range(lo * c_, hi * c_):
        if 2 * ho < h or 2 * wo < w:  # odd height or width: the last row or column is in no window
            xf[p * h * w : (p + 1) * h * w] = zero
        a0, o0, size, jump = _windows(p, h, w, ho, wo)
        j = 0
        for o in range(o0, o0 + size):
            v, k = gf[o], kf[o]
            a1 = a0 + u(w)
            xf[a0] = v & (zero - t(k == 0))
            xf[a0 + u(1)] = v & (zero - t(k == 1))
            xf[a1] = v & (zero - t(k == 2))
            xf[a1 + u(1)] = v & (zero - t(k == 3))
            a0, j = _next_window(a0, j, wo, jump)


@_pjit
def maxpool2x2_backward_chunks(n, t, dy, idx, dx):
    for i in numba.prange(t):
        maxpool2x2_backward(dy, idx, dx, n * i // t, n * (i + 1) // t)


@_exact
def maxpool_forward(x, y, idx, keep, kh, kw, sh, sw, dh, dw, pt, pl, lo, hi):
    """y = max over each window of x (N, C, H, W) and, with keep, idx = i*kw + j of its first maximum,
    for samples lo..hi-1. Window (oi, oj) reads rows oi*sh - pt + i*dh and columns oj*sw - pl + j*dw;
    those outside x are padding, never a maximum (-inf where a window holds padding alone, index 0).
    The NumPy path's rule: positions in order, a position wins when it is greater than the running
    maximum, which np.maximum's rule updates (NaN sticks)."""
    c_, h, w = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = y.shape[2], y.shape[3]
    lowest = -np.inf
    for s in range(lo, hi):
        for c in range(c_):
            xp = x[s, c]
            for oi in range(ho):
                r0 = oi * sh - pt
                for oj in range(wo):
                    c0 = oj * sw - pl
                    m = y.dtype.type(lowest)
                    k = 0
                    for i in range(kh):
                        r = r0 + i * dh
                        if r < 0 or r >= h:
                            continue
                        for j in range(kw):
                            q = c0 + j * dw
                            if q < 0 or q >= w:
                                continue
                            v = xp[r, q]
                            if v > m:
                                k = i * kw + j
                            m = _max(m, v)
                    y[s, c, oi, oj] = m
                    if keep:
                        idx[s, c, oi, oj] = k


@_pjit
def maxpool_forward_chunks(n, t, x, y, idx, keep, kh, kw, sh, sw, dh, dw, pt, pl):
    for i in numba.prange(t):
        maxpool_forward(x, y, idx, keep, kh, kw, sh, sw, dh, dw, pt, pl, n * i // t, n * (i + 1) // t)


@_exact
def maxpool_backward(dy, idx, dx, kw, sh, sw, dh, dw, pt, pl, disjoint, lo, hi):
    """dx = each window's dy at the input its idx names, +0.0 where no window's maximum lies, for
    samples lo..hi-1 (dx's planes zeroed here). Disjoint windows copy dy; overlapping ones add it in
    the NumPy path's order, kernel position by kernel position, which for one input is the outputs
    from last to first: the same sums bit for bit. A maximum's position in padding (a window of
    padding and NaN or -inf) routes nowhere."""
    c_, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    h, w = dx.shape[2], dx.shape[3]
    zero = dx.dtype.type(0)
    for s in range(lo, hi):
        for c in range(c_):
            dp = dx[s, c]
            dp[...] = zero
            for oi in range(ho - 1, -1, -1):
                for oj in range(wo - 1, -1, -1):
                    k = np.int64(idx[s, c, oi, oj])
                    i = k // kw
                    r = oi * sh - pt + i * dh
                    q = oj * sw - pl + (k - i * kw) * dw
                    if r < 0 or r >= h or q < 0 or q >= w:
                        continue
                    if disjoint:
                        dp[r, q] = dy[s, c, oi, oj]
                    else:
                        dp[r, q] += dy[s, c, oi, oj]


@_pjit
def maxpool_backward_chunks(n, t, dy, idx, dx, kw, sh, sw, dh, dw, pt, pl, disjoint):
    for i in numba.prange(t):
        maxpool_backward(dy, idx, dx, kw, sh, sw, dh, dw, pt, pl, disjoint, n * i // t, n * (i + 1) // t)


@_exact
def avgpool2x2_forward(x, y, lo, hi):
    """y = mean of each 2x2 window of x (N, C, H, W) for samples lo..hi-1: the NumPy path's sum in
    its order (row 0, then row 1), then the division by 4, so the same bits."""
    c_, h, w = x.shape[1], x.shape[2], x.shape[3]
    ho, wo = y.shape[2], y.shape[3]
    xf, yf = x.reshape(-1), y.reshape(-1)
    four = x.dtype.type(4)
    u = np.uint64
    for p in range(lo * c_, hi * c_):
        a0, o0, size, jump = _windows(p, h, w, ho, wo)
        j = 0
        for o in range(o0, o0 + size):
            a1 = a0 + u(w)
            yf[o] = (xf[a0] + xf[a0 + u(1)] + xf[a1] + xf[a1 + u(1)]) / four
            a0, j = _next_window(a0, j, wo, jump)


@_pjit
def avgpool2x2_forward_chunks(n, t, x, y):
    for i in numba.prange(t):
        avgpool2x2_forward(x, y, n * i // t, n * (i + 1) // t)


@_exact
def avgpool2x2_backward(dy, dx, lo, hi):
    """dx = dy / 4 at each position of its window, 0 where no window covers, for samples lo..hi-1."""
    c_, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    h, w = dx.shape[2], dx.shape[3]
    gf, xf = dy.reshape(-1), dx.reshape(-1)
    four = dx.dtype.type(4)
    u = np.uint64
    for p in range(lo * c_, hi * c_):
        if 2 * ho < h or 2 * wo < w:  # odd height or width: the last row or column is in no window
            xf[p * h * w : (p + 1) * h * w] = 0
        a0, o0, size, jump = _windows(p, h, w, ho, wo)
        j = 0
        for o in range(o0, o0 + size):
            v = gf[o] / four
            a1 = a0 + u(w)
            xf[a0] = v
            xf[a0 + u(1)] = v
            xf[a1] = v
            xf[a1 + u(1)] = v
            a0, j = _next_window(a0, j, wo, jump)


@_pjit
def avgpool2x2_backward_chunks(n, t, dy, dx):
    for i in numba.prange(t):
        avgpool2x2_backward(dy, dx, n * i // t, n * (i + 1) // t)
