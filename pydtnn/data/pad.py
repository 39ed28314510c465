"""Zero padding of every image up to a model's design size (28x28 digits for a 32x32 network).

    train = PaddedDataset(train, (1, 32, 32))   # batches come out (N, 1, 32, 32), the image centred

The padding takes the value a black pixel has after the dataset's normalization, as augmentation's
does, so padding the normalized batch equals padding the raw pixels first.
"""

import numpy as np

from pydtnn.data.augment import black
from pydtnn.errors import ConfigError


class PaddedDataset:
    """Any dataset whose (C, H, W) images are zero-padded, centred, to `shape` (C, H2 >= H, W2 >= W)."""

    def __init__(self, dataset, shape):
        c, h, w = dataset.input_shape
        shape = tuple(int(s) for s in shape)
        if len(shape) != 3 or shape[0] != c or shape[1] < h or shape[2] < w:
            raise ConfigError(f"cannot pad {c}x{h}x{w} images to {'x'.join(map(str, shape))}; expected "
                              f"{c} channels and sides at least {h}x{w}")
        self.dataset, self.input_shape = dataset, shape
        self.num_classes, self.name = dataset.num_classes, getattr(dataset, "name", "dataset")
        self.top, self.left = (shape[1] - h) // 2, (shape[2] - w) // 2
        # the normalization, passed on so that augmentation pads crops with the same black
        self.mean, self.std = getattr(dataset, "mean", None), getattr(dataset, "std", None)
        self.fill = black(dataset)

    def __len__(self):
        return len(self.dataset)

    @property
    def y(self):
        return self.dataset.y

    def get_batch(self, idx, dtype=np.float32, rng=None, out=None):
        """(x padded to (N, *input_shape), y) of the wrapped dataset's batch (x written into out, if given)."""
        x, y = self.dataset.get_batch(idx, dtype, rng=rng)
        c, h, w = x.shape[1:]
        out = np.empty((len(x), *self.input_shape), dtype) if out is None else out
        out[...] = self.fill.astype(dtype).reshape(1, c, 1, 1)
        out[:, :, self.top:self.top + h, self.left:self.left + w] = x
        return out, y

    def subset(self, idx, name=None):
        return PaddedDataset(self.dataset.subset(idx, name=name), self.input_shape)
