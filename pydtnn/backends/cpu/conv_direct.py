"""The compiled direct stride-1 convolution (kernels/conv3x3.py, kernels/depthwise3x3.py; one-group
5x5 and 7x7 layers kernels/convkxk.py), split over samples (forward, dx) and output channels (dw): no
thread adds into another's result, so the thread count changes nothing. A stride-2 depthwise layer runs
at stride 1 and keeps every other row and column (forward_stride2). Which layers it takes (eligible,
preferred, stride2_eligible) and what it costs (cost, stride2_cost) are here too: conv_algorithms.py
lists them."""

from dataclasses import replace

import numpy as np

from pydtnn.backends.cpu.isa import VECTOR_BYTES
from pydtnn.backends.cpu.scratch import Kept
from pydtnn.backends.geometry import macs


def direct_ok(g, co):
    """Whether the compiled direct kernels compute geometry g with co output channels: stride 1, 3x3
    with one group or depthwise (one input and one output channel per group), or 5x5 or 7x7 with one
    group; and padding at most the kernel's reach on every side (so that dx, a convolution of dy, is
    padded too)."""
    eh, ew = (g.kh - 1) * g.dh, (g.kw - 1) * g.dw
    return (
        g.kh == g.kw
        and (g.sh, g.sw) == (1, 1)
        and ((g.kh == 3 and (g.groups == 1 or g.groups == g.c == co)) or (g.kh in (5, 7) and g.groups == 1))
        and 0 <= min(g.pt, g.pb) <= max(g.pt, g.pb) <= eh
        and 0 <= min(g.pl, g.pr) <= max(g.pl, g.pr) <= ew
    )


def eligible(g, co, kernels, tuning):
    """direct_ok, with the compiled kernels."""
    return kernels == "numba" and direct_ok(g, co)


def preferred(g, co, tuning):
    """The threshold choice of an eligible layer: depthwise ones always; one-group ones at least
    tuning.direct_min_width outputs wide (twice that from tuning.direct_narrow_max_channels input
    channels on), where they beat im2col + GEMM."""
    wide = g.wo >= tuning.direct_min_width and (
        g.wo >= 2 * tuning.direct_min_width or g.c < tuning.direct_narrow_max_channels
    )
    return g.groups > 1 or wide


def stride1_twin(g):
    """g at stride 1: the geometry a stride-2 depthwise layer runs (direct_stride2)."""
    return replace(g, sh=1, sw=1)


def stride2_eligible(g, co, kernels, tuning):
    """A stride-2 depthwise layer whose stride-1 twin the compiled kernels compute: 4x the multiply-adds
    of the strided layer, but compiled and on all threads."""
    return (kernels == "numba" and (g.sh, g.sw) == (2, 2) and g.groups == g.c == co
            and direct_ok(stride1_twin(g), co))


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


def forward_stride2(b, x, w, g1, keep):
    """A stride-2 depthwise layer through its stride-1 twin g1: the layer's output is g1's at even rows
    and columns (ceil(Ho1 / 2) of them: the strided layer's Ho)."""
    y1, ctx = forward(b, x, w, g1, keep)
    return np.ascontiguousarray(y1[:, :, ::2, ::2]), ctx


def backward_stride2(b, dy, w, ctx, g1, need_dx):
    """dx of forward_stride2: g1's dx from dy spread onto the even rows and columns, zeros between."""
    key, up = b.pool.take("dyup", (dy.shape[0], dy.shape[1], g1.ho, g1.wo), dy.dtype, g1)  # zero between
    up[:, :, ::2, ::2] = dy
    grads = backward(b, up, w, ctx, g1, need_dx)
    b.pool.give(key, up)
    return grads


def cost(g, co, n, s, tuning, kernels, need_dx):
    """(kernel class, forward, backward_data, backward_weights), each phase (FLOPs, bytes) for n samples
    of s-byte elements (perfmodel/costs.py's units and rules). T = k*k taps, 9 for 3x3. One group:
    lx = a sample's columns in the padded input xs (dense_layout), B = Co rounded up to blocks of
    BLOCK_CHANNELS, Bt = C rounded likewise:
    forward         2*macs flops; bytes: x read, xs written (x's elements) and read (C*N*lx), W blocked
                    (W read, 4*B*C*T*s: zeroed, filled, transposed), y written
    backward_weights 2*macs flops; bytes: dy read and laid on xs's grid (dyw: Y written, B*N*lx read),
                    xs read, dW written
    backward_data   2*N*H*W*C*Co*T flops; bytes: W flipped and blocked (W read, 4*Bt*Co*T*s), dy read,
                    dx written (each sample padded into scratch that stays in cache)
    Depthwise: forward 2*macs, x and W read, y written; backward_weights 2*macs, x and dy read, dW
    written; backward_data 2*N*H*W*C*T flops, W flipped (2*|W|*s), dy read, dx written."""
    return ("direct3x3" if g.groups == 1 else "depthwise", *_cost(g, co, n, s, n * co * g.ho * g.wo))


def stride2_cost(g, co, n, s, tuning, kernels, need_dx):
    """cost() of a stride-2 depthwise 3x3 layer g through its stride-1 twin g1, Y1 = g1's output: the
    depthwise direct costs of g1 (forward y1 written, backward reading Y1 elements of the spread dy),
    plus forward: y1's even rows and columns read and written into y (2*Y*s); backward_weights: dy read
    and spread onto the even rows and columns of a zeroed Y1 (2*Y*s)."""
    g1 = stride1_twin(g)
    y = n * co * g.ho * g.wo
    fwd, bwd_d, bwd_w = _cost(g1, co, n, s, n * co * g1.ho * g1.wo)
    return "depthwise", (fwd[0], fwd[1] + 2 * y * s), bwd_d, (bwd_w[0], bwd_w[1] + 2 * y * s)


def _cost(g, co, n, s, y):
    """(forward, backward_data, backward_weights) of cost() with y output elements written."""
    x = n * g.c * g.h * g.w
    w = co * (g.c // g.groups) * g.kh * g.kw * s
    m = macs(g, co, n)
    taps = g.kh * g.kw
    dx_flops = 2 * n * g.h * g.w * g.c * (co // g.groups) * taps
    if g.groups > 1:
        return (2 * m, (x + y) * s + w), (dx_flops, (y + x) * s + 3 * w), (2 * m, (x + y) * s + w)
    from pydtnn.backends.cpu.kernels.conv3x3 import BLOCK_CHANNELS  # Numba: the direct plan needs it anyway

    _, _, lx, tail = dense_layout(g.ho, g.wo, g.dh, g.dw, s, g.kh)
    xs = g.c * (n * lx + tail)
    blocks = -(-co // BLOCK_CHANNELS) * BLOCK_CHANNELS
    blocks_t = -(-g.c // BLOCK_CHANNELS) * BLOCK_CHANNELS
    fwd = (2 * m, (x + x + xs + y) * s + w + 4 * blocks * g.c * taps * s)
    bwd_w = (2 * m, (y + y + blocks * n * lx + xs) * s + w)
    bwd_d = (dx_flops, (y + x) * s + w + 4 * blocks_t * co * taps * s)
    return fwd, bwd_d, bwd_w
