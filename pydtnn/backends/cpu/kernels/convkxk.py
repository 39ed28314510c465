"""Dense (one-group) k x k stride-1 convolution for odd k above 3 (5x5, 7x7): conv3x3.py's
register-blocked kernels with the taps counted at run time.

The layout is conv3x3.py's (conv_direct.dense_layout with the kernel's reach): each sample padded
into xs, outputs computed on the wide grid q = ho*Wp + wo, every tap one fixed offset into xs. The
forward block keeps BLOCK_CHANNELS output channels times 2 or 3 vectors of pixels in registers
through the loops over input channels and over the k*k taps (a loop in the IR, not unrolled: 25 or
49 taps would not fit the instruction cache any better). The weight gradient reuses conv3x3's
block of BLOCK_CHANNELS output channels times three taps of one kernel row, over groups of three
taps: a row of 5 taps is two groups (the second with its last tap repeated, computed and dropped),
a row of 7 three.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pydtnn.backends.cpu.isa import VECTOR_BYTES
from pydtnn.backends.cpu.kernels.conv3x3 import BLOCK_CHANNELS
from pydtnn.backends.cpu.kernels.conv3x3 import _grad_block as _grad_block3
from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit
from pydtnn.backends.cpu.kernels.vectors import I64, Emitter, copy, pad_into, same_dtype


def _forward_block(vectors):
    """The forward block with `vectors` vectors of output pixels (see convkxk_forward)."""
    m_ = BLOCK_CHANNELS

    @intrinsic
    def block(typingctx, xs, wb, out, offs, cb, q0, o0):
        """out[cb*M + m, o0 + p] = sum over c, k of wb[cb, c, k, m] * xs[c, q0 + offs[k] + p] for the
        M output channels m and the `vectors` vectors of pixels p: xs (C, *), wb (nb, C, T, M)
        contiguous, out (nb*M, *), offs (T,) int64 with T = len(offs) taps."""
        if not same_dtype(xs, wb, out):
            return None
        sig = types.void(xs, wb, out, offs, cb, q0, o0)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, signature.args[0].dtype)
            b = builder
            xa, wa, oa, fa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
            cb_, q0_, o0_ = args[4:]
            c_ = b.extract_value(xa.shape, 0)
            taps = b.extract_value(fa.shape, 0)
            per_c = b.mul(taps, I64(m_))
            lx, lo = e.row_stride(xa), e.row_stride(oa)
            xbase = e.at(xa.data, q0_)
            wbase = e.at(wa.data, b.mul(cb_, b.mul(c_, per_c)))
            zero = ir.Constant(e.vec, [0.0] * e.lanes)

            def channel(c, acc):
                xrow = e.at(xbase, b.mul(c, lx))
                wrow = e.at(wbase, b.mul(c, per_c))

                def tap(k, acc):
                    acc = list(acc)
                    off = b.load(b.gep(fa.data, [k], source_etype=I64), typ=I64)
                    xk = e.at(xrow, off)
                    wk = e.at(wrow, b.mul(k, I64(m_)))
                    xv = [e.vload(xk, I64(e.lanes * v)) for v in range(vectors)]
                    for m in range(m_):
                        wv = e.splat(wk, I64(m))
                        for v in range(vectors):
                            acc[m * vectors + v] = e.muladd(wv, xv[v], acc[m * vectors + v])
                    return acc

                return e.counted_loop(I64(0), taps, I64(1), acc, tap)

            acc = e.counted_loop(I64(0), c_, I64(1), [zero] * (m_ * vectors), channel)
            obase = e.at(oa.data, b.add(b.mul(b.mul(cb_, I64(m_)), lo), o0_))
            for m in range(m_):
                orow = e.at(obase, b.mul(I64(m), lo))
                for v in range(vectors):
                    e.vstore(acc[m * vectors + v], orow, I64(e.lanes * v))
            return context.get_dummy_value()

        return sig, codegen

    return block


_forward_block2, _forward_block3 = _forward_block(2), _forward_block(3)


@_jit
def _tap_offsets(wp, kh, kw, dh, dw):
    """The k*k taps' offsets into the padded grid, row by row."""
    offs = np.empty(kh * kw, np.int64)
    for i in range(kh):
        for j in range(kw):
            offs[i * kw + j] = i * dh * wp + j * dw
    return offs


@_jit
def _tap_groups(wp, kh, kw, dh, dw):
    """The taps' offsets in groups of three per kernel row (kh * ceil(kw/3) groups), the last group of
    a row padded with its row's last tap."""
    gr = (kw + 2) // 3
    offs = np.empty(kh * gr * 3, np.int64)
    for i in range(kh):
        for t in range(gr * 3):
            offs[i * gr * 3 + t] = i * dh * wp + min(t, kw - 1) * dw
    return offs


