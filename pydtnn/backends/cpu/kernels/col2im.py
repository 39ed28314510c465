"""A strided convolution's dx from its per-position shares (col2im), and the flipped, transposed
weights of a stride-1 convolution's dx."""

import numba
import numpy as np

from pydtnn.backends.cpu.isa import VECTOR_BYTES
from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit
from pydtnn.backends.cpu.kernels.vectors import vadd, vzip


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
    lanes = VECTOR_BYTES // dx.itemsize
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
                            vadd(row, k + s, src, k)
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
                        vzip(out, 2 * k, p0, p1, k)
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
