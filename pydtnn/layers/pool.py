"""Max and average pooling over 2-D windows, and global and adaptive average pooling."""

from dataclasses import replace

import numpy as np

from pydtnn.backends.geometry import ConvGeometry
from pydtnn.errors import ShapeError
from pydtnn.layers.base import Layer, as_pair


class _Pool2D(Layer):
    """Shared shape logic. stride defaults to pool_size (not 1, as it did in PyDTNN)."""

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

    def flops(self):
        return int(np.prod(self.output_shape)) * self.pool_size[0] * self.pool_size[1]


class MaxPool2D(_Pool2D):
    """y = max over each window; x: (N, C, H, W) -> (N, C, Ho, Wo). Padding acts as -inf.

    ceil_mode (PyTorch's): the output size rounds up, Ho = ceil((H + 2p - k) / s) + 1, less one if
    the last window would start in the bottom padding; the extra rows/columns are bottom/right
    padding. torchvision's GoogLeNet uses it: 112 -> 56 with a 3x3 stride-2 window (floor gives 55).
    """

    def __init__(self, pool_size=2, stride=None, padding=0, ceil_mode=False):
        super().__init__(pool_size, stride, padding)
        self.ceil_mode = bool(ceil_mode)

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        if not self.ceil_mode:
            return
        g, extra = self.geometry, []
        for size, k, s, p in ((g.h, g.kh, g.sh, g.pt), (g.w, g.kw, g.sw, g.pl)):
            out = -(-(size + 2 * p - k) // s) + 1
            if (out - 1) * s >= size + p:
                out -= 1
            extra.append(max((out - 1) * s + k - (size + 2 * p), 0))
        self.geometry = replace(g, pb=g.pb + extra[0], pr=g.pr + extra[1])
        self.output_shape = (g.c, self.geometry.ho, self.geometry.wo)

    def forward(self, x, training=True):
        y, self.ctx = self.backend.maxpool2d_forward(x, self.geometry, keep=training)
        return y

    def backward(self, dy):
        return self.backend.maxpool2d_backward(dy, self.take_saved("ctx"), self.geometry)


class AvgPool2D(_Pool2D):
    """y = mean over each window (zero padding counted, as PyTorch's default)."""

    def forward(self, x, training=True):
        y, self.ctx = self.backend.avgpool2d_forward(x, self.geometry, keep=training)
        return y

    def backward(self, dy):
        return self.backend.avgpool2d_backward(dy, self.ctx, self.geometry)


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


class AdaptiveAvgPool2D(Layer):
    """Mean over an output_size grid of bins, as torch.nn.AdaptiveAvgPool2d.

    x: (N, C, H, W) -> (N, C, oh, ow). Bin i covers rows floor(i*H/oh) .. ceil((i+1)*H/oh) - 1,
    so bins may overlap or (for H < oh) repeat rows. torchvision's VGG (7x7) and AlexNet (6x6)
    end their features with it, which lets them take inputs other than 224x224.
    """

    def __init__(self, output_size):
        super().__init__()
        self.output_size = as_pair(output_size, "AdaptiveAvgPool2D output_size")
        if min(self.output_size) < 1:
            raise ValueError(f"AdaptiveAvgPool2D: output_size must be >= 1, got {output_size!r}")

    def describe(self):
        return f"AdaptiveAvgPool2D({self.output_size[0]}x{self.output_size[1]})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(3, "(C, H, W)")
        c, h, w = self.input_shape
        oh, ow = self.output_size
        self.rows = [(i * h // oh, -(-(i + 1) * h // oh)) for i in range(oh)]
        self.cols = [(j * w // ow, -(-(j + 1) * w // ow)) for j in range(ow)]
        self.identity = (h, w) == (oh, ow)
        self.output_shape = (c, oh, ow)

    def forward(self, x, training=True):
        if self.identity:
            return x
        y = self.xp.empty((x.shape[0],) + self.output_shape, dtype=x.dtype)
        for i, (r0, r1) in enumerate(self.rows):
            for j, (c0, c1) in enumerate(self.cols):
                y[:, :, i, j] = x[:, :, r0:r1, c0:c1].mean(axis=(2, 3))
        return y

    def backward(self, dy):
        if self.identity:
            return dy
        dx = self.xp.zeros((dy.shape[0],) + self.input_shape, dtype=dy.dtype)
        for i, (r0, r1) in enumerate(self.rows):
            for j, (c0, c1) in enumerate(self.cols):
                dx[:, :, r0:r1, c0:c1] += (dy[:, :, i, j] / ((r1 - r0) * (c1 - c0)))[:, :, None, None]
        return dx

    def flops(self):
        if self.identity:
            return 0
        c = self.input_shape[0]
        return c * sum((r1 - r0) * (c1 - c0) for r0, r1 in self.rows for c0, c1 in self.cols)