@_jit
def convkxk_forward(x, wb, y, xs, lx, per_sample, pt, pl, kh, kw, dh, dw, threes, length, n0, n1):
    """y[n] = conv(x[n], w) for samples n0..n1-1 of a one-group kh x kw stride-1 convolution.

    x (N, C, H, W); wb (nb, C, kh*kw, M) the weight w (Co, C, kh, kw) in blocks of M = BLOCK_CHANNELS
    output channels (zero rows past Co); y (N, Co, Ho, Wo). xs, lx, per_sample, threes and length as
    in conv3x3.conv3x3_dense_forward, except that every sample is computed from a scratch (C, lx) and
    then copied into xs: xs's channel rows lie N*lx apart, and 25 or 49 taps read from rows that far
    apart conflict in the cache (64 -> 64 channels at 27x27, batch 64, one thread: 157 against 121 ms).
    """
    c_ = x.shape[1]
    co_, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    wp = wo + (kw - 1) * dw
    hp = ho + (kh - 1) * dh
    lanes = VECTOR_BYTES // x.itemsize
    split = threes * 3 * lanes
    offs = _tap_offsets(wp, kh, kw, dh, dw)
    out = np.empty((wb.shape[0] * BLOCK_CHANNELS, length), x.dtype)
    buf = np.zeros((c_, lx), x.dtype)
    yf, of, bf = y.reshape(y.size), out.reshape(out.size), buf.reshape(buf.size)
    xsf = xs.reshape(xs.size)
    for n in range(n0, n1):
        pad_into(buf, 0, x[n], pt, pl, hp, wp, 0, c_)
        if per_sample:
            for c in range(c_):
                copy(xsf, c * xs.shape[1] + n * lx, bf, c * lx, lx)
        for cb in range(wb.shape[0]):
            for q in range(0, split, 3 * lanes):
                _forward_block3(buf, wb, out, offs, cb, q, q)
            for q in range(split, length, 2 * lanes):
                _forward_block2(buf, wb, out, offs, cb, q, q)
        for co in range(co_):
            for r in range(ho):
                copy(yf, ((n * co_ + co) * ho + r) * wo, of, co * length + r * wp, wo)


@_pjit
def convkxk_forward_chunks(n, t, x, wb, y, xs, lx, per_sample, pt, pl, kh, kw, dh, dw, threes, length):
    for i in numba.prange(t):
        lo, hi = n * i // t, n * (i + 1) // t
        convkxk_forward(x, wb, y, xs, lx, per_sample, pt, pl, kh, kw, dh, dw, threes, length, lo, hi)


@_jit
def convkxk_weight_grad(xs, lx, dy, dyw, dwt, dh, dw, chunk, cb0, cb1):
    """dwt[co] (Co, C, kh, kw) for the output channels of blocks cb0..cb1-1: the correlation of dy
    with the padded inputs xs that convkxk_forward kept, as in conv3x3.conv3x3_dense_weight_grad
    (dyw, chunk, the partial sums), over groups of three taps of a kernel row."""
    n_, co_, ho, wo = dy.shape
    c_, kh, kw = xs.shape[0], dwt.shape[2], dwt.shape[3]
    wp = wo + (kw - 1) * dw
    lanes = VECTOR_BYTES // xs.itemsize
    m_ = BLOCK_CHANNELS
    gr = (kw + 2) // 3
    groups = kh * gr
    span = (ho * wp + lanes - 1) // lanes * lanes  # a sample's columns that can hold dy
    offs = _tap_groups(wp, kh, kw, dh, dw)
    ld = dyw.shape[1]
    dywf, dyf = dyw.reshape(dyw.size), dy.reshape(dy.size)
    for co in range(cb0 * m_, min(cb1 * m_, co_)):
        for n in range(n_):
            for r in range(ho):
                copy(dywf, co * ld + n * lx + r * wp, dyf, ((n * co_ + co) * ho + r) * wo, wo)
    acc = np.zeros(((cb1 - cb0) * c_ * groups, 3 * m_ * lanes), xs.dtype)
    for n0 in range(0, n_, chunk):
        n1 = min(n0 + chunk, n_)
        for cb in range(cb0, cb1):
            for ci in range(c_):
                for gi in range(groups):
                    row = ((cb - cb0) * c_ + ci) * groups + gi
                    _grad_block3(xs, dyw, acc, offs, cb, ci, gi, n0, n1, lx, span, row)
    for cb in range(cb0, cb1):
        for m in range(m_):
            co = cb * m_ + m
            if co >= co_:
                continue
            for ci in range(c_):
                for i in range(kh):
                    for j in range(kw):
                        row = ((cb - cb0) * c_ + ci) * groups + i * gr + j // 3
                        s = 0.0
                        for k in range((m * 3 + j % 3) * lanes, (m * 3 + j % 3 + 1) * lanes):
                            s += acc[row, k]
                        dwt[co, ci, i, j] = s


@_pjit
def convkxk_weight_grad_chunks(n, t, xs, lx, dy, dyw, dwt, dh, dw, chunk):
    for i in numba.prange(t):
        convkxk_weight_grad(xs, lx, dy, dyw, dwt, dh, dw, chunk, n * i // t, n * (i + 1) // t)
