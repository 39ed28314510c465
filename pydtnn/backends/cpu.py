"""CPU backend: NumPy arrays, a seeded Generator, and the kernels that differ per device.

Layers hold their logic once and call the backend for the few operations a GPU backend does
differently (convolution and pooling through cuDNN there, im2col + GEMM here, or the compiled
direct 3x3 convolution of backends/compiled.py for depthwise and small layers). Everything else in
a layer is written against `backend.xp`, which is `numpy` here and `cupy` on a GPU.

All tensors are NCHW. Convolution geometry is described by `ConvGeometry`, built once per layer.
docs/performance.md explains how each kernel is laid out and what it costs. Every kernel splits
its work over the backend's threads (backends/threads.py), the GEMMs included: each thread fills
the im2col columns of its own samples and multiplies them with a one-thread BLAS, so no BLAS
thread is left spinning on a core that the next copy needs.
"""

import ctypes
import importlib.util
import os
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from pydtnn import env
from pydtnn.backends.threads import split, split_compiled, threads

KERNELS = ("auto", "numba", "numpy")

# Columns of the convolution GEMMs of forward and dx: a sample with fewer output pixels shares its
# GEMM with the next samples (docs/performance.md).
GEMM_MIN_COLUMNS = 128
_ROW_STEP = 8  # a GEMM split over its rows cuts them at multiples of this (whole register blocks)

# Narrowest output computed by the compiled one-group 3x3 kernels: they compute Wo + 2 columns per
# output row, and on narrower images im2col + GEMM is faster (docs/performance.md).
DIRECT_MIN_WIDTH = 8
# Below twice that width, layers with this many input channels or more take im2col + GEMM too: the
# compiled weight gradient loses to the GEMM's there (256 -> 256 channels at 8x8, batch 64: backward
# 164 against 147 ms on one thread, 113 against 83 on two).
DIRECT_NARROW_MAX_CHANNELS = 256

# The weight gradient of a one-group 1x1 stride-1 layer (_pointwise) sums its per-sample products
# in blocks of this many samples, one partial sum per block.
POINTWISE_BLOCK = 8

# A GEMM's work, for threads.split's rule on what is too small to split, in bytes: its FLOPs over
# this (BLAS does about 80 GFLOP/s per core here, NumPy copies about 10 GB/s). By their operands
# alone, MobileNetV1's 512- and 1024-channel 1x1 layers at 4x4 and 2x2 (4-5 ms of GEMM) ran on one
# thread.
GEMM_FLOPS_PER_BYTE = 8


def _gemm_bytes(flops, *arrays):
    return flops // GEMM_FLOPS_PER_BYTE + sum(a.nbytes for a in arrays)


def _pointwise(g, co):
    """A one-group 1x1 convolution, stride 1, no padding, with at least GEMM_MIN_COLUMNS pixels, whose
    weight (co x c) is at most half the size of one sample's x and dy together: one GEMM per sample
    on x and dy as they lie (CPUBackend._pointwise_forward / _pointwise_backward) instead of im2col,
    which for a 1x1 kernel only regroups x. Its weight gradient adds a weight-sized product per
    sample; past that size those additions cost more than regrouping x and dy (512 -> 512 at 16x16,
    batch 64, one thread: 375 against 330 ms a forward and backward)."""
    p = g.ho * g.wo
    return (
        (g.kh, g.kw, g.sh, g.sw, g.groups) == (1, 1, 1, 1, 1)
        and not g.padded
        and p >= GEMM_MIN_COLUMNS
        and 2 * co * g.c <= p * (g.c + co)
    )


# From this size on, the flipped, transposed weights of a GEMM-path dx are copied by a compiled
# kernel (NumPy's copy of the reversed view: 2-4 ms for 512 x 512 x 3 x 3, the kernel 1.2-1.7).
FLIP_COMPILED_MIN_BYTES = 1 << 20

# From this size on, a convolution's bias is added and summed by compiled kernels: NumPy's sum over
# axes (0, 2, 3) takes 0.7 ms for (64, 512, 2, 2), the kernel 0.2; below it Numba is not loaded for it.
BIAS_COMPILED_MIN_BYTES = 1 << 18

# The weight gradient of the compiled one-group 3x3 kernels sums over this many bytes of padded
# input at a time (a chunk of samples), so that they stay in cache.
DIRECT_CHUNK_BYTES = 1 << 20


# BatchNorm is split over channels only from this tensor size: below it a hand-off to the threads
# costs more than the second core saves (docs/performance.md).
BATCHNORM_SPLIT_BYTES = 1 << 20

# glibc malloc: blocks up to this size come from the heap (not a fresh mmap each time), and freed
# heap memory is kept up to KEEP_FREED_BYTES instead of being handed back to the system.
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit systems
KEEP_FREED_BYTES = 1 << 30


