"""Vector helpers of the compiled kernels: LLVM IR vector loads, stores and fused multiply-adds of
isa.VECTOR_BITS bits (an emitter used by the dense 3x3 blocks), and the copies and padding built on
them."""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pydtnn.backends.cpu.isa import VECTOR_BITS, VECTOR_BYTES
from pydtnn.backends.cpu.kernels.jit import jit as _jit


@_jit
def rounded(length):
    """length rounded up to whole vectorized iterations (8 lanes x 4 interleaved): for short rows
    (8x8 images) the scalar remainder loop would otherwise cost as much as the vector loop. The
    extra outputs read the zero tail of the scratch input and are never copied out."""
    return (length + 31) // 32 * 32


@_jit
def pad_into(xs, start, xn, pt, pl, hp, wp, c0, c1):
    """Copy channels c0..c1-1 of one sample xn (C, H, W) into the flat padded grid that starts at
    column `start` of xs (C, *), at (pt, pl); the border is never written, so it stays zero. Rows
    and columns beyond the grid are left out. Both C-contiguous."""
    h, w = xn.shape[1], xn.shape[2]
    cols = min(w, wp - pl)
    ld = xs.shape[1]
    xsf, xf = xs.reshape(xs.size), xn.reshape(xn.size)
    for c in range(c0, c1):
        for r in range(min(h, hp - pt)):
            copy(xsf, c * ld + start + (r + pt) * wp + pl, xf, (c * h + r) * w, cols)


@_jit
def copy(dst, di, src, si, count):
    """dst[di : di + count] = src[si : si + count] (1-D contiguous arrays, not overlapping): whole
    vectors, the last one overlapping the one before where count is not a multiple of the lanes."""
    lanes = VECTOR_BYTES // dst.itemsize
    if count < lanes:
        for k in range(count):
            dst[di + k] = src[si + k]
        return
    k = 0
    while k + lanes < count:
        vcopy(dst, di + k, src, si + k)
        k += lanes
    vcopy(dst, di + count - lanes, src, si + count - lanes)




def vector_of(context, dtype):
    """(element type, lanes, vector type, multiply-add intrinsic name) of VECTOR_BITS-bit vectors of dtype.
    llvm.fmuladd, not llvm.fma: LLVM fuses it into one instruction where the CPU has FMA, and emits a
    multiply and an add where it has not (llvm.fma would call the C library's fma for each lane there)."""
    elem = context.get_value_type(dtype)
    lanes = VECTOR_BITS // dtype.bitwidth
    return elem, lanes, ir.VectorType(elem, lanes), f"llvm.fmuladd.v{lanes}f{dtype.bitwidth}"


def same_dtype(*arrays):
    """Whether these intrinsic arguments are arrays of one dtype: the intrinsics read and write every array
    through vectors of the first one's element type, so a mixed call must not type (it would read
    float32 memory as float64 or the reverse)."""
    return all(isinstance(a, types.Array) for a in arrays) and len({a.dtype for a in arrays}) == 1


class Emitter:
    """Small helpers over an IRBuilder for one element type."""

    def __init__(self, context, builder, dtype):
        self.b = builder
        self.elem, self.lanes, self.vec, name = vector_of(context, dtype)
        self.align = dtype.bitwidth // 8
        mod = builder.module
        self.muladd_fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(self.vec, [self.vec] * 3), name=name)

    def at(self, base, index):
        return self.b.gep(base, [index], source_etype=self.elem)

    def vload(self, base, index):
        ptr = self.b.bitcast(self.at(base, index), self.vec.as_pointer())
        return self.b.load(ptr, typ=self.vec, align=self.align)

    def vstore(self, value, base, index):
        self.b.store(value, self.b.bitcast(self.at(base, index), self.vec.as_pointer()), align=self.align)

    def splat(self, base, index):
        s = self.b.load(self.at(base, index), typ=self.elem, align=self.align)
        undef = ir.Constant(self.vec, ir.Undefined)
        mask = ir.Constant(ir.VectorType(ir.IntType(32), self.lanes), [0] * self.lanes)
        return self.b.shuffle_vector(self.b.insert_element(undef, s, I64(0)), undef, mask)

    def muladd(self, a, b, c):
        """a * b + c, lane by lane (fused where the CPU has FMA)."""
        return self.b.call(self.muladd_fn, [a, b, c])

    def row_stride(self, ary):
        """Elements between the rows of a 2-D array."""
        return self.b.udiv(self.b.extract_value(ary.strides, 0), I64(self.align))

    def counted_loop(self, start, stop, step, carried, body):
        """for i in range(start, stop, step) with start < stop: carried values (LLVM values) pass from
        one iteration to the next; body(i, values) returns the next ones. Returns the final ones."""
        b = self.b
        pre = b.block
        loop = b.append_basic_block("loop")
        done = b.append_basic_block("done")
        b.branch(loop)
        b.position_at_end(loop)
        i = b.phi(I64)
        i.add_incoming(start, pre)
        phis = []
        for v in carried:
            p = b.phi(v.type)
            p.add_incoming(v, pre)
            phis.append(p)
        nxt = body(i, phis)
        i1 = b.add(i, step)
        end = b.block
        i.add_incoming(i1, end)
        for p, v in zip(phis, nxt):
            p.add_incoming(v, end)
        b.cbranch(b.icmp_signed("<", i1, stop), loop, done)
        b.position_at_end(done)
        return nxt


I64 = ir.IntType(64)


def _vector_move(add):
    """An intrinsic (dst, di, src, si) that stores src[si : si + lanes] into dst[di : di + lanes], one
    vector (1-D contiguous arrays), added to what dst holds when `add`."""

    @intrinsic
    def move(typingctx, dst, di, src, si):
        if not same_dtype(dst, src):
            return None
        sig = types.void(dst, di, src, si)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, signature.args[0].dtype)
            da, sa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2))
            v = e.vload(sa.data, args[3])
            if add:
                v = builder.fadd(e.vload(da.data, args[1]), v)
            e.vstore(v, da.data, args[1])
            return context.get_dummy_value()

        return sig, codegen

    return move


vadd = _vector_move(add=True)  # dst[di : di + lanes] += src[si : si + lanes]
vcopy = _vector_move(add=False)  # dst[di : di + lanes] = src[si : si + lanes]


@intrinsic
def vzip(typingctx, out, oi, p0, p1, pi):
    """out[oi : oi + 2*lanes] = p0[pi], p1[pi], p0[pi + 1], p1[pi + 1], ... (1-D contiguous arrays)."""
    if not same_dtype(out, p0, p1):
        return None
    sig = types.void(out, oi, p0, p1, pi)

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, signature.args[0].dtype)
        oa, a0, a1 = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
        v0, v1 = e.vload(a0.data, args[4]), e.vload(a1.data, args[4])
        n = e.lanes
        for h in range(2):
            mask = [x for k in range(h * n // 2, (h + 1) * n // 2) for x in (k, k + n)]
            zipped = builder.shuffle_vector(v0, v1, ir.Constant(ir.VectorType(ir.IntType(32), n), mask))
            e.vstore(zipped, oa.data, builder.add(args[1], I64(h * n)))
        return context.get_dummy_value()

    return sig, codegen
