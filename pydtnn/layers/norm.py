"""Batch normalization with PyTorch's running-statistics semantics."""

import numpy as np

from pydtnn.layers.base import Layer


class BatchNorm(Layer):
    """y = weight * (x - mean) / sqrt(var + eps) + bias, per channel.

    x: (N, C) or (N, C, H, W). Training normalizes with the batch's biased variance and updates
    running_mean/running_var as running = (1 - momentum) * running + momentum * batch_stat, with the
    unbiased variance (PyTorch). Evaluation normalizes with the running statistics.
    """

    def __init__(self, momentum=0.1, eps=1e-5):
        super().__init__()
        self.momentum, self.eps = float(momentum), float(eps)
        # Synchronized statistics across data-parallel ranks: an object with allreduce(array) (sum
        # over ranks, in place) and weight (this rank's share of the global batch), set by the trainer.
        self.sync = None

    def describe(self):
        return "BatchNorm()"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        if len(self.input_shape) not in (1, 3):
            self.expect_rank(3, "(C, H, W) or (C,)")
        c = self.input_shape[0]
        xp = self.xp
        self.add_param("weight", xp.ones(c, self.dtype))
        self.add_param("bias", xp.zeros(c, self.dtype))
        self.add_buffer("running_mean", xp.zeros(c, self.dtype))
        self.add_buffer("running_var", xp.ones(c, self.dtype))
        self.axes = (0,) if len(self.input_shape) == 1 else (0, 2, 3)
        self.bshape = (1, c) if len(self.input_shape) == 1 else (1, c, 1, 1)

    def forward(self, x, training=True):
        xp, axes = self.xp, self.axes
        if training:
            if self.sync is not None:
                mean, var, m = self._global_moments(x)
                xc = x - mean.reshape(self.bshape)
            else:
                mean, m = x.mean(axis=axes), x.size // x.shape[1]
                xc = x - mean.reshape(self.bshape)
                var = (xc * xc).mean(axis=axes)
            mom = self.momentum
            self.buffers["running_mean"] *= 1 - mom
            self.buffers["running_mean"] += mom * mean
            self.buffers["running_var"] *= 1 - mom
            self.buffers["running_var"] += (mom * m / max(m - 1, 1)) * var
        else:
            xc = x - self.buffers["running_mean"].reshape(self.bshape)
            var = self.buffers["running_var"]
        inv_std = (1 / xp.sqrt(var + self.eps)).astype(x.dtype, copy=False)
        xhat = xc * inv_std.reshape(self.bshape)
        self.xhat, self.inv_std, self.training = xhat, inv_std, training
        return xhat * self.params["weight"].reshape(self.bshape) + self.params["bias"].reshape(self.bshape)

    def backward(self, dy):
        axes, b = self.axes, self.bshape
        xhat = self.xhat
        dy.sum(axis=axes, out=self.grads["bias"])
        (dy * xhat).sum(axis=axes, out=self.grads["weight"])
        scale = (self.params["weight"] * self.inv_std).reshape(b)
        if not self.training:  # statistics were constants
            return dy * scale
        if self.sync is not None:
            return self._global_dx(dy, scale)
        m = dy.size // dy.shape[1]
        # dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat))
        return scale * (dy - (self.grads["bias"] / m).reshape(b) - xhat * (self.grads["weight"] / m).reshape(b))

    def _global_moments(self, x):
        """Mean and biased variance over the samples of every rank, and their count (one allreduce)."""
        xp, c = self.xp, x.shape[1]
        stats = xp.zeros(2 * c + 1, np.float64)  # sums in float64: E[x^2] - E[x]^2 cancels badly in float32
        if self.sync.weight > 0:  # a rank with an empty share computes on a stand-in sample: leave it out
            stats[:c] = x.sum(axis=self.axes, dtype=np.float64)
            stats[c : 2 * c] = (x * x).sum(axis=self.axes, dtype=np.float64)
            stats[-1] = x.size // c
        self.sync.allreduce(stats)
        m = int(stats[-1])
        mean = stats[:c] / m
        var = xp.maximum(stats[c : 2 * c] / m - mean * mean, 0)
        return mean.astype(x.dtype), var.astype(x.dtype), m

    def _global_dx(self, dy, scale):
        """dL_r/dx for the global objective sum_r w_r L_r, in this rank's own scale (divided by w_r)."""
        w, b, c = self.sync.weight, self.bshape, dy.shape[1]
        sums = self.xp.zeros(2 * c + 1, dy.dtype)
        if w > 0:
            sums[:c], sums[c : 2 * c] = w * self.grads["bias"], w * self.grads["weight"]
            sums[-1] = dy.size // c
        self.sync.allreduce(sums)
        if w == 0:
            return self.xp.zeros_like(dy)
        m = sums[-1]
        return scale * (dy - ((sums[:c] / m).reshape(b) + self.xhat * (sums[c : 2 * c] / m).reshape(b)) / w)

    def flops(self):
        return 4 * int(np.prod(self.input_shape))


BatchNormalization = BatchNorm  # PyDTNN's name
