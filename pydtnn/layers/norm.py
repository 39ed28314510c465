"""Batch normalization with PyTorch's running-statistics semantics."""

import numpy as np

from pydtnn.backends.base import batchnorm_dx_coefficients
from pydtnn.layers.base import Layer


class BatchNorm(Layer):
    """y = weight * (x - mean) / sqrt(var + eps) + bias, per channel.

    x: (N, C) or (N, C, H, W). Training normalizes with the batch's biased variance and updates
    running_mean/running_var as running = (1 - momentum) * running + momentum * batch_stat, with the
    unbiased variance (PyTorch). Evaluation normalizes with the running statistics.

    Both directions are per-channel affine maps of whole tensors: y = a * x + b and
    dx = k1 * dy + k2 * x + k0, with the coefficients (and every per-channel sum) in float64 and the
    tensors in their own dtype. The backend computes them (backends/base.py): batchnorm_forward and
    batchnorm_backward when the statistics are this batch's own, the channel_* operations otherwise.

    sync: synchronized statistics across data-parallel ranks, an object with allreduce(array) (sum
    over ranks, in place) and weight (this rank's share of the global batch); see synchronize().
    """

    def __init__(self, momentum=0.1, eps=1e-5, weight_init=1.0, sync=None):
        super().__init__()
        self.momentum, self.eps = float(momentum), float(eps)
        self.weight_init = float(weight_init)  # 0 starts a residual branch as nothing (models/resnet.py)
        self.sync = sync

    def synchronize(self, sync):
        """Compute the statistics over every rank's samples from now on (None: this rank's own)."""
        self.sync = sync

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

    def forward(self, x, training=True):
        weight, bias, backend = self.params["weight"], self.params["bias"], self.backend
        if training and self.sync is None:
            y, mean, var, inv_std = backend.batchnorm_forward(x, weight, bias, self.eps)
            self._update_running(mean, var, x.size // x.shape[1])
        else:
            if training:
                mean, var, m = self._global_moments(x)
                self._update_running(mean, var, m)
            else:
                mean = self.buffers["running_mean"].astype(np.float64)
                var = self.buffers["running_var"].astype(np.float64)
            inv_std = 1 / self.xp.sqrt(var + self.eps)
            a = weight * inv_std
            y = backend.channel_affine(x, a, bias - mean * a)
        self.x, self.mean, self.inv_std, self.training = x, mean, inv_std, training
        return y

    def backward(self, dy):
        x = self.take_saved("x")
        mean, inv_std, backend = self.mean, self.inv_std, self.backend
        weight = self.params["weight"]
        if self.training and self.sync is None:
            dx, db, dw = backend.batchnorm_backward(dy, x, mean, inv_std, weight)
            self.grads["bias"][...] = db
            self.grads["weight"][...] = dw
            return dx
        db = backend.channel_sums(dy)
        dw = backend.channel_centered_dot(dy, x, mean) * inv_std  # sum(dy * xhat)
        self.grads["bias"][...] = db
        self.grads["weight"][...] = dw
        if not self.training:  # statistics were constants
            return backend.channel_affine(dy, weight * inv_std)
        return self._global_dx(dy, x, db, dw)

    def _update_running(self, mean, var, m):
        self.backend.batchnorm_update_running(self.buffers["running_mean"], self.buffers["running_var"], mean, var,
                                              self.momentum, m)

    # -- synchronized statistics -----------------------------------------------------------
    def _global_moments(self, x):
        """Mean and biased variance over the samples of every rank, and their count (one allreduce).

        Each rank sends its sum, its sum of squares (its centered sum of squares plus n * mean^2, in
        float64, so E[x^2] - E[x]^2 does not cancel badly) and its count.
        """
        xp, c = self.xp, x.shape[1]
        stats = xp.zeros(2 * c + 1, np.float64)
        if self.sync.weight > 0:  # a rank with an empty share computes on a stand-in sample: leave it out
            mean, var, n = self.backend.channel_moments(x)
            stats[:c] = n * mean
            stats[c : 2 * c] = n * (var + mean * mean)
            stats[-1] = n
        self.sync.allreduce(stats)
        m = int(stats[-1])
        mean = stats[:c] / m
        var = xp.maximum(stats[c : 2 * c] / m - mean * mean, 0)
        return mean, var, m

    def _global_dx(self, dy, x, db, dw):
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
        k = batchnorm_dx_coefficients(self.params["weight"], self.mean, self.inv_std, sums[:c] / (m * w),
                                      sums[c : 2 * c] / (m * w))
        return self.backend.channel_affine_dx(dy, x, *k)

    def flops(self):
        return 4 * int(np.prod(self.input_shape))


BatchNormalization = BatchNorm  # PyDTNN's name


class LayerNorm(Layer):
    """y = weight * (x - mean) / sqrt(var + eps) + bias over the last axis (features), per token or sample.

    x: (D,) or (T, D) per sample; weight and bias (D,) (PyTorch's nn.LayerNorm over the last dimension, its
    names). Statistics are each row's own, the same in training and evaluation: nothing crosses samples,
    so data parallelism needs no synchronization. The backend computes both directions
    (layernorm_forward / layernorm_backward)."""

    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = float(eps)

    def describe(self):
        return "LayerNorm()"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        if len(self.input_shape) not in (1, 2):
            self.expect_rank(2, "(tokens, features) or (features,)")
        d = self.input_shape[-1]
        self.add_param("weight", self.xp.ones(d, self.dtype))
        self.add_param("bias", self.xp.zeros(d, self.dtype))

    def forward(self, x, training=True):
        y, xhat, inv_std = self.backend.layernorm_forward(x, self.params["weight"], self.params["bias"], self.eps)
        self.xhat, self.inv_std = (xhat, inv_std) if training else (None, None)
        return y

    def backward(self, dy):
        return self.backend.layernorm_backward(dy, self.take_saved("xhat"), self.take_saved("inv_std"),
                                               self.params["weight"], self.grads["weight"], self.grads["bias"])

    def flops(self):
        return 8 * int(np.prod(self.input_shape))
