"""A new layer in one class: define PReLU, check its gradients, train a model with it.

    python examples/custom_layer.py
"""

import numpy as np

from pydtnn import data
from pydtnn.backends import CPUBackend
from pydtnn.layers import Conv2D, Dense, Flatten, Layer, MaxPool2D
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.optim import SGD
from pydtnn.testing import check_against_torch, check_gradients
from pydtnn.trainer import Trainer


class PReLU(Layer):
    """y = x if x > 0 else a_c * x, with one learnable slope a_c per channel. x: (N, C, ...)."""

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.add_param("weight", self.xp.full(self.input_shape[0], 0.25, dtype))  # PyTorch's name and init
        self.shape = (1, -1) + (1,) * (len(self.input_shape) - 1)  # broadcast a_c over the channel axis

    def forward(self, x, training=True):
        self.x = x if training else None
        return self.xp.where(x > 0, x, x * self.params["weight"].reshape(self.shape))

    def backward(self, dy):
        x = self.take_saved("x")  # and let it go: nothing holds it for the rest of backward
        neg = x <= 0
        axes = (0,) + tuple(range(2, dy.ndim))
        self.grads["weight"][...] = (dy * x * neg).sum(axis=axes)
        return self.xp.where(neg, dy * self.params["weight"].reshape(self.shape), dy)


if __name__ == "__main__":
    check_gradients(PReLU(), (4, 3, 5, 5))  # float64 central differences
    try:
        import torch.nn.functional as F

        check_against_torch(PReLU(), (4, 3, 5, 5), lambda x, p: F.prelu(x, p["weight"]))
        print("PReLU: gradients match finite differences and PyTorch")
    except ImportError:
        print("PReLU: gradients match finite differences (install torch to compare with PyTorch)")

    train, test = data.load("mnist5k")
    layers = [Conv2D(8, 3, padding=1), PReLU(), MaxPool2D(2), Flatten(), Dense(32), PReLU(), Dense(10)]
    model = Model(layers, train.input_shape, CPUBackend(seed=0))
    trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.05, momentum=0.9))
    trainer.fit(train, epochs=2, batch_size=64, test=test)
    print(f"test accuracy with PReLU: {trainer.final['test_accuracy']:.4f}")
