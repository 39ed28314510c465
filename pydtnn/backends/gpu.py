"""GPU backend: CuPy arrays, cuDNN frontend graphs for convolution, CUDA kernels for pooling and dropout.

The Backend contract of backends/base.py: its generic operations run here on `cupy` (Dense is a
cuBLAS GEMM through CuPy's matmul, activations and BatchNorm are CuPy elementwise and reduction
kernels), and this class overrides the ones a GPU does its own way:

- convolution forward, data gradient and weight gradient: one cuDNN frontend graph per
  (operation, batch size, geometry), built on first use and cached (`ConvGraphs`);
- max and average pooling: CUDA kernels compiled once by CuPy, NCHW, one thread per output
  (forward) or per input element (backward: a gather, so results do not depend on thread order);
- dropout masks: a counter-based hash of (seed, element index), seeded from the host Generator,
  so masks are reproducible, cheap, and follow `reseed()` exactly as on the CPU;
- the SGD and Adam/AdamW updates: one CuPy elementwise kernel each, the math of base.py in one pass.

Why this stack: CuPy 14 no longer wraps cuDNN, and NVIDIA's cuDNN frontend Python package
(`nvidia-cudnn-frontend`) is the maintained way to reach cuDNN's graph API; pycuda needs a full CUDA
toolkit to build and scikit-cuda is unmaintained and fails on NumPy 2.

Initialization draws from the same host NumPy Generator as the CPU backend, so a model built with
the same seed starts from the same weights on either device.

Nothing here is imported by `import pydtnn` or by the CPU path: `get_backend("gpu")` imports it.
"""

import contextlib
import dataclasses
import functools
import os

import numpy as np

from pydtnn.backends.base import Backend
from pydtnn.errors import ConfigError

_INSTALL = "pip install -e '.[gpu-cuda13]' (CUDA 13) or '.[gpu]' (CUDA 12)"


def gpu_status():
    """(number of visible GPUs, reason when none can be used): never raises."""
    try:
        import cupy
    except ImportError as e:
        return 0, f"CuPy is not installed ({e}); {_INSTALL}"
    except Exception as e:  # noqa: BLE001 (a broken CUDA installation fails at import in many ways)
        return 0, f"CuPy cannot be imported: {e}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 (cudaErrorInsufficientDriver, cudaErrorNoDevice, no libcuda...)
        return 0, f"no usable GPU: {e}"
    return count, ("" if count else "no GPU is visible (CUDA reports 0 devices)")


def _require_cupy():
    count, reason = gpu_status()
    if not count:
        raise ConfigError(f"the GPU backend needs CuPy and a visible GPU; {reason}")
    import cupy

    return cupy


def _require_cudnn():
    try:
        import cudnn
    except ImportError as e:
        raise ConfigError(
            f"the GPU backend needs NVIDIA's cuDNN frontend ({e}); pip install nvidia-cudnn-frontend "
            f"(part of {_INSTALL})"
        ) from None
    return cudnn


