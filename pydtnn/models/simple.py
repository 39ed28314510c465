"""Small models for MNIST-sized inputs: quick to train, good for tests and first runs."""

from pydtnn.layers import Conv2D, Dense, Flatten, MaxPool2D, ReLU


def simplecnn(input_shape=(1, 28, 28), num_classes=10):
    """Two 3x3 conv + max-pool stages (16 and 32 filters), then Dense(64) and the classifier."""
    return [
        Conv2D(16, 3, padding=1), ReLU(), MaxPool2D(2),
        Conv2D(32, 3, padding=1), ReLU(), MaxPool2D(2),
        Flatten(), Dense(64), ReLU(), Dense(num_classes, weight_init="glorot_uniform"),
    ]


def simplemlp(input_shape=(1, 28, 28), num_classes=10):
    """Flatten, two hidden Dense layers (256, 128) with ReLU, and the classifier."""
    return [Flatten(), Dense(256), ReLU(), Dense(128), ReLU(), Dense(num_classes, weight_init="glorot_uniform")]
