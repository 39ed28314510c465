"""Depthwise convolution in NumPy (one input channel per group, any kernel, equal strides).

No im2col and no GEMM: a GEMM with one output row per group does almost no arithmetic per byte it
moves. y is the sum over kernel positions of shifted x times per-channel weights, computed on a
"wide" grid and in batch chunks so the running sums stay in cache. cost() counts its work.
"""

from functools import cache

import numpy as np

from pydtnn.backends.geometry import macs


def eligible(g, co, kernels, tuning):
    """One input channel per group (any channel multiplier), equal strides; either kernels."""
    return g.c == g.groups and g.sh == g.sw


@cache
def wide_layout(g):
    """The padded input flattened per channel, read at a flat offset per kernel position.

    Output (ho, wo) is computed on a "wide" grid q = ho*Wp + wo with wo running over the padded width
    Wp (columns wo >= Wo are thrown away), so that for stride s every kernel position reads the
    1-D strided run xflat[off + s*q] and NumPy loops run over ho*Wp elements, not wo.
    Returns (Hp, Wp, L, span, offsets, flat length).
    """
    hp, wp = g.h + g.pt + g.pb, g.w + g.pl + g.pr
    length = g.ho * wp
    span = g.sh * (length - 1) + 1
    offsets = tuple(i * g.dh * wp + j * g.dw for i in range(g.kh) for j in range(g.kw))
    return hp, wp, length, span, offsets, max(hp * wp, offsets[-1] + span)


def in_chunks(b, n, step, tail, dtype, body, nbytes):
    """body(n0, n1, tmp) over samples [0, n) in chunks of at most `step`, the chunks shared out among
    threads; tmp is a scratch array of shape (n1 - n0, *tail), one per thread."""

    def part(lo, hi):
        tmp = np.empty((min(step, hi - lo), *tail), dtype)
        for n0 in range(lo, hi, step):
            n1 = min(n0 + step, hi)
            body(n0, n1, tmp[: n1 - n0])

    b.split(n, part, nbytes)


def wide_weights(b, w, g):
    """Pooled (kh*kw, G, m, L): each kernel position's per-channel weight repeated along the wide
    grid (L = Ho*Wp). NumPy multiplies two contiguous rows faster than a row by a value repeated
    with stride 0 (4.6 against 5.4 ms for the forward loop of the benchmark's layer)."""
    G, kk = g.groups, g.kh * g.kw
    m, length = w.shape[0] // G, wide_layout(g)[2]
    key, wk = b.pool.take("dww", (kk, G, m, length), w.dtype, g)
    wk[...] = w.reshape(G, m, kk).transpose(2, 0, 1)[..., None]
    return key, wk


