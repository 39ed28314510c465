"""Winograd F(2x2, 3x3) transforms of a one-group 3x3 stride-1 convolution (Lavin and Gray, 2016).

The output is cut into 2x2 tiles; tile t = (n * th + i) * tw + j reads the 4x4 input patch at
(2i - pt, 2j - pl), zero outside the input. With d that patch and g a 3x3 filter,

    V = B^T d B        (16 values per tile and input channel; additions only)
    U = G g G^T        (16 values per filter pair; made once per call on the host)
    M[xi] = U[xi] @ V[xi]  for each of the 16 positions xi: 16 GEMMs (K x C) @ (C x T), by BLAS
    Y = A^T M A        (the 2x2 output of the tile; additions only)

with B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], A^T = [[1, 1, 1, 0],
[0, 1, -1, -1]]. 2.25x fewer multiplications than the direct convolution, paid for by the
transforms' memory traffic: V and M are 4x the input's and the output's size.

input_transform writes V (16, C, T) for samples n0..n1-1 (each tile's 16 values are one column of
the 16 matrices); output_transform reads M (16, K, T) and writes y (N, K, Ho, Wo) for samples
n0..n1-1, dropping the tile rows and columns past Ho and Wo.

The weight gradient is Winograd F(3x3, 2x2), the same identity read for the filter: with e the 2x2
tile of dy (zero past Ho and Wo) and d the tile's input patch as above,

    Z = A e A^T        (16 values per tile and output channel; grad_transform, additions only)
    P[xi] = Z[xi] @ V[xi]^T  for each position: 16 GEMMs (K x T) @ (T x C), the sum over tiles inside
    dw = G^T P G       (the 3x3 filter gradient of each pair; one GEMM on the host)

since sum over the tile of e * (A^T (U . V) A) = sum of Z . U . V, and U = G g G^T is linear in g.
"""

import numba
import numpy as np

from pydtnn.backends.cpu.kernels.jit import jit as _jit


@_jit
def input_transform(x, v, pt, pl, th, tw, n0, n1):
    c_, h, w = x.shape[1], x.shape[2], x.shape[3]
    hp, wp = 2 * th + 2, 2 * tw + 2
    pad = np.zeros((hp, wp), dtype=x.dtype)  # one channel, zero around: the tiles need no bounds checks
    e = np.empty((4, 4, tw), dtype=x.dtype)  # a row of tiles after the column transform
    r0, r1 = max(0, -pt), min(h, hp - pt)
    s0, s1 = max(0, -pl), min(w, wp - pl)
    for n in range(n0, n1):
        for c in range(c_):
            for r in range(r0, r1):
                for s in range(s0, s1):
                    pad[r + pt, s + pl] = x[n, c, r, s]
            for i in range(th):
                t0 = (n * th + i) * tw
                for a in range(4):  # d B, along each of the patch's rows, for the whole row of tiles
                    row = 2 * i + a
                    for j in range(tw):
                        d0, d1, d2, d3 = pad[row, 2 * j], pad[row, 2 * j + 1], pad[row, 2 * j + 2], pad[row, 2 * j + 3]
                        e[a, 0, j] = d0 - d2
                        e[a, 1, j] = d1 + d2
                        e[a, 2, j] = d2 - d1
                        e[a, 3, j] = d1 - d3
                for b in range(4):  # B^T (d B), down the columns
                    for j in range(tw):
                        e0, e1, e2, e3 = e[0, b, j], e[1, b, j], e[2, b, j], e[3, b, j]
                        v[b, c, t0 + j] = e0 - e2
                        v[4 + b, c, t0 + j] = e1 + e2
                        v[8 + b, c, t0 + j] = e2 - e1
                        v[12 + b, c, t0 + j] = e1 - e3


@numba.njit(parallel=True, nogil=True, cache=True)
def input_transform_chunks(n, t, x, v, pt, pl, th, tw):
    for i in numba.prange(t):
        input_transform(x, v, pt, pl, th, tw, n * i // t, n * (i + 1) // t)


@_jit
def output_transform(m, y, th, tw, n0, n1):
    k_, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    o = np.empty((2, 2 * tw), dtype=y.dtype)  # the two output rows of a row of tiles
    for n in range(n0, n1):
        for k in range(k_):
            for i in range(th):
                t0 = (n * th + i) * tw
                for j in range(tw):
                    t = t0 + j
                    p0 = m[0, k, t] + m[4, k, t] + m[8, k, t]  # A^T M, its two rows
                    p1 = m[1, k, t] + m[5, k, t] + m[9, k, t]
                    p2 = m[2, k, t] + m[6, k, t] + m[10, k, t]
                    p3 = m[3, k, t] + m[7, k, t] + m[11, k, t]
                    q0 = m[4, k, t] - m[8, k, t] - m[12, k, t]
                    q1 = m[5, k, t] - m[9, k, t] - m[13, k, t]
                    q2 = m[6, k, t] - m[10, k, t] - m[14, k, t]
                    q3 = m[7, k, t] - m[11, k, t] - m[15, k, t]
                    o[0, 2 * j] = p0 + p1 + p2  # (A^T M) A
                    o[0, 2 * j + 1] = p1 - p2 - p3
                    o[1, 2 * j] = q0 + q1 + q2
                    o[1, 2 * j + 1] = q1 - q2 - q3
                for r in range(min(2, ho - 2 * i)):
                    for s in range(wo):
                        y[n, k, 2 * i + r, s] = o[r, s]


@numba.njit(parallel=True, nogil=True, cache=True)
def output_transform_chunks(n, t, m, y, th, tw):
    for i in numba.prange(t):
        output_transform(m, y, th, tw, n * i // t, n * (i + 1) // t)


@_jit
def grad_transform(dy, z, th, tw, n0, n1):
    """Z = A e A^T of every 2x2 tile e of dy (N, K, Ho, Wo), samples n0..n1-1, into z (16, K, T), with
    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]: e's rows and columns past Ho and Wo are zeros."""
    k_, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    pad = np.zeros((2 * th, 2 * tw), dtype=dy.dtype)  # one channel; only [0, Ho) x [0, Wo) is ever written
    e = np.empty((2, 4, tw), dtype=dy.dtype)  # a row of tiles after the column transform
    for n in range(n0, n1):
        for k in range(k_):
            for r in range(ho):
                for s in range(wo):
                    pad[r, s] = dy[n, k, r, s]
            for i in range(th):
                t0 = (n * th + i) * tw
                for a in range(2):  # e A^T, along each of the tile's two rows
                    row = 2 * i + a
                    for j in range(tw):
                        g0, g1 = pad[row, 2 * j], pad[row, 2 * j + 1]
                        e[a, 0, j] = g0
                        e[a, 1, j] = g0 + g1
                        e[a, 2, j] = g0 - g1
                        e[a, 3, j] = -g1
                for b in range(4):  # A (e A^T), down the columns
                    for j in range(tw):
                        e0, e1 = e[0, b, j], e[1, b, j]
                        z[b, k, t0 + j] = e0
                        z[4 + b, k, t0 + j] = e0 + e1
                        z[8 + b, k, t0 + j] = e0 - e1
                        z[12 + b, k, t0 + j] = -e1


@numba.njit(parallel=True, nogil=True, cache=True)
def grad_transform_chunks(n, t, dy, z, th, tw):
    for i in numba.prange(t):
        grad_transform(dy, z, th, tw, n * i // t, n * (i + 1) // t)
