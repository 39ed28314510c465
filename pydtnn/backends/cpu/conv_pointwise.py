"""One-group 1x1 stride-1 convolution: GEMMs on x and dy as they lie (im2col of a 1x1 kernel would only
regroup x); the layers it takes (pointwise_ok) and what it costs (cost)."""

import numpy as np

from pydtnn.backends.cpu.scratch import Kept
from pydtnn.backends.geometry import macs


def pointwise_ok(g, co, tuning):
    """A one-group 1x1 convolution, stride 1, no padding, with at least tuning.gemm_min_columns pixels,
    whose weight (co x c) is at most half the size of one sample's x and dy together. Its weight
    gradient adds a weight-sized product per sample; past that size those additions cost more than
    regrouping x and dy for im2col (512 -> 512 at 16x16, batch 64, one thread: 375 against 330 ms a
    forward and backward)."""
    p = g.ho * g.wo
    return (
        (g.kh, g.kw, g.sh, g.sw, g.groups) == (1, 1, 1, 1, 1)
        and not g.padded
        and p >= tuning.gemm_min_columns
        and 2 * co * g.c <= p * (g.c + co)
    )


def eligible(g, co, kernels, tuning):
    """pointwise_ok, with either kernels (NumPy and BLAS only)."""
    return pointwise_ok(g, co, tuning)


def forward(b, x, w, g, keep):
    """y[n] = W (Co, C) @ x[n] (C, H*W) for each sample, split over samples; keeps x for backward."""
    x = np.ascontiguousarray(x)
    n, c, co, p = x.shape[0], g.c, w.shape[0], g.ho * g.wo
    y = np.empty((n, co, g.ho, g.wo), x.dtype)
    w2, x3, y3 = w.reshape(co, c), x.reshape(n, c, p), y.reshape(n, co, p)

    def samples(lo, hi):
        np.matmul(w2, x3[lo:hi], out=y3[lo:hi])

    b.split(n, samples, b.gemm_bytes(2 * n * co * c * p, x, y))
    return y, (Kept(x) if keep else None)


def backward(b, dy, w, ctx, g, need_dx):
    """dw = sum over samples of dy[n] @ x[n]^T: the batch in blocks of tuning.pointwise_block samples,
    split over the threads; each block's products are added in sample order into its partial
    sum, and the partial sums in block order, so the sum does not depend on the thread count.
    (Regrouping x and dy for one GEMM with the batch inside K copies both, which costs more than
    these additions.) dx[n] = W^T @ dy[n], split over samples."""
    x = ctx.array
    n, co, c = dy.shape[0], dy.shape[1], x.shape[1]
    p = dy.shape[2] * dy.shape[3]
    dy3, x3 = np.ascontiguousarray(dy).reshape(n, co, p), x.reshape(n, c, p)
    block = b.tuning.pointwise_block
    blocks = -(-n // block)
    partial = np.zeros((max(blocks, 1), co, c), dy.dtype)

    def weight_grad(b0, b1):
        prod = np.empty((block, co, c), dy.dtype)
        for k0 in range(b0, b1):
            n0 = k0 * block
            m = min(block, n - n0)
            np.matmul(dy3[n0 : n0 + m], x3[n0 : n0 + m].transpose(0, 2, 1), out=prod[:m])
            for k in range(m):
                np.add(partial[k0], prod[k], out=partial[k0])

    b.split(blocks, weight_grad, b.gemm_bytes(2 * n * co * c * p, x, dy))
    ctx.release()
    dw = partial.sum(axis=0).reshape(w.shape)
    if not need_dx:
        return None, dw
    dx = np.empty(x.shape, dy.dtype)
    wt, dx3 = w.reshape(co, c).T, dx.reshape(n, c, p)

    def data_grad(lo, hi):
        np.matmul(wt, dy3[lo:hi], out=dx3[lo:hi])

    b.split(n, data_grad, b.gemm_bytes(2 * n * co * c * p, dx, dy))
    return dx, dw


def cost(g, co, n, s, tuning, kernels, need_dx):
    """(kernel class, forward, backward_data, backward_weights), each phase (FLOPs, bytes) for n samples
    of s-byte elements (perfmodel/costs.py's units and rules); P = H*W:
    forward         2*macs flops; x and W read, y written
    backward_weights 2*macs + N*|W| flops (the per-sample products added up); bytes: x and dy read,
                    each sample's product written (N*|W|*s), added into its block's partial sum
                    (3*N*|W|*s), the B = ceil(N / pointwise_block) partial sums zeroed and summed
                    ((2*B + 1)*|W|*s)
    backward_data   2*macs flops; dy and W read, dx written
    """
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = co * (g.c // g.groups) * g.kh * g.kw * s
    m = macs(g, co, n)
    blocks = -(-n // tuning.pointwise_block)
    fwd = (2 * m, (x + y) * s + w)
    bwd_w = (2 * m + n * co * g.c, (x + y) * s + (4 * n + 2 * blocks + 1) * w)
    return "gemm", fwd, (2 * m, (y + x) * s + w), bwd_w
