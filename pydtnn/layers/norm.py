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
            mean = x.mean(axis=axes)
            xc = x - mean.reshape(self.bshape)
            var = (xc * xc).mean(axis=axes)
            m = x.size // x.shape[1]
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
        m = dy.size // dy.shape[1]
        # dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat))
        return scale * (dy - (self.grads["bias"] / m).reshape(b) - xhat * (self.grads["weight"] / m).reshape(b))

    def flops(self):
        return 4 * int(np.prod(self.input_shape))


BatchNormalization = BatchNorm  # PyDTNN's name