def forward(b, x, w, g, keep):
    n, co = x.shape[0], w.shape[0]
    G, m = g.groups, co // g.groups  # m: channel multiplier
    hp, wp, length, span, offsets, flat = wide_layout(g)
    s = g.sh
    key, xf = b.pool.take("dwx", (n, g.c, flat), x.dtype, g)  # padding and tail stay zero
    xf[:, :, : hp * wp].reshape(n, g.c, hp, wp)[:, :, g.pt : g.pt + g.h, g.pl : g.pl + g.w] = x
    wkey, wk = wide_weights(b, w, g)
    yw = np.empty((n, G, m, length), x.dtype)
    step = max(1, b.tuning.depthwise_chunk_bytes // (co * length * x.itemsize))

    def chunk(n0, n1, t):
        ys = yw[n0:n1]
        for k, off in enumerate(offsets):
            xv = xf[n0:n1, :, off : off + span : s][:, :, None, :]
            if k == 0:
                np.multiply(xv, wk[k], out=ys)
            else:
                np.multiply(xv, wk[k], out=t)
                ys += t

    in_chunks(b, n, step, (G, m, length), x.dtype, chunk, yw.nbytes)
    b.pool.give(wkey, wk)
    y = np.empty((n, co, g.ho, g.wo), x.dtype)
    y[...] = yw.reshape(n, co, g.ho, wp)[..., : g.wo]
    return y, b.pool.keep_if(keep, key, xf)


def backward(b, dy, w, ctx, g, need_dx):
    n, co = dy.shape[0], dy.shape[1]
    G, m = g.groups, co // g.groups
    hp, wp, length, span, offsets, flat = wide_layout(g)
    s, xf = g.sh, ctx.array
    # dy on the wide grid, zero in the thrown-away columns so they add nothing below
    dkey, dyw = b.pool.take("dwdy", (n, G, m, length), dy.dtype, g)
    dyw.reshape(n, co, g.ho, wp)[..., : g.wo] = dy
    dwk = np.empty((G, m, g.kh * g.kw), dy.dtype)

    def weight_grads(lo, hi):  # kernel positions lo..hi-1: each a whole-batch sum of its own
        for k in range(lo, hi):
            off = offsets[k]
            dwk[:, :, k] = np.einsum("ngml,ngl->gm", dyw, xf[:, :, off : off + span : s])

    b.split(len(offsets), weight_grads, dyw.nbytes * len(offsets))
    ctx.release()
    if not need_dx:
        b.pool.give(dkey, dyw)
        return None, dwk.reshape(w.shape)
    xkey, dxf = b.pool.take("dwdx", (n, g.c, flat), dy.dtype, g)
    dxf[...] = 0
    wkey, wk = wide_weights(b, w, g)
    step = max(1, b.tuning.depthwise_chunk_bytes // (co * length * dy.itemsize))

    def chunk(n0, n1, t):
        for k, off in enumerate(offsets):
            np.multiply(dyw[n0:n1], wk[k], out=t)
            dxv = dxf[n0:n1, :, off : off + span : s]
            dxv += t[:, :, 0] if m == 1 else t.sum(axis=2)

    in_chunks(b, n, step, (G, m, length), dy.dtype, chunk, dyw.nbytes)
    b.pool.give(wkey, wk)
    dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
    dx[...] = dxf[:, :, : hp * wp].reshape(n, g.c, hp, wp)[:, :, g.pt : g.pt + g.h, g.pl : g.pl + g.w]
    b.pool.give(dkey, dyw)
    b.pool.give(xkey, dxf)
    return dx, dwk.reshape(w.shape)


def cost(g, co, n, s, tuning, kernels, need_dx):
    """(kernel class, forward, backward_data, backward_weights), each phase (FLOPs, bytes) for n samples
    of s-byte elements (perfmodel/costs.py's units and rules), on the wide grid: L = Ho*Wp per channel,
    xf = N*C*flat (the padded input, flat per channel), yw = N*Co*L, wk = kk*Co*L (each kernel
    position's weights along the grid):
    forward         2*macs flops; bytes: x read and written into xf, wk written and read, xf read, yw
                    written, then cropped into y (Y read, Y written)
    backward_weights 2*macs flops; bytes: dy read and written onto the grid (dyw), then one whole-batch
                    pass per kernel position reading dyw and xf's strided run (kk*(yw + N*C*L)*s)
    backward_data   2*macs flops; bytes: dxf zeroed (xf), wk written and read, dyw read, dxf read and
                    written, cropped into dx (X read, X written)
    """
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = co * (g.c // g.groups) * g.kh * g.kw * s
    m = macs(g, co, n)
    _, _, length, _, offsets, flat = wide_layout(g)
    xf, yw, wk = n * g.c * flat, n * co * length, len(offsets) * co * length
    fwd = (2 * m, (x + x + 2 * wk + xf + yw + 2 * y) * s + w)
    bwd_w = (2 * m, (2 * y + len(offsets) * (yw + n * g.c * length)) * s)
    bwd_d = (2 * m, (xf + 2 * wk + yw + 2 * xf + 2 * x) * s + w)
    return "depthwise", fwd, bwd_d, bwd_w