def local_rank():
    """This process's rank among the processes of its node, from the launcher's environment (0 alone)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "PMI_LOCAL_RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


# -- CUDA kernels ----------------------------------------------------------------------------
_POOL_SRC = r"""
typedef float real;
extern "C" {
__global__ void maxpool_fwd(const real* x, real* y, int* arg, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int wo = i % Wo, ho = (i / Wo) % Ho;
    long long nc = i / ((long long)Wo * Ho);
    const real* xc = x + nc * H * W;
    int h0 = ho * sh - pt, w0 = wo * sw - pl, best_at = -1;
    real best = -__int_as_float(0x7f800000);
    for (int a = 0; a < kh; a++) {
        int h = h0 + a;
        if (h < 0 || h >= H) continue;
        for (int b = 0; b < kw; b++) {
            int w = w0 + b;
            if (w < 0 || w >= W) continue;
            real v = xc[h * W + w];
            // the first maximum in row-major window order wins; NaN wins over numbers
            if (best_at < 0 || v > best || (v != v && best == best)) { best = v; best_at = h * W + w; }
        }
    }
    y[i] = best;
    arg[i] = best_at;
}

// first output row (column) whose window reaches input row h: ceil((h + pt - kh + 1) / sh), at least 0
__device__ int first_window(int h, int pt, int kh, int sh) {
    int a = h + pt - kh + 1;
    return a <= 0 ? 0 : (a + sh - 1) / sh;
}

// dx[p] = sum of dy[o] over the windows o that contain p and whose maximum was p: a gather, no atomics
__global__ void maxpool_bwd(const real* dy, const int* arg, real* dx, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int w = i % W, h = (i / W) % H;
    long long nc = i / ((long long)W * H);
    int p = h * W + w;
    int ho1 = min(Ho - 1, (h + pt) / sh), wo1 = min(Wo - 1, (w + pl) / sw);
    real s = 0;
    for (int ho = first_window(h, pt, kh, sh); ho <= ho1; ho++)
        for (int wo = first_window(w, pl, kw, sw); wo <= wo1; wo++) {
            long long o = (nc * Ho + ho) * Wo + wo;
            if (arg[o] == p) s += dy[o];
        }
    dx[i] = s;
}

// mean over the window; zero padding counts in the divisor (kh * kw), as PyTorch's default
__global__ void avgpool_fwd(const real* x, real* y, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int wo = i % Wo, ho = (i / Wo) % Ho;
    long long nc = i / ((long long)Wo * Ho);
    const real* xc = x + nc * H * W;
    int h0 = ho * sh - pt, w0 = wo * sw - pl;
    real s = 0;
    for (int a = max(0, -h0); a < kh && h0 + a < H; a++)
        for (int b = max(0, -w0); b < kw && w0 + b < W; b++) s += xc[(h0 + a) * W + w0 + b];
    y[i] = s / (real)(kh * kw);
}

__global__ void avgpool_bwd(const real* dy, real* dx, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int w = i % W, h = (i / W) % H;
    long long nc = i / ((long long)W * H);
    int ho1 = min(Ho - 1, (h + pt) / sh), wo1 = min(Wo - 1, (w + pl) / sw);
    real s = 0;
    for (int ho = first_window(h, pt, kh, sh); ho <= ho1; ho++)
        for (int wo = first_window(w, pl, kw, sw); wo <= wo1; wo++) s += dy[(nc * Ho + ho) * Wo + wo];
    dx[i] = s / (real)(kh * kw);
}
}
"""

# splitmix64 of (seed, index): a uniform 24-bit number per element, compared with the drop rate
_DROPOUT_SRC = r"""
unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ULL;
z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
z = z ^ (z >> 31);
float u = (float)(z >> 40) * (1.0f / 16777216.0f);
mask = u >= rate ? (T)scale : (T)0;
"""


class GPUBackend(Backend):
    """CuPy backend on one GPU: device = local rank modulo visible GPUs (or `device`).

    dtype: float32 (cuDNN's convolution engines are float32/half; float64 is refused).
    cuDNN may use TF32 tensor cores for float32 convolutions (faster, ~1e-3 relative error):
    pydtnn.runtime.configure(tf32=False) before the first CUDA call of the process turns TF32 off in
    every CUDA library. CuPy's matmul (Dense) uses TF32 only when CUPY_TF32=1 is set.
    """

    name = "gpu"

    def __init__(self, dtype=np.float32, seed=0, device=None):
        if np.dtype(dtype) != np.float32:
            raise ConfigError(f"the GPU backend computes in float32; got dtype {np.dtype(dtype).name}")
        cp = _require_cupy()
        super().__init__(cp, dtype, seed)
        self.cupy = cp
        count = cp.cuda.runtime.getDeviceCount()
        self.device_id = (local_rank() if device is None else int(device)) % count
        self.device = cp.cuda.Device(self.device_id)
        self.device.use()
        self.convs = ConvGraphs(self)
        self._pool = cp.RawModule(code=_POOL_SRC)
        self._dropout = cp.ElementwiseKernel("uint64 seed, float32 rate, float32 scale", "T mask", _DROPOUT_SRC,
                                             "pydtnn_dropout_mask")
        self._pinned = {}

    def __repr__(self):
        return f"GPUBackend(device={self.device_id}, dtype={self.dtype.name}, seed={self.seed})"

    # -- host <-> device -------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Array on this GPU (a synchronous copy from the host; see batch_to_device for batches)."""
        cp = self.cupy
        if isinstance(a, cp.ndarray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        return cp.asarray(np.asarray(a, dtype=dtype))

    def batch_to_device(self, a):
        """A training batch on this GPU. Host arrays of 64 KB and more are copied asynchronously through
        page-locked buffers, two per shape used in turn: the host waits only for the copy out of the
        buffer it is about to refill (two batches back), not for the computation queued since, so it
        prepares the next step while the GPU runs this one. Only batches take this path, so page-locked
        memory stays at two batches per shape (at most 8 shapes)."""
        cp = self.cupy
        if isinstance(a, cp.ndarray):
            return a
        a = np.asarray(a)
        if a.nbytes < (1 << 16) or not a.flags.c_contiguous:
            return cp.asarray(a)
        key = (a.shape, a.dtype.str)
        slots = self._pinned.get(key)
        if slots is None:
            import cupyx

            if len(self._pinned) >= 8:  # batches come in a few shapes; anything else is not kept forever
                for _, done in self._pinned.pop(next(iter(self._pinned))):
                    if done is not None:
                        done.synchronize()
            slots = self._pinned[key] = [[cupyx.empty_pinned(a.shape, a.dtype), None] for _ in range(2)]
        slots.append(slots.pop(0))  # round robin
        slot = slots[-1]
        host, done = slot
        if done is not None:
            done.synchronize()  # the copy that last read this buffer is over
        host[...] = a
        stream = cp.cuda.get_current_stream()
        out = cp.empty(a.shape, a.dtype)
        out.set(host, stream=stream)
        slot[1] = cp.cuda.Event(disable_timing=True)
        slot[1].record(stream)
        return out

    def to_numpy(self, a):
        return a.get() if isinstance(a, self.cupy.ndarray) else np.asarray(a)

    def matmul(self, a, b, out=None):
        """a @ b (cuBLAS), into out when given."""
        return self.cupy.matmul(a, b, out=out)

    def synchronize(self):
        self.cupy.cuda.get_current_stream().synchronize()

    # -- convolution -----------------------------------------------------------------------
    @staticmethod
    def _unpadded(g):
        """For uneven padding (top != bottom or left != right, e.g. 'same' with an even kernel), the
        geometry of the convolution of the explicitly padded input; None when padding is even, which
        cuDNN's engines take as it is."""
        if g.pt == g.pb and g.pl == g.pr:
            return None
        return dataclasses.replace(g, h=g.h + g.pt + g.pb, w=g.w + g.pl + g.pr, pt=0, pb=0, pl=0, pr=0)

    def conv2d_plan(self, g, weight_shape):
        """The geometry itself: cuDNN graphs are built per batch size, on first use (ConvGraphs)."""
        return g

    def conv2d_forward(self, x, w, g, keep=True):
        cp = self.cupy
        x = cp.ascontiguousarray(x)
        gp = self._unpadded(g)
        if gp is not None:
            x, g = cp.pad(x, ((0, 0), (0, 0), (g.pt, g.pb), (g.pl, g.pr))), gp
        y = cp.empty((x.shape[0], w.shape[0], g.ho, g.wo), x.dtype)
        self.convs.run("fprop", x.shape[0], g, w.shape, {"X": x, "W": w, "Y": y})
        return y, (x if keep else None)

    def conv2d_backward(self, dy, w, ctx, g, need_dx=True):
        cp = self.cupy
        x = ctx  # the padded input when padding is uneven
        g0, gp = g, self._unpadded(g)
        g = g if gp is None else gp
        dy = cp.ascontiguousarray(dy)
        n = dy.shape[0]
        dw = cp.empty(w.shape, w.dtype)
        self.convs.run("wgrad", n, g, w.shape, {"X": x, "DY": dy, "DW": dw})
        if not need_dx:
            return None, dw
        dx = cp.empty((n, g.c, g.h, g.w), dy.dtype)
        self.convs.run("dgrad", n, g, w.shape, {"DY": dy, "W": w, "DX": dx})
        if gp is not None:
            dx = cp.ascontiguousarray(dx[:, :, g0.pt : g0.pt + g0.h, g0.pl : g0.pl + g0.w])
        return dx, dw

    # -- convolution bias ------------------------------------------------------------------
    @staticmethod
    def bias_forward(y, b):
        """y (N, C, H, W) += b (C,) per channel, in place."""
        y += b.reshape(1, -1, 1, 1)

    @staticmethod
    def bias_backward(dy, out):
        """out (C,) = dy (N, C, H, W) summed over samples and pixels."""
        dy.sum(axis=(0, 2, 3), out=out)

    # -- pooling ---------------------------------------------------------------------------
    def _launch(self, name, total, *args):
        threads = 256
        blocks = (total + threads - 1) // threads
        if blocks:
            self._pool.get_function(name)((blocks,), (threads,), args)

    def _pool_args(self, g):
        i32 = np.int32
        return (i32(g.h), i32(g.w), i32(g.ho), i32(g.wo), i32(g.kh), i32(g.kw), i32(g.sh), i32(g.sw),
                i32(g.pt), i32(g.pl))

    def maxpool2d_forward(self, x, g, keep=True):
        cp = self.cupy
        x = cp.ascontiguousarray(x)
        n = x.shape[0]
        y = cp.empty((n, g.c, g.ho, g.wo), x.dtype)
        arg = cp.empty(y.shape, cp.int32)  # index of each maximum within its (n, c) plane
        self._launch("maxpool_fwd", y.size, x, y, arg, np.int64(y.size), *self._pool_args(g))
        return y, (arg if keep else None)

    def maxpool2d_backward(self, dy, ctx, g):
        cp = self.cupy
        dy = cp.ascontiguousarray(dy)
        dx = cp.empty((dy.shape[0], g.c, g.h, g.w), dy.dtype)
        self._launch("maxpool_bwd", dx.size, dy, ctx, dx, np.int64(dx.size), *self._pool_args(g))
        return dx

    def avgpool2d_forward(self, x, g, keep=True):
        cp = self.cupy
        x = cp.ascontiguousarray(x)
        y = cp.empty((x.shape[0], g.c, g.ho, g.wo), x.dtype)
        self._launch("avgpool_fwd", y.size, x, y, np.int64(y.size), *self._pool_args(g))
        return y, None

    def avgpool2d_backward(self, dy, ctx, g):
        cp = self.cupy
        dy = cp.ascontiguousarray(dy)
        dx = cp.empty((dy.shape[0], g.c, g.h, g.w), dy.dtype)
        self._launch("avgpool_bwd", dx.size, dy, dx, np.int64(dx.size), *self._pool_args(g))
        return dx

    # -- dropout ---------------------------------------------------------------------------
    def dropout_mask(self, shape, rate, dtype):
        """Mask of 0 and 1/(1-rate), drawn from a seed taken from the host Generator."""
        seed = np.uint64(self.rng.integers(0, 2**63))
        mask = self.cupy.empty(shape, dtype)
        self._dropout(seed, np.float32(rate), np.float32(1 / (1 - rate)), mask)
        return mask

    # -- optimizer updates ---------------------------------------------------------------------
    def sgd_update(self, p, g, buf, tmp, lr, weight_decay, momentum, dampening, nesterov, first):
        t = p.dtype.type
        plain, with_momentum, _ = _update_kernels()
        if not momentum:
            plain(g, t(lr), t(weight_decay), p)
            return
        with_momentum(g, t(lr), t(weight_decay), t(momentum), t(1 - dampening), nesterov, first, p, buf)

    def adam_update(self, p, g, m, v, tmp, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        t = p.dtype.type
        decay = 1 - lr * weight_decay if decoupled else 1.0
        wd = 0.0 if decoupled else weight_decay
        # 1 - beta taken in float64 and then rounded, as the generic code's Python scalars are
        _update_kernels()[2](g, t(lr / (1 - beta1**step)), t(1 - beta1), t(beta2), t(1 - beta2), t(eps), t(wd),
                             t(decay), t((1 - beta2**step) ** 0.5), p, m, v)


@functools.cache
def _update_kernels():
    """(sgd, sgd with momentum, adam): CuPy elementwise kernels of Backend.sgd_update and adam_update."""
    import cupy

    sgd = cupy.ElementwiseKernel(
        "T g, T lr, T wd", "T p", "p = p - lr * (g + wd * p);", "pydtnn_sgd")
    sgd_momentum = cupy.ElementwiseKernel(
        "T g, T lr, T wd, T momentum, T keep, bool nesterov, bool first", "T p, T buf",
        """
        T d = g + wd * p;
        buf = first ? d : momentum * buf + keep * d;
        p = p - lr * (nesterov ? d + momentum * buf : buf);
        """, "pydtnn_sgd_momentum")
    adam = cupy.ElementwiseKernel(
        "T g, T lr_t, T one_m_beta1, T beta2, T one_m_beta2, T eps, T wd, T decay, T bc2_sqrt", "T p, T m, T v",
        """
        p = p * decay;
        T d = g + wd * p;
        m = m + one_m_beta1 * (d - m);
        v = beta2 * v + one_m_beta2 * d * d;
        p = p - lr_t * m / (sqrt(v) / bc2_sqrt + eps);
        """, "pydtnn_adam")
    return sgd, sgd_momentum, adam


class ConvGraphs:
    """cuDNN frontend graphs for one backend, built once per (operation, batch, geometry, weight shape).

    fprop: Y = conv(X, W); dgrad: DX = conv_dgrad(DY, W); wgrad: DW = conv_wgrad(X, DY). NCHW tensors,
    grouped convolutions through the weight's channel count (C / groups), float32 compute.
    """

    def __init__(self, backend):
        self.backend = backend
        self.cudnn = _require_cudnn()
        self.handle = self.cudnn.create_handle()
        self.cache = {}
        self.workspace = None

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the library may be gone already
            self.cudnn.destroy_handle(self.handle)

    def run(self, kind, n, g, w_shape, arrays):
        key = (kind, n, g, tuple(w_shape))
        entry = self.cache.get(key)
        if entry is None:
            entry = self.cache[key] = self._build(kind, n, g, tuple(w_shape))
        graph, tensors, ws_size = entry
        ws = self._workspace(ws_size)
        cp = self.backend.cupy
        self.cudnn.set_stream(handle=self.handle, stream=cp.cuda.get_current_stream().ptr)
        graph.execute({tensors[k]: v for k, v in arrays.items()}, ws, handle=self.handle)

    def _workspace(self, size):
        cp = self.backend.cupy
        if self.workspace is None or self.workspace.size < size:
            self.workspace = cp.empty(max(size, 1), cp.uint8)
        return self.workspace

    def _build(self, kind, n, g, w_shape):
        cudnn = self.cudnn
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                              handle=self.handle)
        x_dim = [n, g.c, g.h, g.w]
        y_dim = [n, w_shape[0], g.ho, g.wo]
        conv = {"pre_padding": [g.pt, g.pl], "post_padding": [g.pb, g.pr], "stride": [g.sh, g.sw],
                "dilation": [g.dh, g.dw], "compute_data_type": f32}

        def tensor(name, dim):
            return graph.tensor(name=name, dim=list(dim), stride=_row_major(dim), data_type=f32)

        if kind == "fprop":
            t = {"X": tensor("X", x_dim), "W": tensor("W", w_shape)}
            t["Y"] = graph.conv_fprop(image=t["X"], weight=t["W"], **conv)
            out, dim = t["Y"], y_dim
        elif kind == "dgrad":
            t = {"DY": tensor("DY", y_dim), "W": tensor("W", w_shape)}
            t["DX"] = graph.conv_dgrad(loss=t["DY"], filter=t["W"], **conv)
            out, dim = t["DX"], x_dim
        else:
            t = {"X": tensor("X", x_dim), "DY": tensor("DY", y_dim)}
            t["DW"] = graph.conv_wgrad(image=t["X"], loss=t["DY"], **conv)
            out, dim = t["DW"], w_shape
        out.set_output(True).set_dim(list(dim)).set_stride(_row_major(dim)).set_data_type(f32)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        except Exception as e:
            raise RuntimeError(f"cuDNN has no engine for conv {kind} with batch {n}, weight {w_shape}, {g}: {e}") from e
        return graph, t, graph.get_workspace_size()


def _row_major(dim):
    strides, acc = [], 1
    for d in reversed(list(dim)):
        strides.append(acc)
        acc *= d
    return strides[::-1]
