"""im2col + GEMM convolution: the CPU backend's general algorithm (any kernel, stride, dilation, groups).

Forward: each sample's input windows are written into a pooled column buffer (C, kh, kw, N, Ho, Wo) and
multiplied by the weights, split over samples so each thread fills and multiplies its own. Backward: dw
is one GEMM over the whole batch (dy regrouped), split over dw's columns; dx is, at stride 1, the
stride-1 convolution of dy with the flipped, transposed weights (one more im2col + GEMM), and at larger
strides W^T dy scattered back into dx (col2im). docs/performance.md explains the layout and its costs;
cost() counts them for the performance model.
"""

import numpy as np

from pydtnn.backends.geometry import macs, positions, touched, transposed


def fill_cols(buf, x, g, lo, hi):
    """Write samples lo..hi-1 of x (N, C, H, W) into buf (C, kh, kw, N, Ho, Wo): buf[(c, i, j), n,
    (ho, wo)] is the input that kernel position (i, j) of channel c sees at output (ho, wo); the
    padding entries are never written (the pool hands out zeroed buffers)."""
    dst = buf.reshape(g.c, g.kh, g.kw, -1, g.ho, g.wo).transpose(3, 0, 1, 2, 4, 5)[lo:hi]
    for _, i, j, orows, ocols, irows, icols in positions(g):
        dst[:, :, i, j, orows, ocols] = x[lo:hi, :, irows, icols]


