"""Dense (one-group) 3x3 stride-1 convolution: register-blocked vector kernels."""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pydtnn.backends.cpu.isa import VECTOR_BYTES
from pydtnn.backends.cpu.kernels.jit import jit as _jit
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit
from pydtnn.backends.cpu.kernels.vectors import I64, Emitter, copy, pad_into, same_dtype

# LLVM does not keep a block of accumulators in registers across a reduction loop written in Python,
# so the two inner blocks below are emitted as LLVM IR with explicit vectors of isa.VECTOR_BITS (256:
# 8 float32 or 4 float64 lanes): a forward block of BLOCK_CHANNELS output channels times 2 or 3
# vectors of output pixels (the loop over input channels and the 9 taps inside, every accumulator in
# a register), and a weight-gradient block of BLOCK_CHANNELS output channels times one row of 3 taps (the loop over
# pixels inside). LLVM splits the vectors where the CPU's are narrower.
BLOCK_CHANNELS = 4




def _forward_block(vectors):
    """The forward block with `vectors` vectors of output pixels (see conv3x3_dense_forward)."""
    m_ = BLOCK_CHANNELS

    @intrinsic
    def block(typingctx, xs, wb, out, offs, cb, q0, o0):
        """out[cb*M + m, o0 + p] = sum over c, k of wb[cb, c, k, m] * xs[c, q0 + offs[k] + p] for the
        M output channels m and the `vectors` vectors of pixels p: xs (C, *), wb (nb, C, 9, M)
        contiguous, out (nb*M, *), offs (9,) int64."""
        if not same_dtype(xs, wb, out):
            return None
        sig = types.void(xs, wb, out, offs, cb, q0, o0)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, signature.args[0].dtype)
            b = builder
            xa, wa, oa, fa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
            cb_, q0_, o0_ = args[4:]
            c_ = b.extract_value(xa.shape, 0)
            lx, lo = e.row_stride(xa), e.row_stride(oa)
            offs = [b.load(b.gep(fa.data, [I64(k)], source_etype=I64), typ=I64) for k in range(9)]
            xbase = e.at(xa.data, q0_)
            wbase = e.at(wa.data, b.mul(cb_, b.mul(c_, I64(9 * m_))))
            zero = ir.Constant(e.vec, [0.0] * e.lanes)

            def body(c, acc):
                acc = list(acc)
                xrow = e.at(xbase, b.mul(c, lx))
                wrow = e.at(wbase, b.mul(c, I64(9 * m_)))
                for k in range(9):
                    xk = e.at(xrow, offs[k])
                    xv = [e.vload(xk, I64(e.lanes * v)) for v in range(vectors)]
                    for m in range(m_):
                        wv = e.splat(wrow, I64(k * m_ + m))
                        for v in range(vectors):
                            acc[m * vectors + v] = e.muladd(wv, xv[v], acc[m * vectors + v])
                return acc

            acc = e.counted_loop(I64(0), c_, I64(1), [zero] * (m_ * vectors), body)
            obase = e.at(oa.data, b.add(b.mul(b.mul(cb_, I64(m_)), lo), o0_))
            for m in range(m_):
                orow = e.at(obase, b.mul(I64(m), lo))
                for v in range(vectors):
                    e.vstore(acc[m * vectors + v], orow, I64(e.lanes * v))
            return context.get_dummy_value()

        return sig, codegen

    return block


_forward_block2, _forward_block3 = _forward_block(2), _forward_block(3)


@intrinsic
def _grad_block(typingctx, xs, dyw, acc, offs, cb, ci, i, n0, n1, lx, span, arow):
    """acc[arow, (m*3 + j)*lanes + l] += sum over the samples n0 <= n < n1 and t = n*lx + l, n*lx +
    lanes + l, ... < n*lx + span of dyw[cb*M + m, t] * xs[ci, t + offs[3*i + j]]: the M x 3 block of
    the weight gradient's row i, as lanes partial sums. xs (C, *), dyw (nb*M, *), acc (*, 3*M*lanes)
    contiguous rows; n0 < n1 and span a positive multiple of lanes."""
    if not same_dtype(xs, dyw, acc):
        return None
    sig = types.void(xs, dyw, acc, offs, cb, ci, i, n0, n1, lx, span, arow)
    m_ = BLOCK_CHANNELS

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, signature.args[0].dtype)
        b = builder
        xa, da, aa, fa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:4], args[:4]))
        cb_, ci_, i_, n0_, n1_, lx_, span_, arow_ = args[4:]
        row = b.mul(i_, I64(3))
        offs = [b.load(b.gep(fa.data, [b.add(row, I64(j))], source_etype=I64), typ=I64) for j in range(3)]
        xrow = e.at(xa.data, b.mul(ci_, e.row_stride(xa)))
        xtaps = [e.at(xrow, offs[j]) for j in range(3)]
        ld = e.row_stride(da)
        drows = [e.at(da.data, b.mul(b.add(b.mul(cb_, I64(m_)), I64(m)), ld)) for m in range(m_)]
        abase = e.at(aa.data, b.mul(arow_, e.row_stride(aa)))
        start = [e.vload(abase, I64(e.lanes * k)) for k in range(3 * m_)]

        def pixels(t, acc):
            acc = list(acc)
            xv = [e.vload(xtaps[j], t) for j in range(3)]
            for m in range(m_):
                dv = e.vload(drows[m], t)
                for j in range(3):
                    acc[m * 3 + j] = e.muladd(dv, xv[j], acc[m * 3 + j])
            return acc

        def sample(n, acc):
            t0 = b.mul(n, lx_)
            return e.counted_loop(t0, b.add(t0, span_), I64(e.lanes), acc, pixels)

        acc = e.counted_loop(n0_, n1_, I64(1), start, sample)
        for k in range(3 * m_):
            e.vstore(acc[k], abase, I64(e.lanes * k))
        return context.get_dummy_value()

    return sig, codegen


