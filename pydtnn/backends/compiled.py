"""Compiled CPU kernels (Numba): the direct 3x3 stride-1 convolution (one group, or depthwise),
training-mode batch normalization, ReLU, 2x2 max and average pooling, the col2im that gives a strided
convolution its dx, dx's flipped and transposed weights, the convolution bias, and the SGD and Adam
updates.

im2col + GEMM copies the input nine times into a matrix that does not fit in cache, and with 16-64
channels the GEMM has too small a dimension for BLAS to reach its peak. These kernels never build
that matrix: each sample's input is padded into a scratch array, and outputs are computed on the
"wide" grid q = ho*Wp + wo (wo running over the padded width Wp, the columns wo >= Wo computed and
dropped), where every tap of the kernel is one fixed offset into the padded input.

- One group: register-blocked kernels written as LLVM IR with explicit vectors (see "dense 3x3"
  below). The forward keeps every sample's padded input for the weight gradient; dx is the forward
  kernel applied to dy with the flipped, transposed weights.
- Depthwise: each output row is a 9-tap sum over one channel, a loop LLVM vectorizes.

The forward and dx work on whole samples, the weight gradient on output channels, so the CPU
backend splits them over its threads and the result does not depend on the thread count: each
kernel's `*_chunks` twin runs its chunks on Numba's threads (threads.split_compiled).

Batch normalization takes one channel at a time through all its passes (statistics, then the affine
map; in backward the two sums, then dx), so the channel's values are still in cache for the second
pass; the CPU backend splits it over channels.

The NumPy path (backends/cpu.py, layers/norm.py) stays the reference and the fallback: it is used
when Numba is not installed, when PYDTNN_CPU_KERNELS=numpy, or when a backend is made with
kernels="numpy"; tests/test_cpu_kernels.py and tests/test_layers.py check that both give the same
results. The CPU backend imports this module (and with it Numba and LLVM, about 100 MB of memory)
only when a layer first uses a kernel.
"""

import os

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_jit = numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True)
# without fastmath's no-NaN and no-infinity assumptions, for kernels whose results depend on them
_exact = numba.njit(nogil=True, error_model="numpy", cache=True)


# Each kernel below computes a range [lo, hi) of samples or channels (its last two arguments); its
# `*_chunks(n, t, ...)` twin runs [0, n) in the t chunks of threads.split on Numba's threads. (One
# generic runner taking the kernel as an argument would not be cached: it compiled again, 1-2 s per
# kernel, in every process.)
_pjit = numba.njit(parallel=True, nogil=True, cache=True)


# After each parallel region libgomp's threads spin this many iterations before they sleep (its
# default, 300,000, is about 8 ms here): long enough to catch the next compiled kernel (waking a
# sleeping thread costs 1-1.5 ms on this VM), short enough to leave the core to the pool's thread
# for the NumPy and BLAS work in between (docs/performance.md). Set before Numba loads libgomp,
# unless the user chose GOMP_SPINCOUNT or OMP_WAIT_POLICY.
GOMP_SPINCOUNT = "30000"


def cache_dir():
    """The folder where Numba caches these kernels, and whether it holds them already (else the first
    use compiles them, 10-30 s). Numba's own choice: next to this file when that is writable, else a
    per-user cache folder (so a read-only install works), or $NUMBA_CACHE_DIR when set."""
    from numba.core.caching import CacheImpl

    for locator in CacheImpl._locator_classes:
        found = locator.from_function(_rounded.py_func, __file__)
        if found is not None:
            path = found.get_cache_path()
            stem = os.path.splitext(os.path.basename(__file__))[0]
            held = os.path.isdir(path) and any(n.startswith(stem + ".") and n.endswith(".nbi")
                                               for n in os.listdir(path))
            return path, held
    return None, False