@cache
def keep_freed_memory():
    """Make glibc's malloc reuse freed memory for the next step's activations and gradients.

    By default glibc serves each block over its dynamic threshold with a fresh mmap and returns
    freed memory at the top of the heap to the system, so every new array touches fresh pages: a
    ResNet-20 step at batch 64 took about 2,500 page faults on one thread and 4,400 on two (blocks
    freed by the pool's threads move the threshold less), each costing microseconds on a VM. With a
    fixed threshold and no trimming a step takes almost none (docs/performance.md). Process-wide,
    like the BLAS thread count; skipped when MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set
    (the user's choice wins) or when the C library has no mallopt (not glibc). Returns whether set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)) and bool(mallopt(m_trim_threshold, KEEP_FREED_BYTES))


def numba_installed():
    return importlib.util.find_spec("numba") is not None


def resolve_kernels(kernels=None):
    """'numba' or 'numpy': the kernels asked for (default: $PYDTNN_CPU_KERNELS, else 'auto', which is
    'numba' when Numba is installed). Finding Numba does not import it: backends/compiled.py does,
    when a layer first uses a compiled kernel."""
    choice = kernels if kernels is not None else env.cpu_kernels()
    if choice not in KERNELS:
        raise ValueError(f"CPU kernels must be one of {', '.join(KERNELS)}, got {choice!r}")
    if choice == "numba" and not numba_installed():
        raise ValueError("CPU kernels 'numba' asked for, but numba is not installed; pip install numba, or use 'numpy'")
    if choice == "auto":
        return "numba" if numba_installed() else "numpy"
    return choice


def direct_ok(g, co):
    """Whether the compiled direct kernels compute geometry g with co output channels: 3x3, stride 1,
    one group or depthwise (one input and one output channel per group), and padding at most the
    kernel's reach on every side (so that dx, a convolution of dy, is padded too)."""
    eh, ew = 2 * g.dh, 2 * g.dw
    return (
        (g.kh, g.kw, g.sh, g.sw) == (3, 3, 1, 1)
        and (g.groups == 1 or g.groups == g.c == co)
        and 0 <= min(g.pt, g.pb) <= max(g.pt, g.pb) <= eh
        and 0 <= min(g.pl, g.pr) <= max(g.pl, g.pr) <= ew
    )


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes of one 2-D convolution or pooling window, fixed at build time.

    c, h, w: input channels and size; kh, kw: kernel; sh, sw: stride; dh, dw: dilation;
    pt, pb, pl, pr: zero padding top/bottom/left/right; ho, wo: output size; groups.
    """

    c: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int = 1
    sw: int = 1
    dh: int = 1
    dw: int = 1
    pt: int = 0
    pb: int = 0
    pl: int = 0
    pr: int = 0
    groups: int = 1

    @property
    def ho(self):
        return (self.h + self.pt + self.pb - self.dh * (self.kh - 1) - 1) // self.sh + 1

    @property
    def wo(self):
        return (self.w + self.pl + self.pr - self.dw * (self.kw - 1) - 1) // self.sw + 1

    @property
    def padded(self):
        return self.pt or self.pb or self.pl or self.pr


def _dense_layout(ho, wo, dh, dw, itemsize):
    """(threes, length, lx, tail) of the compiled one-group 3x3 kernels for an output of ho x wo. The
    wide grid's Ho*Wp columns, rounded up to whole vectors (at least two), are computed in `threes`
    blocks of three vectors and then blocks of two up to `length` columns: a block of three keeps 12
    accumulators in registers, enough to hide the FMA latency, where a block of two keeps 8 (measured
    10-12% slower per column). Also each sample's columns lx in the padded input (the computed
    columns plus the taps' reach, in whole vectors) and the columns after the last sample that the
    weight gradient reads."""
    lanes = 32 // itemsize
    wp = wo + 2 * dw
    v = max(2, -(-ho * wp // lanes))
    threes = v // 3 if v % 3 != 1 else v // 3 - 1  # the rest in one or two blocks of two
    reach = 2 * dh * wp + 2 * dw
    lx = -(-(v * lanes + reach) // lanes) * lanes
    return threes, v * lanes, lx, -(-reach // lanes) * lanes


def _channel_blocks(w, m):
    """w (Co, C, 3, 3) as (ceil(Co/m), C, 9, m): blocks of m output channels, the last one zero-filled."""
    co, c = w.shape[:2]
    blocks = -(-co // m)
    wz = np.zeros((blocks * m, c, 9), w.dtype)
    wz[:co] = w.reshape(co, c, 9)
    return np.ascontiguousarray(wz.reshape(blocks, m, c, 9).transpose(0, 2, 3, 1))


def _span(n_out, n_in, offset, pad, stride):
    """Outputs o in [lo, hi) whose input index o*stride + offset - pad lies in [0, n_in).

    Returns (output slice, input slice), or None when every output of this kernel offset reads padding.
    """
    first = offset - pad  # input index read by output 0
    lo = max(0, -(first // stride))
    hi = min(n_out, (n_in - 1 - first) // stride + 1)
    if hi <= lo:
        return None
    start = lo * stride + first
    return slice(lo, hi), slice(start, start + (hi - lo - 1) * stride + 1, stride)


@cache
def _positions(g):
    """Kernel positions (k, i, j, out_rows, out_cols, in_rows, in_cols), k = i*kw + j in increasing order.

    For position (i, j), output[..., out_rows, out_cols] reads input[..., in_rows, in_cols] of the
    unpadded input; outputs outside these slices read zero padding. Positions that read only
    padding are left out. Padding may be negative (a crop): the transposed convolution uses that.
    """
    rows = [_span(g.ho, g.h, i * g.dh, g.pt, g.sh) for i in range(g.kh)]
    cols = [_span(g.wo, g.w, j * g.dw, g.pl, g.sw) for j in range(g.kw)]
    return tuple(
        (i * g.kw + j, i, j, r[0], c[0], r[1], c[1])
        for i, r in enumerate(rows)
        for j, c in enumerate(cols)
        if r is not None and c is not None
    )


@cache
def _window_layout(g):
    """(disjoint, covering) for pooling windows: no input element in two windows; every element in one."""
    disjoint = g.sh >= g.dh * (g.kh - 1) + 1 and g.sw >= g.dw * (g.kw - 1) + 1
    covering = (
        disjoint
        and not g.padded
        and (g.sh, g.sw, g.dh, g.dw) == (g.kh, g.kw, 1, 1)
        and (g.h, g.w) == (g.ho * g.kh, g.wo * g.kw)
    )
    return disjoint, covering


@cache
def _in_chunks(n, step, tail, dtype, body, nbytes):
    """body(n0, n1, tmp) over samples [0, n) in chunks of at most `step`, the chunks shared out among
    threads; tmp is a scratch array of shape (n1 - n0, *tail), one per thread."""

    def part(lo, hi):
        tmp = np.empty((min(step, hi - lo), *tail), dtype)
        for n0 in range(lo, hi, step):
            n1 = min(n0 + step, hi)
            body(n0, n1, tmp[: n1 - n0])

    split(n, part, nbytes)


def _transposed(g, co):
    """Geometry of dx = conv(dy, flipped and transposed w) for a stride-1 convolution.

    Its input is dy (co channels, ho x wo); its output is x's shape. Padding becomes d*(k-1) - p,
    negative (a crop) where the forward padded more than d*(k-1).
    """
    et, ew = g.dh * (g.kh - 1), g.dw * (g.kw - 1)
    return ConvGeometry(
        co, g.ho, g.wo, g.kh, g.kw, 1, 1, g.dh, g.dw, et - g.pt, et - g.pb, ew - g.pl, ew - g.pr, groups=g.groups
    )


@cache
def _wide_layout(g):
    """Depthwise layout: the padded input flattened per channel, read at a flat offset per kernel position.

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


class _Loan:
    """A pooled array that a forward keeps for its backward.

    It goes back to the pool when the backward is done with it (`release`), or when this object is
    dropped without a backward (a forward-only call): the next forward of the same layer then
    finds it there instead of faulting in fresh memory.
    """

    __slots__ = ("array", "free", "key")

    def __init__(self, free, key, array):
        self.free, self.key, self.array = free, key, array

    def release(self):
        if self.array is not None:
            self.free.setdefault(self.key, []).append(self.array)
            self.array = None

    def __del__(self):
        self.release()


