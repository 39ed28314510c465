"""GPUBackend: the Backend contract on one GPU (see this package's __init__.py for what runs where and why)."""

import dataclasses

import numpy as np

from pydtnn.backends.base import Backend
from pydtnn.backends.gpu.conv_graphs import ConvGraphs
from pydtnn.backends.gpu.device import local_rank, require_cupy
from pydtnn.backends.gpu.kernels import BN_SRC, DROPOUT_SRC, POOL_SRC, elementwise_kernels, update_kernels
from pydtnn.backends.gpu.transfers import BatchCopier, Uploader
from pydtnn.errors import ConfigError


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
        cp = require_cupy()
        super().__init__(cp, dtype, seed)
        self.cupy = cp
        count = cp.cuda.runtime.getDeviceCount()
        self.device_id = (local_rank() if device is None else int(device)) % count
        self.device = cp.cuda.Device(self.device_id)
        self.device.use()
        self.convs = ConvGraphs(self)
        self._pool = cp.RawModule(code=POOL_SRC)
        self._bn = cp.RawModule(code=BN_SRC)
        self._dropout = cp.ElementwiseKernel("uint64 seed, float32 rate, float32 scale", "T mask", DROPOUT_SRC,
                                             "pydtnn_dropout_mask")
        self._batches, self._uploads = BatchCopier(cp), Uploader(cp)

    def __repr__(self):
        return f"GPUBackend(device={self.device_id}, dtype={self.dtype.name}, seed={self.seed})"

    # -- host <-> device -------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Array on this GPU (a synchronous copy from the host; see batch_to_device for batches)."""
        cp = self.cupy
        if isinstance(a, cp.ndarray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        return cp.asarray(np.asarray(a, dtype=dtype))

    def batch_to_device(self, *arrays):
        """One step's batch arrays (inputs, targets) on this GPU, copied on a stream of their own while the
        GPU computes the step before (transfers.BatchCopier): queue every use of them before the next
        call. Device arrays pass through. One array gives one array, several a tuple."""
        cp = self.cupy
        host = [i for i, a in enumerate(arrays) if not isinstance(a, cp.ndarray)]
        out = list(arrays)
        for i, d in zip(host, self._batches(*(arrays[i] for i in host)) if host else ()):
            out[i] = d
        return out[0] if len(out) == 1 else tuple(out)

    def upload(self, a):
        """A host array made during the step (a dropout mask), copied asynchronously (transfers.Uploader)."""
        if isinstance(a, self.cupy.ndarray):
            return a
        return self._uploads(a)

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
    @staticmethod
    def _launch(module, name, total, *args, threads=256):
        """Kernel `name` of RawModule `module` over `total` threads (one per output, or per channel)."""
        blocks = (total + threads - 1) // threads
        if blocks:
            module.get_function(name)((blocks,), (threads,), args)

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
        self._launch(self._pool, "maxpool_fwd", y.size, x, y, arg, np.int64(y.size), *self._pool_args(g))
        return y, (arg if keep else None)

    def maxpool2d_backward(self, dy, ctx, g):
        cp = self.cupy
        dy = cp.ascontiguousarray(dy)
        dx = cp.empty((dy.shape[0], g.c, g.h, g.w), dy.dtype)
        self._launch(self._pool, "maxpool_bwd", dx.size, dy, ctx, dx, np.int64(dx.size), *self._pool_args(g))
        return dx

    def avgpool2d_forward(self, x, g, keep=True):
        cp = self.cupy
        x = cp.ascontiguousarray(x)
        y = cp.empty((x.shape[0], g.c, g.ho, g.wo), x.dtype)
        self._launch(self._pool, "avgpool_fwd", y.size, x, y, np.int64(y.size), *self._pool_args(g))
        return y, None

    def avgpool2d_backward(self, dy, ctx, g):
        cp = self.cupy
        dy = cp.ascontiguousarray(dy)
        dx = cp.empty((dy.shape[0], g.c, g.h, g.w), dy.dtype)
        self._launch(self._pool, "avgpool_bwd", dx.size, dy, dx, np.int64(dx.size), *self._pool_args(g))
        return dx

    # -- activations and batch normalization -------------------------------------------------
    def relu_forward(self, x, cap=None):
        return elementwise_kernels()[0](x, x.dtype.type(cap or 0), cap is not None)

    def relu_backward(self, dy, y, cap=None):
        return elementwise_kernels()[1](dy, y, y.dtype.type(cap or 0), cap is not None)

    def erf(self, x):
        """CuPy's element-wise erf (GELU's exact form; the rest of GELU is the generic CuPy code)."""
        from cupyx.scipy.special import erf

        return erf(x)

    def _bn_partials(self, mode, x, dy=None, mean=None):
        """bn_partials' S partial sums per channel of x (N, C, L...) (and of dy), float64 (C, S) each."""
        cp = self.cupy
        n, c = x.shape[0], x.shape[1]
        length = x.size // (n * c)
        nl = n * length
        shares = max(1, min(-(-2048 // c), -(-nl // 2048)))  # about 2048 blocks, each of at least 2048 values
        part0 = cp.empty((c, shares), cp.float64)
        part1 = cp.empty((c, shares), cp.float64) if mode == 2 else part0
        self._bn.get_function("bn_partials")(
            (c, shares), (256,), (x, x if dy is None else dy, part0 if mean is None else mean, part0, part1,
                                  np.int32(mode), np.int32(c), np.int64(length), np.int64(nl), np.int32(shares)))
        return part0, part1, shares

    def batchnorm_forward(self, x, weight, bias, eps):
        """(y, mean, var, inv_std): BN_SRC's two-pass float64 statistics and one pass for y."""
        cp = self.cupy
        x = cp.ascontiguousarray(x)
        c = x.shape[1]
        m = x.size // c
        f64, f32 = cp.float64, cp.float32
        mean, var, inv_std = cp.empty(c, f64), cp.empty(c, f64), cp.empty(c, f64)
        a, b = cp.empty(c, f32), cp.empty(c, f32)
        part, _, shares = self._bn_partials(0, x)
        self._launch(self._bn, "bn_mean", c, part, mean, np.int32(c), np.int32(shares), np.float64(m))
        part, _, shares = self._bn_partials(1, x, mean=mean)
        self._launch(self._bn, "bn_forward_coefficients", c, part, mean, weight, bias, np.int32(c),
                     np.int32(shares), np.float64(m), np.float64(eps), var, inv_std, a, b)
        y = cp.empty_like(x)
        self._launch(self._bn, "bn_affine", x.size, x, a, b, y, np.int64(x.size), np.int32(c),
                     np.int64(x.size // (x.shape[0] * c)))
        return y, mean, var, inv_std

    def batchnorm_backward(self, dy, x, mean, inv_std, weight):
        """(dx, dbias, dweight): the sums of dy and dy * (x - mean) in one pass, then one pass for dx."""
        cp = self.cupy
        dy, x = cp.ascontiguousarray(dy), cp.ascontiguousarray(x)
        c = x.shape[1]
        f64, f32 = cp.float64, cp.float32
        db, dw = cp.empty(c, f64), cp.empty(c, f64)
        k1, k2, k0 = cp.empty(c, f32), cp.empty(c, f32), cp.empty(c, f32)
        part0, part1, shares = self._bn_partials(2, x, dy=dy, mean=mean)
        self._launch(self._bn, "bn_backward_coefficients", c, part0, part1, mean, inv_std, weight, np.int32(c),
                     np.int32(shares), np.float64(x.size // c), db, dw, k1, k2, k0)
        dx = cp.empty_like(dy)
        self._launch(self._bn, "bn_affine_dx", x.size, dy, x, k1, k2, k0, dx, np.int64(x.size), np.int32(c),
                     np.int64(x.size // (x.shape[0] * c)))
        return dx, db, dw

    def batchnorm_update_running(self, running_mean, running_var, mean, var, momentum, m):
        elementwise_kernels()[2](mean, var, np.float32(1 - momentum), float(momentum),
                                 momentum * m / max(m - 1, 1), running_mean, running_var)

    # -- dropout ---------------------------------------------------------------------------
    def dropout_mask(self, shape, rate, dtype, stream=None):
        """Mask of 0 and 1/(1-rate): from the per-sample streams on the host (the CPU's bits, copied) when
        the trainer set them, else drawn by a kernel from a seed taken from the host Generator."""
        if stream is not None and self.sample_streams is not None and len(self.sample_streams) == shape[0]:
            return super().dropout_mask(shape, rate, dtype, stream)
        seed = np.uint64(self.rng.integers(0, 2**63))
        mask = self.cupy.empty(shape, dtype)
        self._dropout(seed, np.float32(rate), np.float32(1 / (1 - rate)), mask)
        return mask

    # -- optimizer updates ---------------------------------------------------------------------
    def sgd_update(self, p, g, buf, tmp, lr, weight_decay, momentum, dampening, nesterov, first):
        t = p.dtype.type
        plain, with_momentum, _ = update_kernels()
        if not momentum:
            plain(g, t(lr), t(weight_decay), p)
            return
        with_momentum(g, t(lr), t(weight_decay), t(momentum), t(1 - dampening), nesterov, first, p, buf)

    def adam_update(self, p, g, m, v, tmp, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        t = p.dtype.type
        decay = 1 - lr * weight_decay if decoupled else 1.0
        wd = 0.0 if decoupled else weight_decay
        # 1 - beta taken in float64 and then rounded, as the generic code's Python scalars are
        update_kernels()[2](g, t(lr / (1 - beta1**step)), t(1 - beta1), t(beta2), t(1 - beta2), t(eps), t(wd),
                             t(decay), t((1 - beta2**step) ** 0.5), p, m, v)
