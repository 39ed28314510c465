"""Layers that only change the shape of a tensor."""

import numpy as np

from pydtnn.layers.base import Layer


class Flatten(Layer):
    """(N, C, H, W) -> (N, C*H*W), in row-major (C, H, W) order, as torch.flatten(x, 1)."""

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.output_shape = (int(np.prod(self.input_shape)),)

    def forward(self, x, training=True):
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape((dy.shape[0],) + self.input_shape)
