"""Winograd F(2x2, 3x3) convolution of one-group 3x3 stride-1 layers (kernels/winograd.py): a candidate
the measured algorithm choice (autotune.py) may take where it is faster, never the threshold choice.

Forward: the input transform split over samples, the 16 GEMMs (K x C) @ (C x T) split over the 16
positions (BLAS, one thread each), the output transform split over samples. dx is the same
convolution of dy with the flipped, transposed weights (padding 2 - p on each side). dw is Winograd
F(3x3, 2x2) from x, which forward keeps (not copied): x's and dy's transforms split over samples, the
16 GEMMs (K x T) @ (T x C) over the positions, and G^T P G as one GEMM. cost() counts its work.
"""

import numpy as np

from pydtnn.backends.cpu.scratch import Kept
from pydtnn.backends.geometry import macs

# G of F(2x2, 3x3): U = G g G^T
G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
GG = np.kron(G, G)  # (16, 9): position 4a + b of U from tap 3i + j of g


def winograd_ok(g, co):
    """One group, 3x3, stride 1, no dilation, padding at most 2 on every side (so dx's is at least 0)."""
    return ((g.kh, g.kw, g.sh, g.sw, g.dh, g.dw, g.groups) == (3, 3, 1, 1, 1, 1, 1)
            and 0 <= min(g.pt, g.pb, g.pl, g.pr) and max(g.pt, g.pb, g.pl, g.pr) <= 2)


def eligible(g, co, kernels, tuning):
    """winograd_ok, with the compiled kernels (its transforms)."""
    return kernels == "numba" and winograd_ok(g, co)


def transformed_weights(w):
    """U (16, K, C) = G w G^T for each filter pair, in w's dtype (G's entries are exact in binary): one
    GEMM, since vec(G g G^T) = (G kron G) vec(g)."""
    k, c = w.shape[0], w.shape[1]
    return (GG.astype(w.dtype) @ w.reshape(k * c, 9).T).reshape(16, k, c)


def convolve(b, x, u, pt, pl, ho, wo, g, tag):
    """y (N, K, ho, wo) = the 3x3 stride-1 convolution of x (N, C, H, W) with transformed weights u, the
    input padded by pt above and pl to the left (zeros wherever a tile reads outside x). Forward and dx
    share the pooled V and M of a layer (one tag) where their shapes agree (C = K, same padding)."""
    from pydtnn.backends.cpu.kernels import winograd as wk

    x = np.ascontiguousarray(x)
    n, c = x.shape[0], x.shape[1]
    k = u.shape[1]
    th, tw = -(-ho // 2), -(-wo // 2)
    t = n * th * tw
    vkey, v = b.pool.take(f"{tag}_v", (16, c, t), x.dtype, g)
    b.split_compiled(wk.input_transform, wk.input_transform_chunks, n, (x, v, pt, pl, th, tw), v.nbytes)
    mkey, m = b.pool.take(f"{tag}_m", (16, k, t), x.dtype, g)

    def products(lo, hi):
        np.matmul(u[lo:hi], v[lo:hi], out=m[lo:hi])

    b.split(16, products, b.gemm_bytes(2 * 16 * k * c * t, v))
    b.pool.give(vkey, v)
    y = np.empty((n, k, ho, wo), x.dtype)
    b.split_compiled(wk.output_transform, wk.output_transform_chunks, n, (m, y, th, tw), m.nbytes)
    b.pool.give(mkey, m)
    return y


def forward(b, x, w, g, keep):
    """y by Winograd; with keep, x itself for the weight gradient."""
    x = np.ascontiguousarray(x)
    y = convolve(b, x, transformed_weights(w), g.pt, g.pl, g.ho, g.wo, g, "wg")
    return y, (Kept(x) if keep else None)


def weight_grad(b, dy, x, g):
    """dw (K, C, 3, 3) by F(3x3, 2x2) over forward's tiles (kernels/winograd.py): V of x as forward made
    it, Z of dy, P[xi] = Z[xi] @ V[xi]^T, dw = G^T P G for each filter pair."""
    from pydtnn.backends.cpu.kernels import winograd as wk

    n, c, k = x.shape[0], x.shape[1], dy.shape[1]
    th, tw = -(-g.ho // 2), -(-g.wo // 2)
    t = n * th * tw
    vkey, v = b.pool.take("wg_v", (16, c, t), x.dtype, g)
    b.split_compiled(wk.input_transform, wk.input_transform_chunks, n, (x, v, g.pt, g.pl, th, tw), v.nbytes)
    zkey, z = b.pool.take("wg_z", (16, k, t), x.dtype, g)
    b.split_compiled(wk.grad_transform, wk.grad_transform_chunks, n, (dy, z, th, tw), z.nbytes)
    p = np.empty((16, k, c), x.dtype)

    def products(lo, hi):
        for xi in range(lo, hi):
            np.matmul(z[xi], v[xi].T, out=p[xi])

    b.split(16, products, b.gemm_bytes(2 * 16 * k * c * t, v, z))
    b.pool.give(zkey, z)
    b.pool.give(vkey, v)
    return (p.reshape(16, k * c).T @ GG.astype(x.dtype)).reshape(k, c, 3, 3)


def backward(b, dy, w, ctx, g, need_dx):
    dy = np.ascontiguousarray(dy)
    dw = weight_grad(b, dy, ctx.array, g)
    ctx.release()
    if not need_dx:
        return None, dw
    wt = np.ascontiguousarray(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    return convolve(b, dy, transformed_weights(wt), 2 - g.pt, 2 - g.pl, g.h, g.w, g, "wg"), dw


def cost(g, co, n, s, tuning, kernels, need_dx):
    """(kernel class, forward, backward_data, backward_weights), each phase (FLOPs, bytes) for n samples
    of s-byte elements (perfmodel/costs.py's units and rules); T = N*ceil(Ho/2)*ceil(Wo/2) tiles,
    V = 16*C*T and M = 16*Co*T (the transformed input and products); its time is mostly its 16 GEMMs:
    forward         2*macs/2.25 flops (the 16 GEMMs); bytes: x read, V written and read, U (16*Co*C) read,
                    M written and read, y written
    backward_data   the same on dy and the flipped weights, over dx's tiles
    backward_weights F(3x3, 2x2): 2*macs/2.25 flops (the 16 GEMMs (Co x T) @ (T x C)); bytes: x read, V
                    written and read, dy read, Z = 16*Co*T written and read, P (16*Co*C) written and read
    """
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    flops = int(2 * macs(g, co, n) / 2.25)
    t_fwd = n * -(-g.ho // 2) * -(-g.wo // 2)
    t_bwd = n * -(-g.h // 2) * -(-g.w // 2)
    u = 16 * co * g.c
    fwd = (flops, (x + 2 * 16 * g.c * t_fwd + u + 2 * 16 * co * t_fwd + y) * s)
    bwd_d = (flops, (y + 2 * 16 * co * t_bwd + u + 2 * 16 * g.c * t_bwd + x) * s)
    bwd_w = (flops, (x + 2 * 16 * g.c * t_fwd + y + 2 * 16 * co * t_fwd + 2 * u) * s)
    return "gemm", fwd, bwd_d, bwd_w
