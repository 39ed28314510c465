"""2-D convolution (cross-correlation, as in every framework)."""

import numpy as np

from pydtnn.backends.geometry import ConvGeometry
from pydtnn.errors import ShapeError
from pydtnn.layers.base import Layer, as_pair


def resolve_padding(padding, h, w, kh, kw, sh, sw, dh, dw, who):
    """(top, bottom, left, right) zero padding from an int, a pair, 'valid' or 'same'.

    'same' gives an output of ceil(H / stride); an odd total puts the extra row/column at the
    bottom/right, as PyTorch (stride 1) and TensorFlow do.
    """
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding == "same":
            pads = []
            for size, k, s, d in ((h, kh, sh, dh), (w, kw, sw, dw)):
                total = max((-(-size // s) - 1) * s + d * (k - 1) + 1 - size, 0)
                pads += [total // 2, total - total // 2]
            return tuple(pads)
        raise ValueError(f"{who}: padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
    ph, pw = as_pair(padding, f"{who}: padding")
    if ph < 0 or pw < 0:
        raise ValueError(f"{who}: padding must be >= 0, got {padding!r}")
    return ph, ph, pw, pw


class Conv2D(Layer):
    """y = conv2d(x, W) + b.

    x: (N, C_in, H, W) -> y: (N, C_out, H_out, W_out), H_out = (H + pads - d*(kh-1) - 1) // s + 1.
    PyTorch layout: weight (C_out, C_in / groups, kh, kw), bias (C_out,). groups == C_in is a
    depthwise convolution.
    """

    def __init__(
        self,
        filters,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups=1,
        use_bias=True,
        weight_init="he_uniform",
        bias_init="zeros",
    ):
        super().__init__()
        self.filters, self.groups, self.use_bias = int(filters), int(groups), use_bias
        self.kernel_size = as_pair(kernel_size, "Conv2D kernel_size")
        self.stride = as_pair(stride, "Conv2D stride")
        self.dilation = as_pair(dilation, "Conv2D dilation")
        self.padding = padding
        self.weight_init, self.bias_init = weight_init, bias_init
        if min(self.kernel_size + self.stride + self.dilation) < 1 or self.filters < 1 or self.groups < 1:
            raise ValueError(
                f"Conv2D: filters, kernel_size, stride, dilation and groups must be >= 1, got filters={filters}, "
                f"kernel_size={kernel_size}, stride={stride}, dilation={dilation}, groups={groups}"
            )

    def describe(self):
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        extra = f", s{sh}" if sh == sw else f", s{sh}x{sw}"
        extra += f", p{self.padding}" if self.padding else ""
        extra += f", d{self.dilation[0]}" if self.dilation != (1, 1) else ""
        extra += f", g{self.groups}" if self.groups != 1 else ""
        return f"Conv2D({self.filters}, {kh}x{kw}{extra})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(3, "(C, H, W)")
        c, h, w = self.input_shape
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        if c % self.groups or self.filters % self.groups:
            raise ShapeError(
                f"{self.name}: groups={self.groups} must divide both input channels ({c}, input shape "
                f"{self.input_shape}) and filters ({self.filters})"
            )
        pads = resolve_padding(self.padding, h, w, kh, kw, sh, sw, dh, dw, self.name)
        g = ConvGeometry(c, h, w, kh, kw, sh, sw, dh, dw, *pads, groups=self.groups)
        if g.ho < 1 or g.wo < 1:
            raise ShapeError(
                f"{self.name}: kernel {kh}x{kw} (dilation {dh}x{dw}) is larger than the padded input "
                f"{h + pads[0] + pads[1]}x{w + pads[2] + pads[3]} (input shape {self.input_shape}, "
                f"padding {self.padding!r}); expected a padded input of at least {dh * (kh - 1) + 1}x{dw * (kw - 1) + 1}"
            )
        self.geometry = g
        self.plan = self.backend.conv2d_plan(g, (self.filters, c // self.groups, kh, kw))  # the backend's algorithm
        fan_in = c // self.groups * kh * kw
        fan_out = self.filters // self.groups * kh * kw
        shape = (self.filters, c // self.groups, kh, kw)
        self.add_param("weight", self.init(self.weight_init, shape, fan_in, fan_out))
        if self.use_bias:
            self.add_param("bias", self.init(self.bias_init, (self.filters,), fan_in, fan_out))
        self.output_shape = (self.filters, g.ho, g.wo)

    def forward(self, x, training=True):
        y, self.ctx = self.backend.conv2d_forward(x, self.params["weight"], self.plan, keep=training)
        if self.use_bias:
            self.backend.bias_forward(y, self.params["bias"])
        return y

    def backward(self, dy):
        dx, dw = self.backend.conv2d_backward(dy, self.params["weight"], self.ctx, self.plan, self.need_dx)
        self.grads["weight"][...] = dw
        if self.use_bias:
            self.backend.bias_backward(dy, self.grads["bias"])
        return dx

    def flops(self):
        c_out, ho, wo = self.output_shape
        kh, kw = self.kernel_size
        macs = c_out * ho * wo * (self.input_shape[0] // self.groups) * kh * kw
        return 2 * macs + (c_out * ho * wo if self.use_bias else 0)