def as_gemm(buf, g):
    """The (G, Cg*kh*kw, N, Ho*Wo) view of an im2col buffer."""
    return buf.reshape(g.groups, g.c // g.groups * g.kh * g.kw, -1, g.ho * g.wo)


def gemm_nchw(wm, cols, out):
    """out (N, G*O, Ho, Wo) = wm (G, O, K) @ cols (G, K, N, P) per group and sample, written in place.

    Each (K, P) slice of cols is a strided matrix BLAS reads directly, so neither the cols nor
    the product is transposed in memory."""
    n = out.shape[0]
    g, o, _ = wm.shape
    np.matmul(wm[:, None], cols.transpose(0, 2, 1, 3), out=out.reshape(n, g, o, -1).transpose(1, 0, 2, 3))


def conv_gemm(b, x, wm, g, out, tag, cols=None):
    """out (N, G*O, Ho, Wo) = conv(x, wm (G, O, K)) by im2col + GEMM, both split over samples: each
    thread fills the columns of its samples, then multiplies them. (Filling and multiplying a few
    samples at a time, to stay in cache, measured slower with two threads: many small NumPy calls
    make the threads queue for the GIL.) Returns (key, buf), the pooled im2col buffer; with cols
    (G, K, N, P) given, already filled (a 1x1 layer's dx reads dy regrouped), (None, None).

    With many output pixels each sample is one GEMM written straight into NCHW. With few, one
    GEMM per block of samples (at least tuning.gemm_min_columns columns) reads the weight once per
    block instead of once per sample, and a copy reorders the block into NCHW. Blocks start at fixed
    samples, so the thread count never changes a result."""
    n = x.shape[0]
    fill = cols is None
    key = buf = None
    if fill:
        key, buf = b.pool.take(tag, (g.c, g.kh, g.kw, n, g.ho, g.wo), x.dtype, g)  # layout: fill_cols
        cols = as_gemm(buf, g)
    G, o, k, p = wm.shape[0], wm.shape[1], cols.shape[1], cols.shape[3]
    per_block = -(-b.tuning.gemm_min_columns // p)
    row_step = b.tuning.row_step

    def gemm_blocks(b0, b1):
        lo, hi = b0 * per_block, min(b1 * per_block, n)
        if fill:
            fill_cols(buf, x, g, lo, hi)
        if per_block == 1:
            gemm_nchw(wm, cols[:, :, lo:hi], out[lo:hi])
            return
        for n0 in range(lo, hi, per_block):
            m = min(n0 + per_block, hi) - n0
            prod = np.matmul(wm, cols[:, :, n0 : n0 + m].reshape(G, k, m * p))
            out[n0 : n0 + m].reshape(m, G, o, p)[...] = prod.reshape(G, o, m, p).transpose(2, 0, 1, 3)

    if n > per_block or o < 2 * row_step:
        b.split(-(-n // per_block), gemm_blocks, b.gemm_bytes(2 * G * o * k * n * p, cols))
        return key, buf
    # One block holds the whole batch (few pixels, small batch): the columns are filled split over
    # samples, then the GEMM in two fixed halves of its rows, so that two threads share it and the
    # thread count still changes no bit.
    if fill:
        b.split(n, lambda lo, hi: fill_cols(buf, x, g, lo, hi), buf.nbytes)
    half = -(-o // (2 * row_step)) * row_step
    flat = cols.reshape(G, k, n * p)

    def rows(h0, h1):
        for h in range(h0, h1):  # one GEMM per half, however many this thread has
            r0, r1 = h * half, min(h * half + half, o)
            prod = np.matmul(wm[:, r0:r1], flat)
            out.reshape(n, G, o, p)[:, :, r0:r1] = prod.reshape(G, r1 - r0, n, p).transpose(2, 0, 1, 3)

    b.split(2, rows, b.gemm_bytes(2 * G * o * k * n * p, cols))
    return key, buf


def forward(b, x, w, g, keep):
    """(y, ctx): ctx lends the im2col buffer to backward."""
    n, co = x.shape[0], w.shape[0]
    y = np.empty((n, co, g.ho, g.wo), x.dtype)
    key, cols = conv_gemm(b, x, w.reshape(g.groups, co // g.groups, -1), g, y, "cols")
    return y, b.pool.keep_if(keep, key, cols)


def backward(b, dy, w, ctx, g, need_dx):
    n, co = dy.shape[0], dy.shape[1]
    G, p = g.groups, g.ho * g.wo
    o = co // G
    cols = as_gemm(ctx.array, g).reshape(G, -1, n * p)
    ykey, dyk = b.pool.take("dyk", (G, o, n, p), dy.dtype)  # dy with (n, ho, wo) merged: one GEMM for dw

    def regroup(lo, hi):
        dyk[:, :, lo:hi] = dy[lo:hi].reshape(hi - lo, G, o, p).transpose(1, 2, 0, 3)

    b.split(n, regroup, dy.nbytes)
    dw = np.empty((G, o, cols.shape[1]), dy.dtype)
    dyk2 = dyk.reshape(G, o, n * p)

    def weight_grad(lo, hi):  # columns lo..hi-1 of dw (input channel, kernel position): whole-batch sums
        np.matmul(dyk2, cols[:, lo:hi].transpose(0, 2, 1), out=dw[:, :, lo:hi])

    b.split(cols.shape[1], weight_grad, b.gemm_bytes(2 * dyk.size * cols.shape[1], dyk, cols))
    dw = dw.reshape(w.shape)
    ctx.release()
    if not need_dx:
        b.pool.give(ykey, dyk)
        return None, dw
    if g.sh == 1 and g.sw == 1 and g.h * g.w < SCATTER_AREA_RATIO * g.ho * g.wo:
        dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
        # dx is the stride-1 convolution of dy with the flipped, transposed kernel: one GEMM with
        # K = Co/G*kh*kw instead of a GEMM with K = Co/G followed by kh*kw scatter-adds.
        gt = transposed(g, co)
        wt = flipped(b, w, G, g)
        if g.kh == g.kw == 1 and not gt.padded and 2 * g.ho * g.wo >= b.tuning.gemm_min_columns:
            # one GEMM per sample, straight into NCHW (blocks of two samples measured slower)

            def data_grad(lo, hi):
                gemm_nchw(wt, dyk[:, :, lo:hi], dx[lo:hi])

            b.split(n, data_grad, b.gemm_bytes(2 * dyk.size * wt.shape[1], dx, dy))
        elif g.kh == g.kw == 1 and not gt.padded:  # blocks of samples; dy regrouped is their columns
            conv_gemm(b, dy, wt, gt, dx, None, cols=dyk)
        else:
            key, dcols = conv_gemm(b, dy, wt, gt, dx, "dcols")
            b.pool.give(key, dcols)
        b.pool.give(ykey, dyk)
        return dx, dw
    dx = strided_data_grad(b, dyk, w, g)
    b.pool.give(ykey, dyk)
    return dx, dw


# A stride-1 layer whose input has at least this many times its output's pixels (LeNet-5's C5: 5x5 in,
# 1x1 out, 25x) takes dx by W^T dy and col2im, as strided layers do: as a convolution of dy padded by
# the kernel's reach, dx would cost that many times the forward's multiplications, mostly on zeros.
SCATTER_AREA_RATIO = 4


def flipped(b, w, G, g):
    """(G, C/G, O/G * kh*kw): w (O, C/G, kh, kw) transposed per group and flipped in both kernel
    axes, the weights of dx as a stride-1 convolution of dy. For a 1x1 kernel a view (BLAS reads
    the transposed matrix as it is); else a copy, compiled from tuning.flip_compiled_min_bytes on."""
    o, cg, kk = w.shape[0] // G, w.shape[1], g.kh * g.kw
    if b.kernels != "numba" or w.nbytes < b.tuning.flip_compiled_min_bytes or kk == 1:
        return w.reshape(G, o, cg, g.kh, g.kw).transpose(0, 2, 1, 3, 4)[..., ::-1, ::-1].reshape(G, cg, -1)
    from pydtnn.backends.cpu.kernels import col2im

    wt = np.empty((G, cg, o, kk), w.dtype)
    args = (np.ascontiguousarray(w).reshape(G, o, cg, kk), wt)
    b.split_compiled(col2im.flip_transpose, col2im.flip_transpose_chunks, cg, args, 2 * w.nbytes)
    return wt.reshape(G, cg, -1)


def strided_data_grad(b, dyk, w, g):
    """dx of a strided convolution from dy regrouped as dyk (G, O, N, P): dcols = W^T dy, then each
    kernel position's share added back into dx (compiled col2im, or NumPy scatter-adds). One GEMM per
    sample; with under half of tuning.gemm_min_columns output pixels, one per block of samples (at
    least gemm_min_columns columns, blocks at fixed samples as in conv_gemm), reordered into dcols.
    Measured on the reference machine (AMD EPYC, AVX2), the blocks took 2-15% less time at 16 and 49 pixels, 4x less
    at 1 (LeNet-5's C5), and 10% more at 64 (ResNet-20's 32 -> 64 layer), where reordering costs more
    than it saves."""
    G, o, n, p = dyk.shape
    cg = g.c // G
    dx = np.empty((n, g.c, g.h, g.w), dyk.dtype)
    key, dcols = b.pool.take("dcols", (n, g.c, g.kh, g.kw, g.ho, g.wo), dyk.dtype)
    wmt = w.reshape(G, o, cg * g.kh * g.kw).transpose(0, 2, 1)
    pos = positions(g)
    per_block = -(-b.tuning.gemm_min_columns // p) if 2 * p < b.tuning.gemm_min_columns else 1

    col2im = None
    if b.kernels == "numba":
        from pydtnn.backends.cpu.kernels.col2im import col2im

    def data_grad_strided(b0, b1):
        lo, hi = b0 * per_block, min(b1 * per_block, n)
        if per_block == 1:
            out = dcols[lo:hi].reshape(hi - lo, G, -1, p).transpose(1, 0, 2, 3)
            np.matmul(wmt[:, None], dyk[:, :, lo:hi].transpose(0, 2, 1, 3), out=out)
        else:
            for n0 in range(lo, hi, per_block):
                m = min(n0 + per_block, hi) - n0
                prod = np.matmul(wmt, dyk[:, :, n0 : n0 + m].reshape(G, o, m * p))
                dcols[n0 : n0 + m].reshape(m, G, -1, p)[...] = prod.reshape(G, -1, m, p).transpose(2, 0, 1, 3)
        if col2im is not None:  # one pass per channel plane, in cache
            col2im(dcols, dx, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw, lo, hi)
            return
        dx[lo:hi] = 0
        for _, i, j, orows, ocols, irows, icols in pos:
            dx[lo:hi, :, irows, icols] += dcols[lo:hi, :, i, j, orows, ocols]

    b.split(-(-n // per_block), data_grad_strided, b.gemm_bytes(2 * dyk.size * wmt.shape[1], dx, dcols))
    b.pool.give(key, dcols)
    return dx


def cost(g, co, n, s, tuning, kernels, need_dx):
    """(kernel class, forward, backward_data, backward_weights), each phase (FLOPs, bytes) for n samples
    of s-byte elements (perfmodel/costs.py's units and rules). K = C/G*kk, P = Ho*Wo, cols = C*kk*N*P
    elements (the column matrix), cols_w = the entries fill_cols writes (cols less those that read padding):
    forward         2*macs flops; bytes: x read, cols_w written, cols read by the GEMM, W read, y written,
                    and y written and read once more where P < gemm_min_columns (a block of samples
                    per GEMM, reordered into NCHW)
    backward_weights 2*macs flops; bytes: dy read and written regrouped (dyk), dyk and cols read, dW written
    backward_data   stride 1: the convolution of dy with the flipped, transposed W over x's H x W
                    (transposed geometry gt): 2*N*H*W*C*(Co/G)*kk flops; bytes: the flipped copy of W
                    (2*|W|*s, none for 1x1), dy's column matrix written and read like forward's (none
                    for an unpadded 1x1: dyk is its columns), W read, dx written (and reordered where
                    H*W < gemm_min_columns);
                    larger strides, and stride-1 layers whose input has SCATTER_AREA_RATIO times their
                    output's pixels: dcols = W^T dy (2*macs flops; dyk and W read, dcols written, and
                    written and read once more where 2*P < gemm_min_columns: blocks of samples), then
                    col2im adds each kernel position's share into dx (cols_w flops); compiled: dcols
                    read, dx written; NumPy: dx zeroed, then per position dx read and written, dcols read
    """
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = co * (g.c // g.groups) * g.kh * g.kw * s
    m = macs(g, co, n)
    p = g.ho * g.wo
    cols = g.c * g.kh * g.kw * n * p
    cols_w = g.c * n * sum(touched(g))
    reorder = 2 * y if p < tuning.gemm_min_columns else 0
    fwd = (2 * m, (x + cols_w + cols + y + reorder) * s + w)
    bwd_w = (2 * m, (2 * y + y + cols) * s + w)
    if not need_dx:
        return "gemm", fwd, (0, 0), bwd_w
    if (g.sh, g.sw) == (1, 1) and g.h * g.w < SCATTER_AREA_RATIO * p:
        return "gemm", fwd, _stride1_data_cost(g, co, n, s, tuning), bwd_w
    dcols = n * g.c * g.kh * g.kw * p
    scatter = dcols + x if kernels == "numba" else x + 3 * cols_w
    blocks = 2 * dcols if 2 * p < tuning.gemm_min_columns else 0
    return "gemm", fwd, (2 * m + cols_w, (y + dcols + blocks + scatter) * s + w), bwd_w


def _stride1_data_cost(g, co, n, s, tuning):
    """cost()'s backward_data of a stride-1 layer: dx as the convolution of dy (FLOPs, bytes)."""
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = co * (g.c // g.groups) * g.kh * g.kw * s
    gt = transposed(g, co)
    pt = gt.ho * gt.wo
    flops = 2 * n * pt * g.c * (co // g.groups) * g.kh * g.kw
    reorder = 2 * x if pt < tuning.gemm_min_columns else 0
    if g.kh == g.kw == 1 and not gt.padded:
        if 2 * g.ho * g.wo >= tuning.gemm_min_columns:
            reorder = 0  # one GEMM per sample, straight into NCHW
        return flops, (y + x + reorder) * s + w
    dcols = co * g.kh * g.kw * n * pt
    dcols_w = co * n * sum(touched(gt))
    flip = 0 if g.kh * g.kw == 1 else 2 * w  # a 1x1 kernel's flipped weights are a view
    return flops, (y + dcols_w + dcols + x + reorder) * s + w + flip
