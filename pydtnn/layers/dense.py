"""Fully connected layer."""

import numpy as np

from pydtnn.layers.base import Layer


class Dense(Layer):
    """y = x @ W.T + b.

    x: (N, in_features) -> y: (N, units), or per token (N, T, in_features) -> (N, T, units) (nn.Linear on a
    sequence: every token through the same weights). PyTorch layout: weight (units, in_features), bias (units,).
    """

    def __init__(self, units, use_bias=True, weight_init="he_uniform", bias_init="zeros"):
        super().__init__()
        self.units, self.use_bias = int(units), use_bias
        self.weight_init, self.bias_init = weight_init, bias_init
        self.bias_here = True  # False where ranks each give a share of the sum (Megatron's row split): one adds it

    def describe(self):
        return f"Dense({self.units}{'' if self.use_bias else ', no bias'})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        if len(self.input_shape) != 2:
            self.expect_rank(1, "(features,) or (tokens, features)")
        fan_in = self.input_shape[-1]
        self.add_param("weight", self.init(self.weight_init, (self.units, fan_in), fan_in, self.units))
        if self.use_bias:
            self.add_param("bias", self.init(self.bias_init, (self.units,), fan_in, self.units))
        self.output_shape = self.input_shape[:-1] + (self.units,)

    def forward(self, x, training=True):
        x2 = x.reshape(-1, x.shape[-1])  # tokens: one GEMM over every (sample, token) row
        self.x = x2 if training else None  # kept only when backward will need it
        y = self.backend.matmul(x2, self.params["weight"].T)
        if self.use_bias and self.bias_here:
            y += self.params["bias"]
        return y.reshape(x.shape[:-1] + (self.units,))

    def backward(self, dy):
        dy2 = dy.reshape(-1, self.units)
        self.backend.matmul(dy2.T, self.take_saved("x"), out=self.grads["weight"])
        if self.use_bias:
            dy2.sum(axis=0, out=self.grads["bias"])
        if not self.need_dx:
            return None
        return self.backend.matmul(dy2, self.params["weight"]).reshape(dy.shape[:-1] + (self.input_shape[-1],))

    def flops(self):
        rows = int(np.prod(self.input_shape[:-1]))
        return rows * (2 * self.input_shape[-1] * self.units + (self.units if self.use_bias else 0))


FC = Dense  # PyDTNN's name
