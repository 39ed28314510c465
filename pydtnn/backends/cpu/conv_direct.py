"""The compiled direct stride-1 convolution (kernels/conv3x3.py, kernels/depthwise3x3.py; one-group
5x5 and 7x7 layers kernels/convkxk.py), split
over samples (forward, dx) and output channels (dw): no thread adds into another's result, so the
thread count changes nothing. A stride-2 depthwise layer runs at stride 1 and keeps every other row
and column (forward_stride2)."""

import numpy as np

from pydtnn.backends.cpu.isa import VECTOR_BYTES
from pydtnn.backends.cpu.scratch import Kept


def dense_layout(ho, wo, dh, dw, itemsize, k=3):
    """(threes, length, lx, tail) of the compiled one-group k x k kernels for an output of ho x wo. The
    wide grid's Ho*Wp columns, rounded up to whole vectors (at least two), are computed in `threes`
    blocks of three vectors and then blocks of two up to `length` columns: a block of three keeps 12
    accumulators in registers, enough to hide the FMA latency, where a block of two keeps 8 (measured
    10-12% slower per column). Also each sample's columns lx in the padded input (the computed
    columns plus the taps' reach, in whole vectors) and the columns after the last sample that the
    weight gradient reads."""
    lanes = VECTOR_BYTES // itemsize
    wp = wo + (k - 1) * dw
    v = max(2, -(-ho * wp // lanes))
    threes = v // 3 if v % 3 != 1 else v // 3 - 1  # the rest in one or two blocks of two
    reach = (k - 1) * (dh * wp + dw)
    lx = -(-(v * lanes + reach) // lanes) * lanes
    return threes, v * lanes, lx, -(-reach // lanes) * lanes


def channel_blocks(w, m):
    """w (Co, C, k, k) as (ceil(Co/m), C, k*k, m): blocks of m output channels, the last one zero-filled."""
    co, c = w.shape[:2]
    taps = w.shape[2] * w.shape[3]
    blocks = -(-co // m)
    wz = np.zeros((blocks * m, c, taps), w.dtype)
    wz[:co] = w.reshape(co, c, taps)
    return np.ascontiguousarray(wz.reshape(blocks, m, c, taps).transpose(0, 2, 3, 1))


def dense_kernels(k):
    """The compiled one-group kernels of a k x k layer: (forward, its chunks, weight gradient, its chunks,
    extra leading arguments of the forward after pl)."""
    if k == 3:
        from pydtnn.backends.cpu.kernels import conv3x3 as m

        return (
            m.conv3x3_dense_forward,
            m.conv3x3_dense_forward_chunks,
            m.conv3x3_dense_weight_grad,
            m.conv3x3_dense_weight_grad_chunks,
            (),
        )
    from pydtnn.backends.cpu.kernels import convkxk as m

    return m.convkxk_forward, m.convkxk_forward_chunks, m.convkxk_weight_grad, m.convkxk_weight_grad_chunks, (k, k)


def forward(b, x, w, g, keep):
    """A depthwise layer keeps x for backward, a one-group layer its padded input (pooled: the padding
    entries, never written, stay zero from one step to the next)."""
    from pydtnn.backends.cpu.kernels import conv3x3, depthwise3x3  # Numba: only models using them pay for it

    x = np.ascontiguousarray(x)
    n = x.shape[0]
    y = np.empty((n, w.shape[0], g.ho, g.wo), x.dtype)
    if g.groups > 1:
        args = (x, w, y, g.pt, g.pl, g.dh, g.dw)
        kernels = depthwise3x3.depthwise3x3_forward, depthwise3x3.depthwise3x3_forward_chunks
        b.split_compiled(*kernels, n, args, y.nbytes * 9)
        return y, (Kept(x) if keep else None)
    threes, length, lx, tail = dense_layout(g.ho, g.wo, g.dh, g.dw, x.itemsize, g.kh)
    wb = channel_blocks(w, conv3x3.BLOCK_CHANNELS)
    key, xs = b.pool.take("xs", (g.c, n * lx + tail), x.dtype, g) if keep else (None, None)
    scratch = np.zeros((0, 0), x.dtype)  # without keep, each chunk pads into its own
    fwd, fwd_chunks, _, _, ks = dense_kernels(g.kh)
    args = (x, wb, y, xs if keep else scratch, lx, keep, g.pt, g.pl, *ks, g.dh, g.dw, threes, length)
    b.split_compiled(fwd, fwd_chunks, n, args, y.nbytes * g.kh * g.kw * g.c)
    return y, (b.pool.loan(key, xs) if keep else None)


def backward(b, dy, w, ctx, g, need_dx):
    """dw split over output channels (one-group layers: blocks of them), dx (a convolution of dy with
    the flipped, transposed kernel) over samples."""
    from pydtnn.backends.cpu.kernels import conv3x3, depthwise3x3

    dy = np.ascontiguousarray(dy)
    n, co = dy.shape[0], dy.shape[1]
    dw = weight_grad(b, dy, w, ctx, g)
    if not need_dx:
        return None, dw
    dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
    pt, pl = (g.kh - 1) * g.dh - g.pt, (g.kw - 1) * g.dw - g.pl
    if g.groups == 1:
        m = conv3x3.BLOCK_CHANNELS
        fwd, fwd_chunks, _, _, ks = dense_kernels(g.kh)
        wt = channel_blocks(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1], m)
        threes, length, lxt, _ = dense_layout(g.h, g.w, g.dh, g.dw, dy.itemsize, g.kh)
        kernel, chunks = fwd, fwd_chunks
        args = (dy, wt, dx, np.zeros((0, 0), dy.dtype), lxt, False, pt, pl, *ks, g.dh, g.dw, threes, length)
    else:
        kernel, chunks = depthwise3x3.depthwise3x3_forward, depthwise3x3.depthwise3x3_forward_chunks
        args = (dy, np.ascontiguousarray(w[:, :, ::-1, ::-1]), dx, pt, pl, g.dh, g.dw)
    b.split_compiled(kernel, chunks, n, args, dx.nbytes * g.kh * g.kw * (co if g.groups == 1 else 1))
    return dx, dw


def weight_grad(b, dy, w, ctx, g):
    """dw of the direct kernels from dy (contiguous) and forward's ctx (released here): one-group layers
    from the kept padded layout, split over blocks of output channels; depthwise ones from x."""
    from pydtnn.backends.cpu.kernels import conv3x3, depthwise3x3

    n, co = dy.shape[0], dy.shape[1]
    dw = np.empty(w.shape, dy.dtype)
    dense = g.groups == 1
    if dense:
        xs, m = ctx.array, conv3x3.BLOCK_CHANNELS
        lx = dense_layout(g.ho, g.wo, g.dh, g.dw, dy.itemsize, g.kh)[2]
        blocks = -(-co // m)
        ykey, dyw = b.pool.take("dyw", (blocks * m, n * lx), dy.dtype, g)  # zero where dy is not written
        chunk = max(1, b.tuning.direct_chunk_bytes // (g.c * lx * dy.itemsize))
        args = (xs, lx, dy, dyw, dw, g.dh, g.dw, chunk)
        _, _, grad, grad_chunks, _ = dense_kernels(g.kh)
        b.split_compiled(grad, grad_chunks, blocks, args, xs.nbytes * g.kh * g.kw * co)
        b.pool.give(ykey, dyw)
    else:
        x = ctx.array
        args = (x, dy, dw, g.pt, g.pl, g.dh, g.dw)
        kernels = depthwise3x3.depthwise3x3_weight_grad, depthwise3x3.depthwise3x3_weight_grad_chunks
        b.split_compiled(*kernels, co, args, x.nbytes * 9)
    ctx.release()
    return dw


def forward_stride2(b, x, w, g, g1, keep):
    """A stride-2 depthwise layer g through its stride-1 twin g1: the layer's output is g1's at even
    rows and columns."""
    y1, ctx = forward(b, x, w, g1, keep)
    return np.ascontiguousarray(y1[:, :, : 2 * g.ho : 2, : 2 * g.wo : 2]), ctx


def backward_stride2(b, dy, w, ctx, g, g1, need_dx):
    """dx of forward_stride2: g1's dx from dy spread onto the even rows and columns, zeros between."""
    key, up = b.pool.take("dyup", (dy.shape[0], dy.shape[1], g1.ho, g1.wo), dy.dtype, g)  # zero between
    up[:, :, : 2 * g.ho : 2, : 2 * g.wo : 2] = dy
    grads = backward(b, up, w, ctx, g1, need_dx)
    b.pool.give(key, up)
    return grads
