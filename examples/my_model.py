"""A model file: a small CNN with a layer of its own, trained from the command line.

    pydtnn-train --model_file examples/my_model.py --num_epochs 2 --checkpoint_dir my_ckpt

pydtnn-train runs this file and calls create_model with the data's sample shape and number of
classes; the model is named after the file ("my_model"). docs/layers.md explains the contract.
"""

import numpy as np

from pydtnn.layers import Conv2D, Dense, Flatten, Layer, MaxPool2D


class Swish(Layer):
    """y = x * sigmoid(x) (SiLU), elementwise; no parameters. x: any shape (N, ...)."""

    def forward(self, x, training=True):
        s = 0.5 * (1 + self.xp.tanh(0.5 * x))  # sigmoid(x), without exp overflow for large |x|
        self.x, self.s = (x, s) if training else (None, None)
        return x * s

    def backward(self, dy):
        x, s = self.take_saved("x"), self.take_saved("s")
        return dy * s * (1 + x * (1 - s))  # d(x s)/dx = s + x s (1 - s)

    def flops(self):
        return 5 * int(np.prod(self.input_shape))


def create_model(input_shape, num_classes):
    """Two 3x3 convolution + max-pool stages, then a hidden Dense layer: input_shape (C, H, W), H, W >= 4."""
    return [
        Conv2D(16, 3, padding=1), Swish(), MaxPool2D(2),
        Conv2D(32, 3, padding=1), Swish(), MaxPool2D(2),
        Flatten(), Dense(64), Swish(), Dense(num_classes, weight_init="glorot_uniform"),
    ]
