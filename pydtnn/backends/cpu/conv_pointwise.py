"""One-group 1x1 stride-1 convolution: GEMMs on x and dy as they lie (im2col of a 1x1 kernel would only
regroup x)."""

import numpy as np

from pydtnn.backends.cpu.scratch import Kept


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
