"""Element-wise activations and softmax. Each keeps the one tensor its backward needs until that backward."""

import numpy as np

from pydtnn.layers.base import Layer


class _Elementwise(Layer):
    """An activation costs `cost` FLOPs per element."""

    cost = 1

    def flops(self):
        return self.cost * int(np.prod(self.input_shape))


class ReLU(_Elementwise):
    """y = max(x, 0)."""

    def forward(self, x, training=True):
        y = self.backend.relu_forward(x)
        self.y = y if training else None
        return y

    def backward(self, dy):
        return self.backend.relu_backward(dy, self.take_saved("y"))


class ReLU6(_Elementwise):
    """y = min(max(x, 0), 6) (MobileNet's activation)."""

    def forward(self, x, training=True):
        y = self.backend.relu_forward(x, cap=6.0)
        self.y = y if training else None
        return y

    def backward(self, dy):
        return self.backend.relu_backward(dy, self.take_saved("y"), cap=6.0)


class LeakyReLU(_Elementwise):
    """y = x if x > 0 else alpha * x."""

    def __init__(self, alpha=0.01):
        super().__init__()
        self.alpha = float(alpha)

    def describe(self):
        return f"LeakyReLU({self.alpha})"

    def forward(self, x, training=True):
        self.mask = (x > 0) if training else None
        return self.xp.where(x > 0, x, x * self.alpha)

    def backward(self, dy):
        return self.xp.where(self.take_saved("mask"), dy, dy * self.alpha)


class Sigmoid(_Elementwise):
    """y = 1 / (1 + exp(-x)), computed without overflow for large |x|."""

    cost = 4

    def forward(self, x, training=True):
        xp = self.xp
        e = xp.exp(-xp.abs(x))  # in (0, 1]: never overflows
        y = xp.where(x >= 0, 1 / (1 + e), e / (1 + e))
        self.y = y if training else None
        return y

    def backward(self, dy):
        y = self.take_saved("y")
        return dy * y * (1 - y)


class Tanh(_Elementwise):
    """y = tanh(x); dy/dx = 1 - y^2."""

    cost = 4

    def forward(self, x, training=True):
        y = self.xp.tanh(x)
        self.y = y if training else None
        return y

    def backward(self, dy):
        y = self.take_saved("y")
        return dy * (1 - y * y)


class Softmax(_Elementwise):
    """Softmax over axis 1 (features or channels). For training, prefer the fused loss
    `SoftmaxCrossEntropy` on logits: it is cheaper and numerically safer."""

    cost = 4

    def forward(self, x, training=True):
        z = x - x.max(axis=1, keepdims=True)
        e = self.xp.exp(z)
        y = e / e.sum(axis=1, keepdims=True)
        self.y = y if training else None
        return y

    def backward(self, dy):
        y = self.take_saved("y")
        return y * (dy - (dy * y).sum(axis=1, keepdims=True))


class GELU(_Elementwise):
    """y = x * Phi(x), Phi the standard normal CDF (approximate="none", exact through erf), or PyTorch's
    tanh form (approximate="tanh"): 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))). Keeps x."""

    cost = 8
    FORMS = ("none", "tanh")

    def __init__(self, approximate="none"):
        super().__init__()
        if approximate not in self.FORMS:
            raise ValueError(f"GELU approximate must be one of {', '.join(self.FORMS)}, got {approximate!r}")
        self.approximate = approximate

    def describe(self):
        return "GELU()" if self.approximate == "none" else f"GELU({self.approximate})"

    def forward(self, x, training=True):
        self.x = x if training else None
        return self.backend.gelu_forward(x, self.approximate)

    def backward(self, dy):
        return self.backend.gelu_backward(dy, self.take_saved("x"), self.approximate)
