"""Inverted dropout."""

from pydtnn.layers.base import Layer
from pydtnn.randomness import layer_stream


class Dropout(Layer):
    """Zero each element with probability `rate` during training and scale survivors by 1/(1-rate).

    The mask is drawn per element of every sample (never shared across the batch) by the backend's
    dropout_mask: in training, from each sample's own stream for this layer (pydtnn.randomness, keyed by
    the layer's path), so it is the same at any process count; evaluation is the identity.
    """

    def __init__(self, rate=0.5):
        super().__init__()
        if not 0 <= rate < 1:
            raise ValueError(f"Dropout rate must be in [0, 1), got {rate}")
        self.rate = float(rate)
        self.channels = None  # (whole C, lo, hi): this layer sees channels [lo, hi) of a C-channel tensor

    def describe(self):
        return f"Dropout({self.rate})"

    def forward(self, x, training=True):
        if not training or self.rate == 0:
            self.mask = None
            return x
        if self.channels is None:
            self.mask = self.backend.dropout_mask(x.shape, self.rate, x.dtype, layer_stream(self.path))
        else:  # the whole tensor's mask, cut: the same draws as the whole layer's (model parallelism)
            whole, lo, hi = self.channels
            shape = (x.shape[0], whole) + x.shape[2:]
            self.mask = self.backend.dropout_mask(shape, self.rate, x.dtype, layer_stream(self.path))[:, lo:hi]
        return x * self.mask

    def backward(self, dy):
        return dy if self.mask is None else dy * self.mask
