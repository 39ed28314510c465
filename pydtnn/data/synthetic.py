"""Synthetic images: any shape and number of classes, generated per batch, deterministic from a seed.

Sample i of a split has a label drawn uniformly from (seed, split) and the image

    x_i = pattern[y_i] + noise_i,    noise_i ~ N(0, 1) per pixel, drawn from (seed, split, i)

where pattern[c] is a random N(0, 1) 8x8 grid per channel, blown up to H x W (class-specific
blotches). The labels are therefore learnable: a model that trains correctly beats chance quickly,
which makes the dataset a smoke test as well as a throughput benchmark (--use_synthetic_data).
Images are never constant or zero, and no split is held in memory (ImageNet-sized works too).
"""

import numpy as np

from pydtnn.data.streamed import StreamedDataset
from pydtnn.errors import ConfigError

GRID = 8


class SyntheticDataset(StreamedDataset):
    """n synthetic samples of shape input_shape (C, H, W) in num_classes classes (see module doc).

    split: 0 for training, 1 for test, so the two are different samples from the same classes.
    """

    def __init__(self, n, input_shape=(3, 32, 32), num_classes=10, seed=0, split=0, name="synthetic"):
        shape = tuple(int(d) for d in input_shape)
        if len(shape) != 3 or min(shape) < 1 or n < 1 or num_classes < 1:
            raise ConfigError(f"synthetic data needs n >= 1, input_shape (C, H, W) and num_classes >= 1; "
                              f"got n={n}, input_shape={input_shape}, num_classes={num_classes}")
        labels = np.random.default_rng([seed, split, 1]).integers(0, num_classes, n)
        super().__init__(labels, num_classes, shape, name, scale=1.0)
        c, h, w = shape
        self.patterns = np.random.default_rng([seed, 2]).standard_normal((num_classes, c, GRID, GRID), np.float32)
        self.grid_rows, self.grid_cols = np.arange(h) * GRID // h, np.arange(w) * GRID // w
        self.seed, self.split = seed, split
        self.row_labels = self.y  # labels by storage row (a subset's y follows its own samples)

    def _read(self, rows, rng):
        pattern = self.patterns[self.row_labels[rows]][:, :, self.grid_rows][:, :, :, self.grid_cols]
        noise = np.empty((len(rows),) + self.raw_shape, np.float32)
        for i, row in enumerate(rows):  # per sample, so an image does not depend on its batch
            rng_i = np.random.default_rng([self.seed, self.split, 3, int(row)])
            noise[i] = rng_i.standard_normal(self.raw_shape, np.float32)
        return pattern + noise


def load_synthetic(input_shape=(3, 32, 32), num_classes=10, train_size=10000, test_size=2000, seed=0):
    """(train, test) SyntheticDatasets of the given sample shape and classes."""
    return (SyntheticDataset(train_size, input_shape, num_classes, seed, 0, "synthetic/train"),
            SyntheticDataset(test_size, input_shape, num_classes, seed, 1, "synthetic/test"))
