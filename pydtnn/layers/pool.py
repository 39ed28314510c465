"""Max and average pooling over 2-D windows, and global average pooling."""

import numpy as np

from pydtnn.backends.cpu import ConvGeometry
from pydtnn.errors import ShapeError
from pydtnn.layers.base import Layer, as_pair


class _Pool2D(Layer):
    """Shared shape logic. stride defaults to pool_size (not 1, as it did in PyDTNN)."""

    kind = None  # "max" or "avg": picks the backend kernels

    def __init__(self, pool_size=2, stride=None, padding=0):
        super().__init__()
        self.pool_size = as_pair(pool_size, f"{type(self).__name__} pool_size")
        self.stride = as_pair(stride if stride is not None else pool_size, f"{type(self).__name__} stride")
        self.padding = as_pair(padding, f"{type(self).__name__} padding")
        if min(self.pool_size + self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(f"{type(self).__name__}: pool_size and stride must be >= 1 and padding >= 0")

    def describe(self):
        (kh, kw), (sh, _), (ph, _) = self.pool_size, self.stride, self.padding
        return f"{type(self).__name__}({kh}x{kw}, s{sh}{f', p{ph}' if ph else ''})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(3, "(C, H, W)")
        c, h, w = self.input_shape
        (kh, kw), (sh, sw), (ph, pw) = self.pool_size, self.stride, self.padding
        if 2 * ph > kh or 2 * pw > kw:
            raise ShapeError(f"{self.name}: padding {self.padding} must be at most half the pool size {self.pool_size}")
        g = ConvGeometry(c, h, w, kh, kw, sh, sw, 1, 1, ph, ph, pw, pw)
        if g.ho < 1 or g.wo < 1:
            raise ShapeError(
                f"{self.name}: pool {kh}x{kw} is larger than the padded input {h + 2 * ph}x{w + 2 * pw} "
                f"(input shape {self.input_shape}); expected H, W of at least {kh - 2 * ph}x{kw - 2 * pw}"
            )
        self.geometry = g
        self.output_shape = (c, g.ho, g.wo)

    def forward(self, x, training=True):
        fwd = getattr(self.backend, f"{self.kind}pool2d_forward")
        y, self.ctx = fwd(x, self.geometry, keep=training)
        return y

    def backward(self, dy):
        return getattr(self.backend, f"{self.kind}pool2d_backward")(dy, self.ctx, self.geometry)

    def flops(self):
        return int(np.prod(self.output_shape)) * self.pool_size[0] * self.pool_size[1]


class MaxPool2D(_Pool2D):
    """y = max over each window; x: (N, C, H, W) -> (N, C, Ho, Wo). Padding acts as -inf."""

    kind = "max"


class AvgPool2D(_Pool2D):
    """y = mean over each window (zero padding counted, as PyTorch's default)."""

    kind = "avg"


AveragePool2D = AvgPool2D  # PyDTNN's name


class GlobalAvgPool2D(Layer):
    """Mean over H and W: (N, C, H, W) -> (N, C), ready for a Dense layer."""

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(3, "(C, H, W)")
        self.output_shape = (self.input_shape[0],)

    def forward(self, x, training=True):
        return x.mean(axis=(2, 3))

    def backward(self, dy):
        c, h, w = self.input_shape
        dx = self.xp.empty((dy.shape[0], c, h, w), dtype=dy.dtype)
        dx[...] = (dy / (h * w))[:, :, None, None]
        return dx

    def flops(self):
        return int(np.prod(self.input_shape))
