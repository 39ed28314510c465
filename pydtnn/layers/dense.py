"""Fully connected layer."""

import numpy as np

from pydtnn.layers.base import Layer


class Dense(Layer):
    """y = x @ W.T + b.

    x: (N, in_features) -> y: (N, units). PyTorch layout: weight (units, in_features), bias (units,).
    """

    def __init__(self, units, use_bias=True, weight_init="he_uniform", bias_init="zeros"):
        super().__init__()
        self.units, self.use_bias = int(units), use_bias
        self.weight_init, self.bias_init = weight_init, bias_init

    def describe(self):
        return f"Dense({self.units}{'' if self.use_bias else ', no bias'})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(1, "(features,)")
        fan_in = self.input_shape[0]
        self.add_param("weight", self.init(self.weight_init, (self.units, fan_in), fan_in, self.units))
        if self.use_bias:
            self.add_param("bias", self.init(self.bias_init, (self.units,), fan_in, self.units))
        self.output_shape = (self.units,)

    def forward(self, x, training=True):
        self.x = x if training else None  # kept only when backward will need it
        y = self.backend.matmul(x, self.params["weight"].T)
        if self.use_bias:
            y += self.params["bias"]
        return y

    def backward(self, dy):
        self.backend.matmul(dy.T, self.take_saved("x"), out=self.grads["weight"])
        if self.use_bias:
            dy.sum(axis=0, out=self.grads["bias"])
        return self.backend.matmul(dy, self.params["weight"]) if self.need_dx else None

    def flops(self):
        return 2 * self.input_shape[0] * self.units + (self.units if self.use_bias else 0)


FC = Dense  # PyDTNN's name