@_jit
def _tap_offsets(wp, dh, dw):
    offs = np.empty(9, np.int64)
    for i in range(3):
        for j in range(3):
            offs[i * 3 + j] = i * dh * wp + j * dw
    return offs


@_jit
def conv3x3_dense_forward(x, wb, y, xs, lx, per_sample, pt, pl, dh, dw, threes, length, n0, n1):
    """y[n] = conv(x[n], w) for samples n0..n1-1 of a one-group 3x3 stride-1 convolution.

    x (N, C, H, W); wb (nb, C, 9, M) the weight w (Co, C, 3, 3) in blocks of M = BLOCK_CHANNELS output
    channels (zero rows past Co); y (N, Co, Ho, Wo). Each sample is padded into xs (C, *), zero
    outside the image, at column n*lx when per_sample (xs then holds the whole batch, kept for the
    weight gradient; otherwise xs is unused and each call pads into a scratch (C, lx)); lx covers the
    computed columns plus the taps' reach. The first `length` columns of the wide grid q = ho*Wp + wo
    are computed, columns wo >= Wo dropped: `threes` blocks of three vectors, then blocks of two.
    """
    c_ = x.shape[1]
    co_, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    wp = wo + 2 * dw
    hp = ho + 2 * dh
    lanes = VECTOR_BYTES // x.itemsize
    split = threes * 3 * lanes
    offs = _tap_offsets(wp, dh, dw)
    out = np.empty((wb.shape[0] * BLOCK_CHANNELS, length), x.dtype)
    buf = xs if per_sample else np.zeros((c_, lx), x.dtype)
    yf, of = y.reshape(y.size), out.reshape(out.size)
    for n in range(n0, n1):
        base = n * lx if per_sample else 0
        pad_into(buf, base, x[n], pt, pl, hp, wp, 0, c_)
        for cb in range(wb.shape[0]):
            for q in range(0, split, 3 * lanes):
                _forward_block3(buf, wb, out, offs, cb, base + q, q)
            for q in range(split, length, 2 * lanes):
                _forward_block2(buf, wb, out, offs, cb, base + q, q)
        for co in range(co_):
            for r in range(ho):
                copy(yf, ((n * co_ + co) * ho + r) * wo, of, co * length + r * wp, wo)


@_pjit
def conv3x3_dense_forward_chunks(n, t, x, wb, y, xs, lx, per_sample, pt, pl, dh, dw, threes, length):
    for i in numba.prange(t):
        lo, hi = n * i // t, n * (i + 1) // t
        conv3x3_dense_forward(x, wb, y, xs, lx, per_sample, pt, pl, dh, dw, threes, length, lo, hi)


@_jit
def conv3x3_dense_weight_grad(xs, lx, dy, dyw, dwt, dh, dw, chunk, cb0, cb1):
    """dwt[co] for the output channels of blocks cb0..cb1-1 (co = cb*M + m < Co): the correlation of dy
    with the padded inputs xs that conv3x3_dense_forward kept (per_sample, row stride lx per sample).

    dy (N, Co, Ho, Wo), C-contiguous, is first laid on the same wide grid in dyw (nb*M, N*lx, zeros
    elsewhere; this call writes only its own rows). The sums run over chunks of `chunk` samples (whose
    inputs stay in cache) in lanes of partial sums of the dtype, added in float64 at the end.
    """
    n_, co_, ho, wo = dy.shape
    c_ = xs.shape[0]
    wp = wo + 2 * dw
    lanes = VECTOR_BYTES // xs.itemsize
    m_ = BLOCK_CHANNELS
    span = (ho * wp + lanes - 1) // lanes * lanes  # a sample's columns that can hold dy
    offs = _tap_offsets(wp, dh, dw)
    ld = dyw.shape[1]
    dywf, dyf = dyw.reshape(dyw.size), dy.reshape(dy.size)
    for co in range(cb0 * m_, min(cb1 * m_, co_)):
        for n in range(n_):
            for r in range(ho):
                copy(dywf, co * ld + n * lx + r * wp, dyf, ((n * co_ + co) * ho + r) * wo, wo)
    acc = np.zeros(((cb1 - cb0) * c_ * 3, 3 * m_ * lanes), xs.dtype)
    for n0 in range(0, n_, chunk):
        n1 = min(n0 + chunk, n_)
        for cb in range(cb0, cb1):
            for ci in range(c_):
                for i in range(3):
                    _grad_block(xs, dyw, acc, offs, cb, ci, i, n0, n1, lx, span, ((cb - cb0) * c_ + ci) * 3 + i)
    for cb in range(cb0, cb1):
        for m in range(m_):
            co = cb * m_ + m
            if co >= co_:
                continue
            for ci in range(c_):
                for i in range(3):
                    row = ((cb - cb0) * c_ + ci) * 3 + i
                    for j in range(3):
                        s = 0.0
                        for k in range((m * 3 + j) * lanes, (m * 3 + j + 1) * lanes):
                            s += acc[row, k]
                        dwt[co, ci, i, j] = s


@_pjit
def conv3x3_dense_weight_grad_chunks(n, t, xs, lx, dy, dyw, dwt, dh, dw, chunk):
    for i in numba.prange(t):
        conv3x3_dense_weight_grad(xs, lx, dy, dyw, dwt, dh, dw, chunk, n * i // t, n * (i + 1) // t)