class _Kept:
    """A forward's input kept for its backward (the depthwise direct convolution needs nothing else)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def release(self):
        self.array = None


class CPUBackend:
    """NumPy backend. One per model, passed down explicitly to every layer.

    dtype: default floating dtype of parameters and activations.
    seed: seeds the Generator used for initialization and dropout masks.
    kernels: 'auto' (default: $PYDTNN_CPU_KERNELS, else Numba's compiled kernels when numba is
    installed), 'numba' or 'numpy' (the pure-NumPy path only); see resolve_kernels and compiled.py.

    Large scratch arrays (im2col matrices) come from a pool keyed by shape and geometry and go back
    to it once their last user is done, so a training step does not page-fault fresh memory for
    them. Arrays handed to the caller (outputs, input gradients) are always new.
    """

    name = "cpu"
    xp = np

    def __init__(self, dtype=np.float32, seed=0, kernels=None):
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        self.kernels = resolve_kernels(kernels)
        threads()  # from here on BLAS runs one thread per caller, the same in every layer (threads.py)
        keep_freed_memory()
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._free = {}  # pool key -> list of arrays nobody holds

    def __repr__(self):
        return f"CPUBackend(dtype={self.dtype.name}, seed={self.seed}, kernels={self.kernels})"

    def reseed(self, key):
        """Restart the Generator from a key (a list of ints): the trainer keys dropout per step."""
        self.rng = np.random.default_rng(key)

    # -- host <-> device -------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Array on this device (no copy when it already is one of the right dtype)."""
        return np.asarray(a, dtype=dtype)

    def to_numpy(self, a):
        return np.asarray(a)

    # -- matrix product --------------------------------------------------------------------
    @staticmethod
    def matmul(a, b, out=None):
        """a (M, K) @ b (K, N), into out when given; split over the columns of the product, so each
        thread reads only its own columns of b (Dense's weight, the large operand each way)."""
        if out is None:
            out = np.empty((a.shape[0], b.shape[1]), np.result_type(a, b))

        def columns(lo, hi):
            np.matmul(a, b[:, lo:hi], out=out[:, lo:hi])

        split(b.shape[1], columns, _gemm_bytes(2 * a.shape[0] * a.shape[1] * b.shape[1], a, b, out))
        return out

    # -- scratch pool ----------------------------------------------------------------------
    def _take(self, tag, shape, dtype, g=None):
        """(key, array) from the pool. A new array is zeroed; a reused one holds what its last user
        left, which im2col relies on: the entries a geometry never writes (padding) stay zero."""
        key = (tag, shape, np.dtype(dtype).str, g)
        free = self._free.get(key)
        return key, (free.pop() if free else np.zeros(shape, dtype))

    def _give(self, key, a):
        self._free.setdefault(key, []).append(a)

    # -- convolution -----------------------------------------------------------------------
    @staticmethod
    def _fill_cols(buf, x, g, lo, hi):
        """Write samples lo..hi-1 of x (N, C, H, W) into buf (C, kh, kw, N, Ho, Wo): buf[(c, i, j), n,
        (ho, wo)] is the input that kernel position (i, j) of channel c sees at output (ho, wo); the
        padding entries are never written (the pool hands out zeroed buffers)."""
        dst = buf.reshape(g.c, g.kh, g.kw, -1, g.ho, g.wo).transpose(3, 0, 1, 2, 4, 5)[lo:hi]
        for _, i, j, orows, ocols, irows, icols in _positions(g):
            dst[:, :, i, j, orows, ocols] = x[lo:hi, :, irows, icols]

    @staticmethod
    def _as_gemm(buf, g):
        """The (G, Cg*kh*kw, N, Ho*Wo) view of an im2col buffer."""
        return buf.reshape(g.groups, g.c // g.groups * g.kh * g.kw, -1, g.ho * g.wo)

    def _conv_gemm(self, x, wm, g, out, tag, cols=None):
        """out (N, G*O, Ho, Wo) = conv(x, wm (G, O, K)) by im2col + GEMM, both split over samples: each
        thread fills the columns of its samples, then multiplies them. (Filling and multiplying a few
        samples at a time, to stay in cache, measured slower with two threads: many small NumPy calls
        make the threads queue for the GIL.) Returns (key, buf), the pooled im2col buffer; with cols
        (G, K, N, P) given, already filled (a 1x1 layer's dx reads dy regrouped), (None, None).

        With many output pixels each sample is one GEMM written straight into NCHW. With few, one
        GEMM per block of samples (at least GEMM_MIN_COLUMNS columns) reads the weight once per block
        instead of once per sample, and a copy reorders the block into NCHW. Blocks start at fixed
        samples, so the thread count never changes a result."""
        n = x.shape[0]
        fill = cols is None
        key = buf = None
        if fill:
            key, buf = self._take(tag, (g.c, g.kh, g.kw, n, g.ho, g.wo), x.dtype, g)  # layout: _fill_cols
            cols = self._as_gemm(buf, g)
        G, o, k, p = wm.shape[0], wm.shape[1], cols.shape[1], cols.shape[3]
        per_block = -(-GEMM_MIN_COLUMNS // p)

        def gemm_blocks(b0, b1):
            lo, hi = b0 * per_block, min(b1 * per_block, n)
            if fill:
                self._fill_cols(buf, x, g, lo, hi)
            if per_block == 1:
                self._gemm_nchw(wm, cols[:, :, lo:hi], out[lo:hi])
                return
            for n0 in range(lo, hi, per_block):
                m = min(n0 + per_block, hi) - n0
                prod = np.matmul(wm, cols[:, :, n0 : n0 + m].reshape(G, k, m * p))
                out[n0 : n0 + m].reshape(m, G, o, p)[...] = prod.reshape(G, o, m, p).transpose(2, 0, 1, 3)

        if n > per_block or o < 2 * _ROW_STEP:
            split(-(-n // per_block), gemm_blocks, _gemm_bytes(2 * G * o * k * n * p, cols))
            return key, buf
        # One block holds the whole batch (few pixels, small batch): the columns are filled split over
        # samples, then the GEMM in two fixed halves of its rows, so that two threads share it and the
        # thread count still changes no bit.
        if fill:
            split(n, lambda lo, hi: self._fill_cols(buf, x, g, lo, hi), buf.nbytes)
        half = -(-o // (2 * _ROW_STEP)) * _ROW_STEP
        flat = cols.reshape(G, k, n * p)

        def rows(h0, h1):
            for h in range(h0, h1):  # one GEMM per half, however many this thread has
                r0, r1 = h * half, min(h * half + half, o)
                prod = np.matmul(wm[:, r0:r1], flat)
                out.reshape(n, G, o, p)[:, :, r0:r1] = prod.reshape(G, r1 - r0, n, p).transpose(2, 0, 1, 3)

        split(2, rows, _gemm_bytes(2 * G * o * k * n * p, cols))
        return key, buf

    @staticmethod
    def _gemm_nchw(wm, cols, out):
        """out (N, G*O, Ho, Wo) = wm (G, O, K) @ cols (G, K, N, P) per group and sample, written in place.

        Each (K, P) slice of cols is a strided matrix BLAS reads directly, so neither the cols nor
        the product is transposed in memory."""
        n = out.shape[0]
        g, o, _ = wm.shape
        np.matmul(wm[:, None], cols.transpose(0, 2, 1, 3), out=out.reshape(n, g, o, -1).transpose(1, 0, 2, 3))

    def _direct(self, g, co):
        """Whether the compiled direct convolution computes this layer (backends/compiled.py): every
        depthwise layer it can, and one-group layers at least DIRECT_MIN_WIDTH outputs wide (twice
        that from DIRECT_NARROW_MAX_CHANNELS input channels on)."""
        if self.kernels != "numba" or not direct_ok(g, co):
            return False
        if g.groups > 1:
            return True
        return g.wo >= DIRECT_MIN_WIDTH and (g.wo >= 2 * DIRECT_MIN_WIDTH or g.c < DIRECT_NARROW_MAX_CHANNELS)

    def _stride1_depthwise(self, g, co):
        """For a stride-2 depthwise 3x3 layer the compiled kernels can take at stride 1: that stride-1
        geometry (its output at even rows and columns is the layer's; its dx from dy spread onto
        those rows and columns, zeros between, is the layer's dx). Else None."""
        if self.kernels != "numba" or (g.sh, g.sw) != (2, 2) or not (g.groups == g.c == co):
            return None
        g1 = replace(g, sh=1, sw=1)
        return g1 if direct_ok(g1, co) else None

    def conv2d_forward(self, x, w, g, keep=True):
        """y = conv(x, w): x (N, C, H, W), w (Co, C/groups, kh, kw) -> y (N, Co, Ho, Wo).

        Returns (y, ctx); ctx holds what backward needs (the im2col matrix, or x itself for the
        direct convolution) when keep is true.
        """
        x = np.asarray(x, dtype=w.dtype)  # the layer's dtype: no silent upcast, and the kernels assume one dtype
        g1 = self._stride1_depthwise(g, w.shape[0])
        if g1 is not None:  # 4x the multiply-adds of the strided layer, but compiled and on all threads
            y1, ctx = self._direct_forward(x, w, g1, keep)
            return np.ascontiguousarray(y1[:, :, : 2 * g.ho : 2, : 2 * g.wo : 2]), ctx
        if self._direct(g, w.shape[0]):
            return self._direct_forward(x, w, g, keep)
        if g.c == g.groups and g.sh == g.sw:
            return self._depthwise_forward(x, w, g, keep)
        if _pointwise(g, w.shape[0]):
            return self._pointwise_forward(x, w, g, keep)
        n, co = x.shape[0], w.shape[0]
        y = np.empty((n, co, g.ho, g.wo), x.dtype)
        key, cols = self._conv_gemm(x, w.reshape(g.groups, co // g.groups, -1), g, y, "cols")
        if not keep:
            self._give(key, cols)
            return y, None
        return y, _Loan(self._free, key, cols)

    def conv2d_backward(self, dy, w, ctx, g, need_dx=True):
        """Gradients of conv2d_forward: returns (dx or None, dw) for upstream dy (N, Co, Ho, Wo)."""
        if ctx is None or ctx.array is None:
            raise RuntimeError(
                "conv2d_backward: no saved forward state; run forward(x, training=True) before each backward"
            )
        dy = np.asarray(dy, dtype=w.dtype)
        g1 = self._stride1_depthwise(g, w.shape[0])
        if g1 is not None:
            key, up = self._take("dyup", (dy.shape[0], dy.shape[1], g1.ho, g1.wo), dy.dtype, g)  # zero between
            up[:, :, : 2 * g.ho : 2, : 2 * g.wo : 2] = dy
            grads = self._direct_backward(up, w, ctx, g1, need_dx)
            self._give(key, up)
            return grads
        if self._direct(g, w.shape[0]):
            return self._direct_backward(dy, w, ctx, g, need_dx)
        if g.c == g.groups and g.sh == g.sw:
            return self._depthwise_backward(dy, w, ctx, g, need_dx)
        if _pointwise(g, w.shape[0]):
            return self._pointwise_backward(dy, w, ctx, need_dx)
        n, co = dy.shape[0], dy.shape[1]
        G, p = g.groups, g.ho * g.wo
        o = co // G
        cols = self._as_gemm(ctx.array, g).reshape(G, -1, n * p)
        ykey, dyk = self._take("dyk", (G, o, n, p), dy.dtype)  # dy with (n, ho, wo) merged: one GEMM for dw

        def regroup(lo, hi):
            dyk[:, :, lo:hi] = dy[lo:hi].reshape(hi - lo, G, o, p).transpose(1, 2, 0, 3)

        split(n, regroup, dy.nbytes)
        dw = np.empty((G, o, cols.shape[1]), dy.dtype)
        dyk2 = dyk.reshape(G, o, n * p)

        def weight_grad(lo, hi):  # columns lo..hi-1 of dw (input channel, kernel position): whole-batch sums
            np.matmul(dyk2, cols[:, lo:hi].transpose(0, 2, 1), out=dw[:, :, lo:hi])

        split(cols.shape[1], weight_grad, _gemm_bytes(2 * dyk.size * cols.shape[1], dyk, cols))
        dw = dw.reshape(w.shape)
        ctx.release()
        if not need_dx:
            self._give(ykey, dyk)
            return None, dw
        if g.sh == 1 and g.sw == 1:
            dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
            # dx is the stride-1 convolution of dy with the flipped, transposed kernel: one GEMM with
            # K = Co/G*kh*kw instead of a GEMM with K = Co/G followed by kh*kw scatter-adds.
            gt = _transposed(g, co)
            wt = self._flipped(w, G, g)
            if g.kh == g.kw == 1 and not gt.padded and 2 * g.ho * g.wo >= GEMM_MIN_COLUMNS:
                # one GEMM per sample, straight into NCHW (blocks of two samples measured slower)

                def data_grad(lo, hi):
                    self._gemm_nchw(wt, dyk[:, :, lo:hi], dx[lo:hi])

                split(n, data_grad, _gemm_bytes(2 * dyk.size * wt.shape[1], dx, dy))
            elif g.kh == g.kw == 1 and not gt.padded:  # blocks of samples; dy regrouped is their columns
                self._conv_gemm(dy, wt, gt, dx, None, cols=dyk)
            else:
                key, dcols = self._conv_gemm(dy, wt, gt, dx, "dcols")
                self._give(key, dcols)
            self._give(ykey, dyk)
            return dx, dw
        dx = self._strided_data_grad(dyk, w, g)
        self._give(ykey, dyk)
        return dx, dw

    # -- one-group 1x1 stride-1 convolution: GEMMs on x and dy as they lie ------------------------
    @staticmethod
    def _pointwise_forward(x, w, g, keep):
        """y[n] = W (Co, C) @ x[n] (C, H*W) for each sample, split over samples; keeps x itself for
        backward (no im2col matrix: a 1x1 kernel's would be x regrouped)."""
        x = np.ascontiguousarray(x)
        n, c, co, p = x.shape[0], g.c, w.shape[0], g.ho * g.wo
        y = np.empty((n, co, g.ho, g.wo), x.dtype)
        w2, x3, y3 = w.reshape(co, c), x.reshape(n, c, p), y.reshape(n, co, p)

        def samples(lo, hi):
            np.matmul(w2, x3[lo:hi], out=y3[lo:hi])

        split(n, samples, _gemm_bytes(2 * n * co * c * p, x, y))
        return y, (_Kept(x) if keep else None)

    @staticmethod
    def _pointwise_backward(dy, w, ctx, need_dx):
        """dw = sum over samples of dy[n] @ x[n]^T: the batch in blocks of POINTWISE_BLOCK samples,
        split over the threads; each block's products are added in sample order into its partial
        sum, and the partial sums in block order, so the sum does not depend on the thread count.
        (Regrouping x and dy for one GEMM with the batch inside K copies both, which costs more than
        these additions.) dx[n] = W^T @ dy[n], split over samples."""
        x = ctx.array
        n, co, c = dy.shape[0], dy.shape[1], x.shape[1]
        p = dy.shape[2] * dy.shape[3]
        dy3, x3 = np.ascontiguousarray(dy).reshape(n, co, p), x.reshape(n, c, p)
        blocks = -(-n // POINTWISE_BLOCK)
        partial = np.zeros((max(blocks, 1), co, c), dy.dtype)

        def weight_grad(b0, b1):
            prod = np.empty((POINTWISE_BLOCK, co, c), dy.dtype)
            for b in range(b0, b1):
                n0 = b * POINTWISE_BLOCK
                m = min(POINTWISE_BLOCK, n - n0)
                np.matmul(dy3[n0 : n0 + m], x3[n0 : n0 + m].transpose(0, 2, 1), out=prod[:m])
                for k in range(m):
                    np.add(partial[b], prod[k], out=partial[b])

        split(blocks, weight_grad, _gemm_bytes(2 * n * co * c * p, x, dy))
        ctx.release()
        dw = partial.sum(axis=0).reshape(w.shape)
        if not need_dx:
            return None, dw
        dx = np.empty(x.shape, dy.dtype)
        wt, dx3 = w.reshape(co, c).T, dx.reshape(n, c, p)

        def data_grad(lo, hi):
            np.matmul(wt, dy3[lo:hi], out=dx3[lo:hi])

        split(n, data_grad, _gemm_bytes(2 * n * co * c * p, dx, dy))
        return dx, dw

    def _flipped(self, w, G, g):
        """(G, C/G, O/G * kh*kw): w (O, C/G, kh, kw) transposed per group and flipped in both kernel
        axes, the weights of dx as a stride-1 convolution of dy. For a 1x1 kernel a view (BLAS reads
        the transposed matrix as it is); else a copy, compiled from FLIP_COMPILED_MIN_BYTES on."""
        o, cg, kk = w.shape[0] // G, w.shape[1], g.kh * g.kw
        if self.kernels != "numba" or w.nbytes < FLIP_COMPILED_MIN_BYTES or kk == 1:
            return w.reshape(G, o, cg, g.kh, g.kw).transpose(0, 2, 1, 3, 4)[..., ::-1, ::-1].reshape(G, cg, -1)
        from pydtnn.backends import compiled

        wt = np.empty((G, cg, o, kk), w.dtype)
        args = (np.ascontiguousarray(w).reshape(G, o, cg, kk), wt)
        split_compiled(compiled.flip_transpose, compiled.flip_transpose_chunks, cg, args, 2 * w.nbytes)
        return wt.reshape(G, cg, -1)

    def _strided_data_grad(self, dyk, w, g):
        """dx of a strided convolution from dy regrouped as dyk (G, O, N, P): dcols = W^T dy, then each
        kernel position's share added back into dx (compiled col2im, or NumPy scatter-adds)."""
        G, o, n, p = dyk.shape
        cg = g.c // G
        dx = np.empty((n, g.c, g.h, g.w), dyk.dtype)
        key, dcols = self._take("dcols", (n, g.c, g.kh, g.kw, g.ho, g.wo), dyk.dtype)
        wmt = w.reshape(G, o, cg * g.kh * g.kw).transpose(0, 2, 1)[:, None]
        pos = _positions(g)

        col2im = None
        if self.kernels == "numba":
            from pydtnn.backends import compiled

            col2im = compiled.col2im

        def data_grad_strided(lo, hi):
            out = dcols[lo:hi].reshape(hi - lo, G, -1, p).transpose(1, 0, 2, 3)
            np.matmul(wmt, dyk[:, :, lo:hi].transpose(0, 2, 1, 3), out=out)
            if col2im is not None:  # one pass per channel plane, in cache
                col2im(dcols, dx, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw, lo, hi)
                return
            dx[lo:hi] = 0
            for _, i, j, orows, ocols, irows, icols in pos:
                dx[lo:hi, :, irows, icols] += dcols[lo:hi, :, i, j, orows, ocols]

        split(n, data_grad_strided, _gemm_bytes(2 * dyk.size * wmt.shape[2], dx, dcols))
        self._give(key, dcols)
        return dx

    # -- direct 3x3 convolution (compiled, small channel counts) ----------------------------
    def _direct_forward(self, x, w, g, keep):
        """Compiled direct convolution (backends/compiled.py), split over samples. A depthwise layer
        keeps x for backward, a one-group layer its padded input."""
        from pydtnn.backends import compiled  # imports Numba: only models that use the kernel pay for it

        x = np.ascontiguousarray(x)
        n = x.shape[0]
        y = np.empty((n, w.shape[0], g.ho, g.wo), x.dtype)
        if g.groups > 1:
            args = (x, w, y, g.pt, g.pl, g.dh, g.dw)
            split_compiled(compiled.depthwise3x3_forward, compiled.depthwise3x3_forward_chunks, n, args, y.nbytes * 9)
            return y, (_Kept(x) if keep else None)
        threes, length, lx, tail = _dense_layout(g.ho, g.wo, g.dh, g.dw, x.itemsize)
        wb = _channel_blocks(w, compiled.BLOCK_CHANNELS)
        # pooled: the padding entries, never written, stay zero from one step to the next
        key, xs = self._take("xs", (g.c, n * lx + tail), x.dtype, g) if keep else (None, None)

        scratch = np.zeros((0, 0), x.dtype)  # without keep, each chunk pads into its own
        args = (x, wb, y, xs if keep else scratch, lx, keep, g.pt, g.pl, g.dh, g.dw, threes, length)
        kernels = compiled.conv3x3_dense_forward, compiled.conv3x3_dense_forward_chunks
        split_compiled(*kernels, n, args, y.nbytes * 9 * g.c)
        return y, (_Loan(self._free, key, xs) if keep else None)

    def _direct_backward(self, dy, w, ctx, g, need_dx):
        """dw split over output channels (one-group layers: blocks of them), dx (a convolution of dy
        with the flipped, transposed kernel) over samples: no thread adds into another's result, so
        the thread count changes nothing."""
        from pydtnn.backends import compiled

        dy = np.ascontiguousarray(dy)
        n, co = dy.shape[0], dy.shape[1]
        dw = np.empty(w.shape, dy.dtype)
        dense = g.groups == 1
        if dense:
            xs, m = ctx.array, compiled.BLOCK_CHANNELS
            lx = _dense_layout(g.ho, g.wo, g.dh, g.dw, dy.itemsize)[2]
            blocks = -(-co // m)
            ykey, dyw = self._take("dyw", (blocks * m, n * lx), dy.dtype, g)  # zero where dy is not written
            chunk = max(1, DIRECT_CHUNK_BYTES // (g.c * lx * dy.itemsize))

            args = (xs, lx, dy, dyw, dw, g.dh, g.dw, chunk)
            kernels = compiled.conv3x3_dense_weight_grad, compiled.conv3x3_dense_weight_grad_chunks
            split_compiled(*kernels, blocks, args, xs.nbytes * 9 * co)
            self._give(ykey, dyw)
        else:
            x = ctx.array

            args = (x, dy, dw, g.pt, g.pl, g.dh, g.dw)
            kernels = compiled.depthwise3x3_weight_grad, compiled.depthwise3x3_weight_grad_chunks
            split_compiled(*kernels, co, args, x.nbytes * 9)
        ctx.release()
        if not need_dx:
            return None, dw
        dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
        pt, pl = 2 * g.dh - g.pt, 2 * g.dw - g.pl
        if dense:
            wt = _channel_blocks(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1], m)
            threes, length, lxt, _ = _dense_layout(g.h, g.w, g.dh, g.dw, dy.itemsize)

            kernel, chunks = compiled.conv3x3_dense_forward, compiled.conv3x3_dense_forward_chunks
            args = (dy, wt, dx, np.zeros((0, 0), dy.dtype), lxt, False, pt, pl, g.dh, g.dw, threes, length)
        else:
            kernel, chunks = compiled.depthwise3x3_forward, compiled.depthwise3x3_forward_chunks
            args = (dy, np.ascontiguousarray(w[:, :, ::-1, ::-1]), dx, pt, pl, g.dh, g.dw)
        split_compiled(kernel, chunks, n, args, dx.nbytes * 9 * (co if dense else 1))
        return dx, dw

    # -- depthwise convolution (one input channel per group) ---------------------------------
    def _wide_weights(self, w, g):
        """Pooled (kh*kw, G, m, L): each kernel position's per-channel weight repeated along the wide
        grid (L = Ho*Wp). NumPy multiplies two contiguous rows faster than a row by a value repeated
        with stride 0 (4.6 against 5.4 ms for the forward loop of the benchmark's layer)."""
        G, kk = g.groups, g.kh * g.kw
        m, length = w.shape[0] // G, _wide_layout(g)[2]
        key, wk = self._take("dww", (kk, G, m, length), w.dtype, g)
        wk[...] = w.reshape(G, m, kk).transpose(2, 0, 1)[..., None]
        return key, wk

    def _depthwise_forward(self, x, w, g, keep):
        """Direct depthwise convolution: y = sum over kernel positions of shifted x times per-channel weights.

        No im2col and no GEMM: a GEMM with one output row per group does almost no arithmetic per
        byte it moves. Works in batch chunks of about 1 MB so the running sums stay in cache.
        """
        n, co = x.shape[0], w.shape[0]
        G, m = g.groups, co // g.groups  # m: channel multiplier
        hp, wp, length, span, offsets, flat = _wide_layout(g)
        s = g.sh
        key, xf = self._take("dwx", (n, g.c, flat), x.dtype, g)  # padding and tail stay zero
        xf[:, :, : hp * wp].reshape(n, g.c, hp, wp)[:, :, g.pt : g.pt + g.h, g.pl : g.pl + g.w] = x
        wkey, wk = self._wide_weights(w, g)
        yw = np.empty((n, G, m, length), x.dtype)
        step = max(1, (1 << 20) // (co * length * x.itemsize))

        def chunk(n0, n1, t):
            ys = yw[n0:n1]
            for k, off in enumerate(offsets):
                xv = xf[n0:n1, :, off : off + span : s][:, :, None, :]
                if k == 0:
                    np.multiply(xv, wk[k], out=ys)
                else:
                    np.multiply(xv, wk[k], out=t)
                    ys += t

        _in_chunks(n, step, (G, m, length), x.dtype, chunk, yw.nbytes)
        self._give(wkey, wk)
        y = np.empty((n, co, g.ho, g.wo), x.dtype)
        y[...] = yw.reshape(n, co, g.ho, wp)[..., : g.wo]
        if not keep:
            self._give(key, xf)
            return y, None
        return y, _Loan(self._free, key, xf)

    def _depthwise_backward(self, dy, w, ctx, g, need_dx):
        n, co = dy.shape[0], dy.shape[1]
        G, m = g.groups, co // g.groups
        hp, wp, length, span, offsets, flat = _wide_layout(g)
        s, xf = g.sh, ctx.array
        # dy on the wide grid, zero in the thrown-away columns so they add nothing below
        dkey, dyw = self._take("dwdy", (n, G, m, length), dy.dtype, g)
        dyw.reshape(n, co, g.ho, wp)[..., : g.wo] = dy
        dwk = np.empty((G, m, g.kh * g.kw), dy.dtype)

        def weight_grads(lo, hi):  # kernel positions lo..hi-1: each a whole-batch sum of its own
            for k in range(lo, hi):
                off = offsets[k]
                dwk[:, :, k] = np.einsum("ngml,ngl->gm", dyw, xf[:, :, off : off + span : s])

        split(len(offsets), weight_grads, dyw.nbytes * len(offsets))
        ctx.release()
        if not need_dx:
            self._give(dkey, dyw)
            return None, dwk.reshape(w.shape)
        xkey, dxf = self._take("dwdx", (n, g.c, flat), dy.dtype, g)
        dxf[...] = 0
        wkey, wk = self._wide_weights(w, g)
        step = max(1, (1 << 20) // (co * length * dy.itemsize))

        def chunk(n0, n1, t):
            for k, off in enumerate(offsets):
                np.multiply(dyw[n0:n1], wk[k], out=t)
                dxv = dxf[n0:n1, :, off : off + span : s]
                dxv += t[:, :, 0] if m == 1 else t.sum(axis=2)

        _in_chunks(n, step, (G, m, length), dy.dtype, chunk, dyw.nbytes)
        self._give(wkey, wk)
        dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
        dx[...] = dxf[:, :, : hp * wp].reshape(n, g.c, hp, wp)[:, :, g.pt : g.pt + g.h, g.pl : g.pl + g.w]
        self._give(dkey, dyw)
        self._give(xkey, dxf)
        return dx, dwk.reshape(w.shape)

    # -- pooling ---------------------------------------------------------------------------
    def maxpool2d_forward(self, x, g, keep=True):
        """Max over windows; padding counts as -inf (PyTorch semantics). Returns (y, argmax ctx).

        One pass per kernel position over strided views of the unpadded input; 2x2 windows at
        stride 2 (VGG's, without padding) take one compiled pass instead (backends/compiled.py),
        with the same results bit for bit. ctx is the index k = i*kw + j of the first maximum in
        each window (ties go to the first, as in PyTorch).
        """
        n = x.shape[0]
        y = np.empty((n, g.c, g.ho, g.wo), x.dtype)
        if self._pool2x2(g):
            from pydtnn.backends import compiled

            idx = np.empty(y.shape if keep else (0, 0, 0, 0), np.uint8)
            args = (np.ascontiguousarray(x), y, idx, keep)
            split_compiled(compiled.maxpool2x2_forward, compiled.maxpool2x2_forward_chunks, n, args, x.nbytes)
            return y, (idx if keep else None)
        pos = _positions(g)
        idx = np.zeros(y.shape, np.uint8 if g.kh * g.kw <= 256 else np.int32) if keep else None
        won = np.empty(y.shape, idx.dtype) if keep else None
        full = pos[0][0] == 0 and pos[0][3] == slice(0, g.ho) and pos[0][4] == slice(0, g.wo)

        def part(lo, hi):
            if full:
                y[lo:hi] = x[lo:hi, :, pos[0][5], pos[0][6]]
            else:
                y[lo:hi] = -np.inf
            for k, _, _, orows, ocols, irows, icols in pos[1:] if full else pos:
                yv, v = y[lo:hi, :, orows, ocols], x[lo:hi, :, irows, icols]
                if keep:
                    # positions come in increasing k, so the running index is the max of k over the wins
                    wv = won[lo:hi, :, orows, ocols]
                    np.multiply(np.greater(v, yv), idx.dtype.type(k), out=wv)
                    iv = idx[lo:hi, :, orows, ocols]
                    np.maximum(iv, wv, out=iv)
                np.maximum(yv, v, out=yv)

        split(n, part, x.nbytes)
        return y, idx

    def maxpool2d_backward(self, dy, ctx, g):
        """dx: each window's dy added at its first maximum, exactly +0.0 where no window's maximum
        lies (PyTorch's scatter: a NaN or infinite dy reaches the maximum's input only)."""
        idx = ctx
        n = dy.shape[0]
        if self._pool2x2(g):
            from pydtnn.backends import compiled

            dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
            bits = np.dtype(f"i{dy.itemsize}")  # the kernel moves float bits through an integer mask
            args = (np.ascontiguousarray(dy).view(bits), idx, dx.view(bits))
            split_compiled(compiled.maxpool2x2_backward, compiled.maxpool2x2_backward_chunks, n, args, 2 * dx.nbytes)
            return dx
        disjoint, _ = _window_layout(g)
        dx = np.zeros((n, g.c, g.h, g.w), dy.dtype)
        pos = _positions(g)

        def part(lo, hi):
            for k, _, _, orows, ocols, irows, icols in pos:
                won = idx[lo:hi, :, orows, ocols] == k
                dxv, dyv = dx[lo:hi, :, irows, icols], dy[lo:hi, :, orows, ocols]
                if disjoint:
                    np.copyto(dxv, dyv, where=won)
                else:
                    np.add(dxv, dyv, out=dxv, where=won)

        split(n, part, dx.nbytes)
        return dx

    def _pool2x2(self, g):
        """Whether pooling runs the compiled 2x2 stride-2 kernels (no padding, floor mode)."""
        return self.kernels == "numba" and (g.kh, g.kw, g.sh, g.sw) == (2, 2, 2, 2) and not g.padded

    def avgpool2d_forward(self, x, g, keep=True):
        """Mean over windows; zero padding is counted in the divisor (PyTorch's default). 2x2
        windows at stride 2 take one compiled pass (the same bits as the NumPy passes)."""
        y = np.empty((x.shape[0], g.c, g.ho, g.wo), x.dtype)
        if self._pool2x2(g):
            from pydtnn.backends import compiled

            args = (np.ascontiguousarray(x), y)
            split_compiled(compiled.avgpool2x2_forward, compiled.avgpool2x2_forward_chunks, x.shape[0], args, x.nbytes)
            return y, None
        pos = _positions(g)
        full = pos[0][0] == 0 and pos[0][3] == slice(0, g.ho) and pos[0][4] == slice(0, g.wo)

        def part(lo, hi):
            if full:
                y[lo:hi] = x[lo:hi, :, pos[0][5], pos[0][6]]
            else:
                y[lo:hi] = 0
            for _, _, _, orows, ocols, irows, icols in pos[1:] if full else pos:
                yv = y[lo:hi, :, orows, ocols]
                yv += x[lo:hi, :, irows, icols]
            y[lo:hi] /= g.kh * g.kw

        split(x.shape[0], part, x.nbytes)
        return y, None

    def avgpool2d_backward(self, dy, ctx, g):
        if self._pool2x2(g):
            from pydtnn.backends import compiled

            dx = np.empty((dy.shape[0], g.c, g.h, g.w), dy.dtype)
            args = (np.ascontiguousarray(dy), dx)
            kernels = compiled.avgpool2x2_backward, compiled.avgpool2x2_backward_chunks
            split_compiled(*kernels, dy.shape[0], args, dx.nbytes)
            return dx
        disjoint, covering = _window_layout(g)
        share = dy / (g.kh * g.kw)
        dx = (np.empty if covering else np.zeros)((dy.shape[0], g.c, g.h, g.w), dy.dtype)
        pos = _positions(g)

        def part(lo, hi):
            for _, _, _, orows, ocols, irows, icols in pos:
                dxv = dx[lo:hi, :, irows, icols]
                if disjoint:
                    dxv[...] = share[lo:hi, :, orows, ocols]
                else:
                    dxv += share[lo:hi, :, orows, ocols]

        split(dy.shape[0], part, dx.nbytes)
        return dx

    # -- convolution bias ------------------------------------------------------------------
    def bias_forward(self, y, b):
        """y (N, C, H, W) += b (C,) per channel, in place: from BIAS_COMPILED_MIN_BYTES on by a
        compiled kernel split over the threads (a C-contiguous y), else NumPy's broadcast add."""
        if self.kernels != "numba" or y.nbytes < BIAS_COMPILED_MIN_BYTES or not y.flags.c_contiguous:
            y += b.reshape(1, -1, 1, 1)
            return
        from pydtnn.backends import compiled

        n, c, h, w = y.shape
        args = (y.reshape(n, c, h * w), b)
        split_compiled(compiled.bias_add, compiled.bias_add_chunks, y.shape[0], args, y.nbytes)

    def bias_backward(self, dy, out):
        """out (C,) = dy (N, C, H, W) summed over samples and pixels: float32 from
        BIAS_COMPILED_MIN_BYTES on by a compiled kernel split over channels, accumulated in float64;
        else (and float64, which NumPy's pairwise sum adds more accurately) NumPy's sum."""
        if self.kernels != "numba" or dy.nbytes < BIAS_COMPILED_MIN_BYTES or dy.dtype != np.float32:
            dy.sum(axis=(0, 2, 3), out=out)
            return
        from pydtnn.backends import compiled

        n, c, h, w = dy.shape
        args = (np.ascontiguousarray(dy).reshape(n, c, h * w), out)
        split_compiled(compiled.bias_grad, compiled.bias_grad_chunks, dy.shape[1], args, dy.nbytes)

    # -- ReLU ------------------------------------------------------------------------------
    @property
    def fused_relu(self):
        """Whether ReLU runs the compiled kernels (compiled.py): one pass each way, split over the
        threads in contiguous runs of elements."""
        return self.kernels == "numba"

    def relu_forward(self, x):
        from pydtnn.backends import compiled

        x = np.ascontiguousarray(x)
        y = np.empty_like(x)
        args = (x.reshape(-1), y.reshape(-1))
        split_compiled(compiled.relu_forward, compiled.relu_forward_chunks, x.size, args, 2 * x.nbytes)
        return y

    def relu_backward(self, dy, y):
        """dy where y > 0, else 0."""
        from pydtnn.backends import compiled

        dy, y = np.ascontiguousarray(dy), np.ascontiguousarray(y)
        dx = np.empty_like(dy)
        args = (dy.reshape(-1), y.reshape(-1), dx.reshape(-1))
        split_compiled(compiled.relu_backward, compiled.relu_backward_chunks, dy.size, args, 3 * dy.nbytes)
        return dx

    # -- batch normalization ---------------------------------------------------------------
    @property
    def fused_batchnorm(self):
        """Whether training-mode BatchNorm runs the compiled per-channel kernels (compiled.py)."""
        return self.kernels == "numba"

    def batchnorm_forward(self, x, weight, bias, eps):
        """Training-mode batch normalization of x (N, C, ...): returns (y, mean, var), the batch
        statistics in float64. Split over channels: each channel is one thread's whole work, so the
        thread count never changes a result."""
        from pydtnn.backends import compiled

        x3 = _channel_rows(x)
        y = np.empty(x3.shape, x.dtype)
        mean, var = np.empty(x3.shape[1]), np.empty(x3.shape[1])
        w64, b64 = weight.astype(np.float64), bias.astype(np.float64)

        args = (x3, w64, b64, float(eps), y, mean, var)
        nbytes = x.nbytes if x.nbytes >= BATCHNORM_SPLIT_BYTES else 0
        split_compiled(compiled.batchnorm_forward, compiled.batchnorm_forward_chunks, x3.shape[1], args, nbytes)
        return y.reshape(x.shape), mean, var

    def batchnorm_backward(self, dy, x, mean, inv_std, weight):
        """Gradients of batchnorm_forward: returns (dx, dbias, dweight), the last two float64 (C,)."""
        from pydtnn.backends import compiled

        dy3, x3 = _channel_rows(dy), _channel_rows(x)
        dx = np.empty(x3.shape, dy.dtype)
        db, dw = np.empty(x3.shape[1]), np.empty(x3.shape[1])
        w64 = weight.astype(np.float64)

        args = (dy3, x3, mean, inv_std, w64, dx, db, dw)
        nbytes = x.nbytes if x.nbytes >= BATCHNORM_SPLIT_BYTES else 0
        split_compiled(compiled.batchnorm_backward, compiled.batchnorm_backward_chunks, x3.shape[1], args, nbytes)
        return dx.reshape(dy.shape), db, dw


def _channel_rows(a):
    """The contiguous (N, C, L) view of an (N, C) or (N, C, H, W) array."""
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[0], a.shape[1], -1)