def launch(chunks, n, t, args):
    """chunks(n, t, *args) on at most t of Numba's threads."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    numba.set_num_threads(min(t, numba.config.NUMBA_NUM_THREADS))
    chunks(n, t, *args)


@_jit
def _rounded(length):
    """length rounded up to whole vectorized iterations (8 lanes x 4 interleaved): for short rows
    (8x8 images) the scalar remainder loop would otherwise cost as much as the vector loop. The
    extra outputs read the zero tail of the scratch input and are never copied out."""
    return (length + 31) // 32 * 32


@_jit
def _pad_into(xs, start, xn, pt, pl, hp, wp, c0, c1):
    """Copy channels c0..c1-1 of one sample xn (C, H, W) into the flat padded grid that starts at
    column `start` of xs (C, *), at (pt, pl); the border is never written, so it stays zero. Rows
    and columns beyond the grid are left out. Both C-contiguous."""
    h, w = xn.shape[1], xn.shape[2]
    cols = min(w, wp - pl)
    ld = xs.shape[1]
    xsf, xf = xs.reshape(xs.size), xn.reshape(xn.size)
    for c in range(c0, c1):
        for r in range(min(h, hp - pt)):
            _copy(xsf, c * ld + start + (r + pt) * wp + pl, xf, (c * h + r) * w, cols)


@_jit
def _copy(dst, di, src, si, count):
    """dst[di : di + count] = src[si : si + count] (1-D contiguous arrays, not overlapping): whole
    vectors, the last one overlapping the one before where count is not a multiple of the lanes."""
    lanes = 32 // dst.itemsize
    if count < lanes:
        for k in range(count):
            dst[di + k] = src[si + k]
        return
    k = 0
    while k + lanes < count:
        _vcopy(dst, di + k, src, si + k)
        k += lanes
    _vcopy(dst, di + count - lanes, src, si + count - lanes)


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
    length = _rounded(ho * wp)
    xs = np.zeros((c_, length + 2 * dh * wp + 2 * dw), x.dtype)
    acc = np.empty(length, x.dtype)
    o1, o2, j1, j2 = np.uint64(dh * wp), np.uint64(2 * dh * wp), np.uint64(dw), np.uint64(2 * dw)
    for n in range(n0, n1):
        _pad_into(xs, 0, x[n], pt, pl, hp, wp, 0, c_)
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
    length = _rounded(ho * wp)
    xs = np.zeros((x.shape[1], length + 2 * dh * wp + 2 * dw), x.dtype)
    dr = np.zeros(length, x.dtype)
    tot = np.zeros((c1 - c0, 9), np.float64)
    zero = x.dtype.type(0)
    u = np.uint64
    o1, o2, j1, j2 = u(dh * wp), u(2 * dh * wp), u(dw), u(2 * dw)
    for n in range(n_):
        _pad_into(xs, 0, x[n], pt, pl, hp, wp, c0, c1)
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


# -- convolution bias: added to y, summed from dy ----------------------------------------------------
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


# -- the flipped, transposed kernel of a stride-1 convolution's dx -------------------------------------
@_jit
def flip_transpose(w, out, lo, hi):
    """out[g, c, o, k] = w[g, o, c, K-1-k] for input channels c in lo..hi-1: w (G, O, C, K = kh*kw)
    -> out (G, C, O, K), the weights of dx as a convolution of dy. NumPy's copy of the transposed,
    reversed view moves 2.6 GB/s (3.6 ms for 512 x 512 x 3 x 3)."""
    groups, co, ci, K = w.shape
    wf, of = w.reshape(-1), out.reshape(-1)
    u = np.uint64
    for g in range(groups):
        for c0 in range(lo, hi, 16):  # 16 channels at a time: each o reads one contiguous run of w
            c1 = min(c0 + 16, hi)
            for o in range(co):
                for c in range(c0, c1):
                    src = u(((g * co + o) * ci + c) * K + K - 1)
                    dst = u(((g * ci + c) * co + o) * K)
                    for k in range(K):
                        of[dst + u(k)] = wf[src - u(k)]


@_pjit
def flip_transpose_chunks(n, t, w, out):
    for i in numba.prange(t):
        flip_transpose(w, out, n * i // t, n * (i + 1) // t)


# -- ReLU: one pass each way, no boolean temporaries ------------------------------------------------------
@_exact
def relu_forward(x, y, lo, hi):
    """y = max(x, 0) over the flat elements lo..hi-1; NaN goes through, as in np.maximum."""
    z = x.dtype.type(0)
    xr, yr = x[lo:hi], y[lo:hi]
    for i in range(xr.shape[0]):  # from 0: no negative-index wraparound to stop the vectorizer
        v = xr[i]
        yr[i] = z if v < z else v


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


# -- max and average pooling 2x2, stride 2: one pass each way -------------------------------------------
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


# -- SGD: one pass over a parameter, its gradient and its momentum buffer -----------------------------
@_exact
def sgd_update(p, g, buf, lr, wd, momentum, keep, nesterov, first, lo, hi):
    """One SGD step (optim/sgd.py) over the flat elements lo..hi-1 of p, g and buf: the NumPy path's
    operations in its order, each rounded to the dtype (no fastmath: no fused multiply-adds), so
    the bits are the same. momentum 0: buf is not touched; keep = 1 - dampening."""
    pr, gr, br = p[lo:hi], g[lo:hi], buf[lo:hi]
    for i in range(pr.shape[0]):  # from 0: no negative-index wraparound to stop the vectorizer
        d = gr[i]
        if wd != 0:
            d = pr[i] * wd + d
        if momentum != 0:
            if first:
                b = d
            elif keep == 1:
                b = br[i] * momentum + d
            else:
                b = br[i] * momentum + d * keep
            br[i] = b
            d = b * momentum + d if nesterov else b
        pr[i] = pr[i] - d * lr


@_pjit
def sgd_update_chunks(n, t, p, g, buf, lr, wd, momentum, keep, nesterov, first):
    for i in numba.prange(t):
        sgd_update(p, g, buf, lr, wd, momentum, keep, nesterov, first, n * i // t, n * (i + 1) // t)


@_exact
def adam_update(p, g, m, v, lr_t, keep1, beta2, keep2, bc2_sqrt, eps, wd, decay, decoupled, lo, hi):
    """One Adam / AdamW step (optim/adam.py) over the flat elements lo..hi-1, the NumPy path's
    operations in its order, each rounded to the dtype: the same bits. keep1 = 1 - beta1, keep2 =
    1 - beta2, lr_t = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * wd."""
    pr, gr, mr, vr = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
    for i in range(pr.shape[0]):
        q = pr[i]
        d = gr[i]
        if wd != 0 and decoupled:
            q = q * decay
        elif wd != 0:
            d = q * wd + d
        a = mr[i] + (d - mr[i]) * keep1
        b = vr[i] * beta2 + (d * d) * keep2
        mr[i] = a
        vr[i] = b
        pr[i] = q - a / (np.sqrt(b) / bc2_sqrt + eps) * lr_t


@_pjit
def adam_update_chunks(n, t, p, g, m, v, lr_t, keep1, beta2, keep2, bc2_sqrt, eps, wd, decay, decoupled):
    for i in numba.prange(t):
        adam_update(p, g, m, v, lr_t, keep1, beta2, keep2, bc2_sqrt, eps, wd, decay, decoupled,
                    n * i // t, n * (i + 1) // t)


# -- dense 3x3 convolution: register-blocked vector kernels --------------------------------------------
# LLVM does not keep a block of accumulators in registers across a reduction loop written in Python,
# so the two inner blocks below are emitted as LLVM IR with explicit 256-bit vectors (8 float32 or 4
# float64 lanes): a forward block of BLOCK_CHANNELS output channels times 2 or 3 vectors of output
# pixels (the loop over input channels and the 9 taps inside, every accumulator in a register), and a
# weight-gradient block of BLOCK_CHANNELS output channels times one row of 3 taps (the loop over
# pixels inside). LLVM splits the vectors where the CPU's are narrower.
BLOCK_CHANNELS = 4


def _vector_of(context, dtype):
    """(element type, lanes, vector type, fma intrinsic name) of 256-bit vectors of dtype."""
    elem = context.get_value_type(dtype)
    lanes = 256 // dtype.bitwidth
    return elem, lanes, ir.VectorType(elem, lanes), f"llvm.fma.v{lanes}f{dtype.bitwidth}"


def _same_dtype(*arrays):
    """Whether these intrinsic arguments are arrays of one dtype: the intrinsics read and write every array
    through vectors of the first one's element type, so a mixed call must not type (it would read
    float32 memory as float64 or the reverse)."""
    return all(isinstance(a, types.Array) for a in arrays) and len({a.dtype for a in arrays}) == 1


class _Emitter:
    """Small helpers over an IRBuilder for one element type."""

    def __init__(self, context, builder, dtype):
        self.b = builder
        self.elem, self.lanes, self.vec, name = _vector_of(context, dtype)
        self.align = dtype.bitwidth // 8
        mod = builder.module
        self.fma_fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(self.vec, [self.vec] * 3), name=name)

    def at(self, base, index):
        return self.b.gep(base, [index], source_etype=self.elem)

    def vload(self, base, index):
        ptr = self.b.bitcast(self.at(base, index), self.vec.as_pointer())
        return self.b.load(ptr, typ=self.vec, align=self.align)

    def vstore(self, value, base, index):
        self.b.store(value, self.b.bitcast(self.at(base, index), self.vec.as_pointer()), align=self.align)

    def splat(self, base, index):
        s = self.b.load(self.at(base, index), typ=self.elem, align=self.align)
        undef = ir.Constant(self.vec, ir.Undefined)
        mask = ir.Constant(ir.VectorType(ir.IntType(32), self.lanes), [0] * self.lanes)
        return self.b.shuffle_vector(self.b.insert_element(undef, s, _I64(0)), undef, mask)

    def fma(self, a, b, c):
        return self.b.call(self.fma_fn, [a, b, c])

    def row_stride(self, ary):
        """Elements between the rows of a 2-D array."""
        return self.b.udiv(self.b.extract_value(ary.strides, 0), _I64(self.align))

    def counted_loop(self, start, stop, step, carried, body):
        """for i in range(start, stop, step) with start < stop: carried values (LLVM values) pass from
        one iteration to the next; body(i, values) returns the next ones. Returns the final ones."""
        b = self.b
        pre = b.block
        loop = b.append_basic_block("loop")
        done = b.append_basic_block("done")
        b.branch(loop)
        b.position_at_end(loop)
        i = b.phi(_I64)
        i.add_incoming(start, pre)
        phis = []
        for v in carried:
            p = b.phi(v.type)
            p.add_incoming(v, pre)
            phis.append(p)
        nxt = body(i, phis)
        i1 = b.add(i, step)
        end = b.block
        i.add_incoming(i1, end)
        for p, v in zip(phis, nxt):
            p.add_incoming(v, end)
        b.cbranch(b.icmp_signed("<", i1, stop), loop, done)
        b.position_at_end(done)
        return nxt


_I64 = ir.IntType(64)


def _forward_block(vectors):
    """The forward block with `vectors` vectors of output pixels (see conv3x3_dense_forward)."""
    m_ = BLOCK_CHANNELS

    @intrinsic
    def block(typingctx, xs, wb, out, offs, cb, q0, o0):
        """out[cb*M + m, o0 + p] = sum over c, k of wb[cb, c, k, m] * xs[c, q0 + offs[k] + p] for the
        M output channels m and the `vectors` vectors of pixels p: xs (C, *), wb (nb, C, 9, M)
        contiguous, out (nb*M, *), offs (9,) int64."""
        if not _same_dtype(xs, wb, out):
            return None
        sig = types.void(xs, wb, out, offs, cb, q0, o0)

        def codegen(context, builder, signature, args):
            e = _Emitter(context, builder, signature.args[0].dtype)
            b = builder
            xa, wa, oa, fa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
            cb_, q0_, o0_ = args[4:]
            c_ = b.extract_value(xa.shape, 0)
            lx, lo = e.row_stride(xa), e.row_stride(oa)
            offs = [b.load(b.gep(fa.data, [_I64(k)], source_etype=_I64), typ=_I64) for k in range(9)]
            xbase = e.at(xa.data, q0_)
            wbase = e.at(wa.data, b.mul(cb_, b.mul(c_, _I64(9 * m_))))
            zero = ir.Constant(e.vec, [0.0] * e.lanes)

            def body(c, acc):
                acc = list(acc)
                xrow = e.at(xbase, b.mul(c, lx))
                wrow = e.at(wbase, b.mul(c, _I64(9 * m_)))
                for k in range(9):
                    xk = e.at(xrow, offs[k])
                    xv = [e.vload(xk, _I64(e.lanes * v)) for v in range(vectors)]
                    for m in range(m_):
                        wv = e.splat(wrow, _I64(k * m_ + m))
                        for v in range(vectors):
                            acc[m * vectors + v] = e.fma(wv, xv[v], acc[m * vectors + v])
                return acc

            acc = e.counted_loop(_I64(0), c_, _I64(1), [zero] * (m_ * vectors), body)
            obase = e.at(oa.data, b.add(b.mul(b.mul(cb_, _I64(m_)), lo), o0_))
            for m in range(m_):
                orow = e.at(obase, b.mul(_I64(m), lo))
                for v in range(vectors):
                    e.vstore(acc[m * vectors + v], orow, _I64(e.lanes * v))
            return context.get_dummy_value()

        return sig, codegen

    return block


_forward_block2, _forward_block3 = _forward_block(2), _forward_block(3)


@intrinsic
def _grad_block(typingctx, xs, dyw, acc, offs, cb, ci, i, n0, n1, lx, span, arow):
    """acc[arow, (m*3 + j)*lanes + l] += sum over the samples n0 <= n < n1 and t = n*lx + l, n*lx +
    lanes + l, ... < n*lx + span of dyw[cb*M + m, t] * xs[ci, t + offs[3*i + j]]: the M x 3 block of
    the weight gradient's row i, as lanes partial sums. xs (C, *), dyw (nb*M, *), acc (*, 3*M*lanes)
    contiguous rows; n0 < n1 and span a positive multiple of lanes."""
    if not _same_dtype(xs, dyw, acc):
        return None
    sig = types.void(xs, dyw, acc, offs, cb, ci, i, n0, n1, lx, span, arow)
    m_ = BLOCK_CHANNELS

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature.args[0].dtype)
        b = builder
        xa, da, aa, fa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
        cb_, ci_, i_, n0_, n1_, lx_, span_, arow_ = args[4:]
        row = b.mul(i_, _I64(3))
        offs = [b.load(b.gep(fa.data, [b.add(row, _I64(j))], source_etype=_I64), typ=_I64) for j in range(3)]
        xrow = e.at(xa.data, b.mul(ci_, e.row_stride(xa)))
        xtaps = [e.at(xrow, offs[j]) for j in range(3)]
        ld = e.row_stride(da)
        drows = [e.at(da.data, b.mul(b.add(b.mul(cb_, _I64(m_)), _I64(m)), ld)) for m in range(m_)]
        abase = e.at(aa.data, b.mul(arow_, e.row_stride(aa)))
        start = [e.vload(abase, _I64(e.lanes * k)) for k in range(3 * m_)]

        def pixels(t, acc):
            acc = list(acc)
            xv = [e.vload(xtaps[j], t) for j in range(3)]
            for m in range(m_):
                dv = e.vload(drows[m], t)
                for j in range(3):
                    acc[m * 3 + j] = e.fma(dv, xv[j], acc[m * 3 + j])
            return acc

        def sample(n, acc):
            t0 = b.mul(n, lx_)
            return e.counted_loop(t0, b.add(t0, span_), _I64(e.lanes), acc, pixels)

        acc = e.counted_loop(n0_, n1_, _I64(1), start, sample)
        for k in range(3 * m_):
            e.vstore(acc[k], abase, _I64(e.lanes * k))
        return context.get_dummy_value()

    return sig, codegen


@_jit
def _tap_offsets(wp, dh, dw):
    offs = np.empty(9, np.int64)
    for i in range(3):
        for j in range(3):
            offs[i * 3 + j] = i * dh * wp + j * dw
    return offs


@_jit
def conv3x3_dense_forward(x, wb, y, xs, lx, per_sample, pt, pl, dh, dw, threes, length, n0, n1):
    """y[n] = conv(x[n], w) for samples n0..n1-1 of a one-group 3x3 stride-1 convolution.

    x (N, C, H, W); wb (nb, C, 9, M) the weight w (Co, C, 3, 3) in blocks of M = BLOCK_CHANNELS output
    channels (zero rows past Co); y (N, Co, Ho, Wo). Each sample is padded into xs (C, *), zero
    outside the image, at column n*lx when per_sample (xs then holds the whole batch, kept for the
    weight gradient; otherwise xs is unused and each call pads into a scratch (C, lx)); lx covers the
    computed columns plus the taps' reach. The first `length` columns of the wide grid q = ho*Wp + wo
    are computed, columns wo >= Wo dropped: `threes` blocks of three vectors, then blocks of two.
    """
    c_ = x.shape[1]
    co_, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    wp = wo + 2 * dw
    hp = ho + 2 * dh
    lanes = 32 // x.itemsize
    split = threes * 3 * lanes
    offs = _tap_offsets(wp, dh, dw)
    out = np.empty((wb.shape[0] * BLOCK_CHANNELS, length), x.dtype)
    buf = xs if per_sample else np.zeros((c_, lx), x.dtype)
    yf, of = y.reshape(y.size), out.reshape(out.size)
    for n in range(n0, n1):
        base = n * lx if per_sample else 0
        _pad_into(buf, base, x[n], pt, pl, hp, wp, 0, c_)
        for cb in range(wb.shape[0]):
            for q in range(0, split, 3 * lanes):
                _forward_block3(buf, wb, out, offs, cb, base + q, q)
            for q in range(split, length, 2 * lanes):
                _forward_block2(buf, wb, out, offs, cb, base + q, q)
        for co in range(co_):
            for r in range(ho):
                _copy(yf, ((n * co_ + co) * ho + r) * wo, of, co * length + r * wp, wo)


@_pjit
def conv3x3_dense_forward_chunks(n, t, x, wb, y, xs, lx, per_sample, pt, pl, dh, dw, threes, length):
    for i in numba.prange(t):
        lo, hi = n * i // t, n * (i + 1) // t
        conv3x3_dense_forward(x, wb, y, xs, lx, per_sample, pt, pl, dh, dw, threes, length, lo, hi)


@_jit
def conv3x3_dense_weight_grad(xs, lx, dy, dyw, dwt, dh, dw, chunk, cb0, cb1):
    """dwt[co] for the output channels of blocks cb0..cb1-1 (co = cb*M + m < Co): the correlation of dy
    with the padded inputs xs that conv3x3_dense_forward kept (per_sample, row stride lx per sample).

    dy (N, Co, Ho, Wo), C-contiguous, is first laid on the same wide grid in dyw (nb*M, N*lx, zeros
    elsewhere; this call writes only its own rows). The sums run over chunks of `chunk` samples (whose
    inputs stay in cache) in lanes of partial sums of the dtype, added in float64 at the end.
    """
    n_, co_, ho, wo = dy.shape
    c_ = xs.shape[0]
    wp = wo + 2 * dw
    lanes = 32 // xs.itemsize
    m_ = BLOCK_CHANNELS
    span = (ho * wp + lanes - 1) // lanes * lanes  # a sample's columns that can hold dy
    offs = _tap_offsets(wp, dh, dw)
    ld = dyw.shape[1]
    dywf, dyf = dyw.reshape(dyw.size), dy.reshape(dy.size)
    for co in range(cb0 * m_, min(cb1 * m_, co_)):
        for n in range(n_):
            for r in range(ho):
                _copy(dywf, co * ld + n * lx + r * wp, dyf, ((n * co_ + co) * ho + r) * wo, wo)
    acc = np.zeros(((cb1 - cb0) * c_ * 3, 3 * m_ * lanes), xs.dtype)
    for n0 in range(0, n_, chunk):
        n1 = min(n0 + chunk, n_)
        for cb in range(cb0, cb1):
            for ci in range(c_):
                for i in range(3):
                    _grad_block(xs, dyw, acc, offs, cb, ci, i, n0, n1, lx, span, ((cb - cb0) * c_ + ci) * 3 + i)
    for cb in range(cb0, cb1):
        for m in range(m_):
            co = cb * m_ + m
            if co >= co_:
                continue
            for ci in range(c_):
                for i in range(3):
                    row = ((cb - cb0) * c_ + ci) * 3 + i
                    for j in range(3):
                        s = 0.0
                        for k in range((m * 3 + j) * lanes, (m * 3 + j + 1) * lanes):
                            s += acc[row, k]
                        dwt[co, ci, i, j] = s


@_pjit
def conv3x3_dense_weight_grad_chunks(n, t, xs, lx, dy, dyw, dwt, dh, dw, chunk):
    for i in numba.prange(t):
        conv3x3_dense_weight_grad(xs, lx, dy, dyw, dwt, dh, dw, chunk, n * i // t, n * (i + 1) // t)


# -- col2im: a strided convolution's dx from its per-position shares -----------------------------------
@intrinsic
def _vadd(typingctx, dst, di, src, si):
    """dst[di : di + lanes] += src[si : si + lanes], one 256-bit vector (1-D contiguous arrays)."""
    if not _same_dtype(dst, src):
        return None
    sig = types.void(dst, di, src, si)

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature.args[0].dtype)
        da, sa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2))
        e.vstore(builder.fadd(e.vload(da.data, args[1]), e.vload(sa.data, args[3])), da.data, args[1])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _vcopy(typingctx, dst, di, src, si):
    """dst[di : di + lanes] = src[si : si + lanes], one 256-bit vector (1-D contiguous arrays)."""
    if not _same_dtype(dst, src):
        return None
    sig = types.void(dst, di, src, si)

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature.args[0].dtype)
        da, sa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2))
        e.vstore(e.vload(sa.data, args[3]), da.data, args[1])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _vzip(typingctx, out, oi, p0, p1, pi):
    """out[oi : oi + 2*lanes] = p0[pi], p1[pi], p0[pi + 1], p1[pi + 1], ... (1-D contiguous arrays)."""
    if not _same_dtype(out, p0, p1):
        return None
    sig = types.void(out, oi, p0, p1, pi)

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature.args[0].dtype)
        oa, a0, a1 = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
        v0, v1 = e.vload(a0.data, args[4]), e.vload(a1.data, args[4])
        n = e.lanes
        for h in range(2):
            mask = [x for k in range(h * n // 2, (h + 1) * n // 2) for x in (k, k + n)]
            zipped = builder.shuffle_vector(v0, v1, ir.Constant(ir.VectorType(ir.IntType(32), n), mask))
            e.vstore(zipped, oa.data, builder.add(args[1], _I64(h * n)))
        return context.get_dummy_value()

    return sig, codegen


@_jit
def col2im(dcols, dx, sh, sw, pt, pl, dh, dw, n0, n1):
    """dx[n] for samples n0..n1-1 (dx (N, C, H, W) overwritten): each kernel position (i, j)'s share
    dcols[n, c, i, j] (Ho, Wo) added back at the input pixels it read, (ho*sh - pt + i*dh, wo*sw -
    pl + j*dw), positions in increasing (i, j) order.

    One channel plane at a time, in cache, summed with its columns split by phase (column b of row
    a at parts[a, b % sw, b // sw]): a position's share of one row then lands on consecutive
    entries, added a vector at a time, and the phases are interleaved into dx once at the end. A
    kernel one column wide puts one share on a column: those are added straight into dx."""
    c_, kh, kw, ho_, wo_ = dcols.shape[1], dcols.shape[2], dcols.shape[3], dcols.shape[4], dcols.shape[5]
    h, w = dx.shape[2], dx.shape[3]
    lanes = 32 // dx.itemsize
    wq = (w + sw - 1) // sw
    parts = np.empty((h, sw, wq), dx.dtype)
    z = dx.dtype.type(0)
    for n in range(n0, n1):
        for c in range(c_):
            plane = dx[n, c]
            if kw == 1:  # one share per column: added straight into dx, no phases to interleave
                plane[:, :] = z
                k0 = max(0, (pl + sw - 1) // sw)
                k1 = min(wo_, (w - 1 + pl) // sw + 1)
                for i in range(kh):
                    for r in range(ho_):
                        a = r * sh - pt + i * dh
                        if a < 0 or a >= h:
                            continue
                        row, src = plane[a], dcols[n, c, i, 0, r]
                        for k in range(k0, k1):
                            row[k * sw - pl] += src[k]
                continue
            for a in range(h):
                for q in range(sw):
                    for k in range(wq):
                        parts[a, q, k] = z
            for i in range(kh):
                for j in range(kw):
                    off = j * dw - pl  # output column k reads input column k*sw + off = (k + s)*sw + q
                    q = off % sw
                    s = (off - q) // sw
                    k0 = max(0, -s)  # the output columns whose input column lies inside the image
                    k1 = min(wo_, (w - q + sw - 1) // sw - s)
                    for r in range(ho_):
                        a = r * sh - pt + i * dh
                        if a < 0 or a >= h:
                            continue
                        row, src = parts[a, q], dcols[n, c, i, j, r]
                        k = k0
                        while k + lanes <= k1:
                            _vadd(row, k + s, src, k)
                            k += lanes
                        while k < k1:
                            row[k + s] += src[k]
                            k += 1
            if sw == 2:
                half = w // 2
                for a in range(h):
                    p0, p1, out = parts[a, 0], parts[a, 1], plane[a]
                    k = 0
                    while k + lanes <= half:
                        _vzip(out, 2 * k, p0, p1, k)
                        k += lanes
                    while k < half:
                        out[2 * k] = p0[k]
                        out[2 * k + 1] = p1[k]
                        k += 1
                    if w % 2:
                        out[w - 1] = p0[half]
            else:
                for a in range(h):
                    for q in range(sw):
                        for k in range((w - q + sw - 1) // sw):
                            plane[a, k * sw + q] = parts[a, q, k]
