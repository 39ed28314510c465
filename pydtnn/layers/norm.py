"""Batch normalization with PyTorch's running-statistics semantics."""

import numpy as np

from pydtnn.layers.base import Layer

# Bytes of input per batch chunk on the CPU: a chunk, its centered copy and the matching dy fit in L2,
# so the centering done inside a reduction never goes back to memory.
_CHUNK_BYTES = 1 << 18


class BatchNorm(Layer):
    """y = weight * (x - mean) / sqrt(var + eps) + bias, per channel.

    x: (N, C) or (N, C, H, W). Training normalizes with the batch's biased variance and updates
    running_mean/running_var as running = (1 - momentum) * running + momentum * batch_stat, with the
    unbiased variance (PyTorch). Evaluation normalizes with the running statistics.

    Both directions are per-channel affine maps of whole tensors: y = a * x + b and
    dx = k1 * dy + k2 * x + k0, with the coefficients (and every per-channel sum) in float64 and
    the tensors touched in their own dtype. Statistics come from a per-row reduction of the
    (N, C, H*W) view: a matrix-vector product for sums, centered dot products for the variance and
    for sum(dy * xhat). On the CPU with compiled kernels, training without synchronized statistics
    runs the backend's fused per-channel kernels instead (backends/compiled.py), one pass fewer each way.
    """

    def __init__(self, momentum=0.1, eps=1e-5, weight_init=1.0):
        super().__init__()
        self.momentum, self.eps = float(momentum), float(eps)
        self.weight_init = float(weight_init)  # 0 starts a residual branch as nothing (models/resnet.py)
        # Synchronized statistics across data-parallel ranks: an object with allreduce(array) (sum
        # over ranks, in place) and weight (this rank's share of the global batch), set by the trainer.
        self.sync = None
        self._ones = self._scratch = None
        self._coefs = {}  # dtype -> per-sample coefficient buffers (CPU)

    def describe(self):
        return "BatchNorm()"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        if len(self.input_shape) not in (1, 3):
            self.expect_rank(3, "(C, H, W) or (C,)")
        c = self.input_shape[0]
        xp = self.xp
        self.add_param("weight", xp.full(c, self.weight_init, self.dtype))
        self.add_param("bias", xp.zeros(c, self.dtype))
        self.add_buffer("running_mean", xp.zeros(c, self.dtype))
        self.add_buffer("running_var", xp.ones(c, self.dtype))
        self.bshape = (1, c) if len(self.input_shape) == 1 else (1, c, 1, 1)
        self._ones = self._scratch = None
        self._coefs = {}

    def _fused(self, training):
        """Whether this pass runs the backend's fused kernels (CPU with compiled kernels): training
        without synchronized statistics."""
        return training and self.sync is None and self.backend.fused_batchnorm

    def _update_running(self, mean, var, m):
        mom = self.momentum
        self.buffers["running_mean"] *= 1 - mom
        self.buffers["running_mean"] += mom * mean
        self.buffers["running_var"] *= 1 - mom
        self.buffers["running_var"] += (mom * m / max(m - 1, 1)) * var

    def forward(self, x, training=True):
        xp = self.xp
        if self._fused(training):
            y, mean, var = self.backend.batchnorm_forward(x, self.params["weight"], self.params["bias"], self.eps)
            self._update_running(mean, var, x.size // x.shape[1])
            self.x, self.mean, self.inv_std, self.training = x, mean, 1 / np.sqrt(var + self.eps), True
            return y
        if training:
            mean, var, m = self._global_moments(x) if self.sync is not None else self._moments(x)
            self._update_running(mean, var, m)
        else:
            mean = self.buffers["running_mean"].astype(np.float64)
            var = self.buffers["running_var"].astype(np.float64)
        inv_std = 1 / xp.sqrt(var + self.eps)
        a = self.params["weight"] * inv_std
        b = self.params["bias"] - mean * a
        self.x, self.mean, self.inv_std, self.training = x, mean, inv_std, training
        y = xp.empty_like(x)
        xp.multiply(x, self._coef(a, x.dtype, 0), out=y)
        y += self._coef(b, x.dtype, 1)
        return y

    def backward(self, dy):
        x, mean, inv_std = self.x, self.mean, self.inv_std
        if self._fused(self.training):
            dx, db, dw = self.backend.batchnorm_backward(dy, x, mean, inv_std, self.params["weight"])
            self.grads["bias"][...] = db
            self.grads["weight"][...] = dw
            return dx
        db = self._sums(dy)
        dw = self._centered_dot(dy, x, mean) * inv_std  # sum(dy * xhat)
        self.grads["bias"][...] = db
        self.grads["weight"][...] = dw
        scale = self.params["weight"] * inv_std
        if not self.training:  # statistics were constants
            return dy * self._coef(scale, dy.dtype, 0)
        if self.sync is not None:
            return self._global_dx(dy, scale, db, dw)
        m = dy.size // dy.shape[1]
        # dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * inv_std
        return self._affine_dx(dy, scale, db / m, dw / m)

    # -- per-channel reductions over (N, H, W) ---------------------------------------------
    def _rows(self, a):
        """(N, C, L) view of an (N, C) or (N, C, H, W) array, L = H*W (1 for (N, C))."""
        return a.reshape(a.shape[0], a.shape[1], -1)

    def _sums(self, a):
        """Per-channel sum of a, float64 (C,): one matrix-vector product per row, rows added in float64."""
        a3 = self._rows(a)
        if self._ones is None or self._ones.shape[0] != a3.shape[2] or self._ones.dtype != a.dtype:
            self._ones = self.xp.ones(a3.shape[2], a.dtype)
        return (a3 @ self._ones).sum(axis=0, dtype=np.float64)

    def _chunks(self, a):
        """Batch slices of about _CHUNK_BYTES on the CPU; the whole batch elsewhere (one kernel each)."""
        n = a.shape[0]
        step = max(1, _CHUNK_BYTES // (a[0].nbytes or 1)) if self.xp is np else n
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def _scratch_for(self, a, rows):
        """Buffer for `rows` samples shaped like a: kept and reused on the CPU, where it is one small
        chunk; a fresh temporary elsewhere, where it spans the batch."""
        shape = (rows,) + a.shape[1:]
        if self.xp is not np:
            return self.xp.empty(shape, a.dtype)
        s = self._scratch
        if s is None or s.shape[1:] != shape[1:] or s.shape[0] < rows or s.dtype != a.dtype:
            s = self._scratch = self.xp.empty(shape, a.dtype)
        return s[:rows]

    def _centered_dot(self, a, x, mean):
        """sum over (N, H, W) of a * (x - mean) per channel, float64 (C,).

        x - mean is formed a chunk at a time in a reused buffer; a is x itself for the variance.
        """
        xp, total = self.xp, 0
        mc = self._coef(mean, x.dtype, 0)
        chunks = self._chunks(x)
        buf = self._scratch_for(x, chunks[0].stop)
        for sl in chunks:
            xc = xp.subtract(x[sl], mc, out=buf[: sl.stop - sl.start])
            other = xc if a is x else a[sl]
            if xp is np:
                d = np.vecdot(self._rows(other), self._rows(xc))
            else:
                d = xp.einsum("ncl,ncl->nc", self._rows(other), self._rows(xc))
            total = total + d.sum(axis=0, dtype=np.float64)
        return total

    def _moments(self, x):
        """Mean and biased variance (float64, per channel) of this batch, and the count per channel."""
        m = x.size // x.shape[1]
        mean = self._sums(x) / m
        return mean, self._centered_dot(x, x, mean) / m, m

    def _coef(self, v, dtype, slot):
        """A per-channel vector in the tensors' dtype, broadcastable against them.

        On the CPU it is written out to one sample's shape (C, H, W) in reused buffer `slot`: NumPy
        multiplies or adds two contiguous operands about twice as fast as an operand that repeats one
        value per channel row.
        """
        v = v.astype(dtype).reshape(self.bshape)
        if self.xp is not np:
            return v
        shape = (1,) + self.input_shape
        bufs = self._coefs.setdefault(np.dtype(dtype), [])
        while len(bufs) <= slot:
            bufs.append(np.empty(shape, dtype))
        np.copyto(bufs[slot], v)
        return bufs[slot]

    def _affine_dx(self, dy, scale, mean_dy, mean_dy_xhat):
        """dx = scale * (dy - mean_dy - xhat * mean_dy_xhat), as dy * k1 + x * k2 + k0."""
        xp = self.xp
        k2 = -scale * self.inv_std * mean_dy_xhat
        k0 = -scale * mean_dy - k2 * self.mean
        k1, k2, k0 = (self._coef(k, dy.dtype, i) for i, k in enumerate((scale, k2, k0)))
        x, dx = self.x, xp.empty_like(dy)
        chunks = self._chunks(dy)
        buf = self._scratch_for(dy, chunks[0].stop)
        for sl in chunks:  # chunked so that the three passes over dx stay in cache
            d, t = dx[sl], buf[: sl.stop - sl.start]
            xp.multiply(x[sl], k2, out=d)
            d += k0
            xp.multiply(dy[sl], k1, out=t)
            d += t
        return dx

    # -- synchronized statistics -----------------------------------------------------------
    def _global_moments(self, x):
        """Mean and biased variance over the samples of every rank, and their count (one allreduce).

        Each rank sends its sum, its sum of squares (its centered sum of squares plus n * mean^2, in
        float64, so E[x^2] - E[x]^2 does not cancel badly) and its count.
        """
        xp, c = self.xp, x.shape[1]
        stats = xp.zeros(2 * c + 1, np.float64)
        if self.sync.weight > 0:  # a rank with an empty share computes on a stand-in sample: leave it out
            mean, var, n = self._moments(x)
            stats[:c] = n * mean
            stats[c : 2 * c] = n * (var + mean * mean)
            stats[-1] = n
        self.sync.allreduce(stats)
        m = int(stats[-1])
        mean = stats[:c] / m
        var = xp.maximum(stats[c : 2 * c] / m - mean * mean, 0)
        return mean, var, m

    def _global_dx(self, dy, scale, db, dw):
        """dL_r/dx for the global objective sum_r w_r L_r, in this rank's own scale (divided by w_r)."""
        w, c = self.sync.weight, dy.shape[1]
        sums = self.xp.zeros(2 * c + 1, np.float64)
        if w > 0:
            sums[:c], sums[c : 2 * c] = w * db, w * dw
            sums[-1] = dy.size // c
        self.sync.allreduce(sums)
        if w == 0:
            return self.xp.zeros_like(dy)
        m = sums[-1]
        return self._affine_dx(dy, scale, sums[:c] / (m * w), sums[c : 2 * c] / (m * w))

    def flops(self):
        return 4 * int(np.prod(self.input_shape))


BatchNormalization = BatchNorm  # PyDTNN's name
