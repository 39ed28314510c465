"""Element-wise activations and softmax. Each keeps the one tensor its backward needs until that backward."""

import numpy as np

from pydtnn.layers.base import Layer


class _Elementwise(Layer):
    """An activation costs `cost` FLOPs per element."""

    cost = 1

    def flops(self):
        return self.cost * int(np.prod(self.input_shape))

    def _take_output(self):
        """The output forward kept, handed to this backward and let go: during the rest of backward and
        until the next forward this layer holds nothing (a second backward needs a new forward)."""
        y, self.y = getattr(self, "y", None), None
        if y is None:
            raise RuntimeError(f"{self.name}: no saved forward state; run forward(x, training=True) before each "
                               "backward")
        return y


class ReLU(_Elementwise):
    """y = max(x, 0)."""

    def forward(self, x, training=True):
        y = self.backend.relu_forward(x)
        self.y = y if training else None
        return y

    def backward(self, dy):
        return self.backend.relu_backward(dy, self._take_output())


class ReLU6(_Elementwise):
    """y = min(max(x, 0), 6) (MobileNet's activation)."""

    def forward(self, x, training=True):
        y = self.backend.relu_forward(x, cap=6.0)
        self.y = y if training else None
        return y

    def backward(self, dy):
        return self.backend.relu_backward(dy, self._take_output(), cap=6.0)


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
        return self.xp.where(self.mask, dy, dy * self.alpha)


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
        y = self._take_output()
        return dy * y * (1 - y)


class Tanh(_Elementwise):
    """y = tanh(x); dy/dx = 1 - y^2."""

    cost = 4

    def forward(self, x, training=True):
        y = self.xp.tanh(x)
        self.y = y if training else None
        return y

    def backward(self, dy):
        y = self._take_output()
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
        y = self._take_output()
        return y * (dy - (dy * y).sum(axis=1, keepdims=True))
