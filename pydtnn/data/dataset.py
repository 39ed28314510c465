"""In-memory datasets of images and labels, and the per-epoch batch order."""

import numpy as np

from pydtnn.data.streamed import check_dataset_labels, check_float_pixels
from pydtnn.errors import DataError


class ArrayDataset:
    """Images x (N, C, H, W) of any numeric dtype and integer labels y (N,), kept as stored.

    Batches are converted on the fly: x * scale, then minus `mean` and divided by `std` per channel
    (when given), in the requested float dtype. Storing uint8 and converting per batch keeps memory at
    one byte per pixel. Float images must be finite but may hold any values (already normalized data
    is fine); the file loaders check raw pixels against their contract before they get here.
    """

    def __init__(self, x, y, num_classes, scale=1.0, mean=None, std=None, name="dataset"):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 4:
            raise DataError(f"{name}: images must be (N, C, H, W), got shape {x.shape}")
        if y.shape != (x.shape[0],):
            raise DataError(f"{name}: {x.shape[0]} images but labels of shape {y.shape}; expected ({x.shape[0]},)")
        y = check_dataset_labels(y, num_classes, name)
        if np.issubdtype(x.dtype, np.floating):
            check_float_pixels(x, name, value_range=None)
        self.x, self.y = x, y
        self.num_classes, self.name = int(num_classes), name
        self.scale = scale
        c = x.shape[1]
        self.mean = None if mean is None else np.asarray(mean, np.float64).reshape(1, c, 1, 1)
        self.std = None if std is None else np.asarray(std, np.float64).reshape(1, c, 1, 1)

    def __len__(self):
        return len(self.y)

    @property
    def input_shape(self):
        return tuple(self.x.shape[1:])

    def get_batch(self, idx, dtype=np.float32, rng=None, out=None):
        """(x, y) for sample indices idx: x (len(idx), C, H, W) in `dtype`, y (len(idx),) int64.

        rng: a Generator for random augmentation, given for training batches only (None: the
        deterministic evaluation view). An ArrayDataset has no augmentation and ignores it.
        out: an array (len(idx), C, H, W) of `dtype` to write x into.
        """
        if out is None:
            x = self.x[idx].astype(dtype)
        else:
            x = out
            x[...] = self.x[idx]
        if self.scale != 1.0:
            x *= self.scale  # a Python float: keeps the array's dtype
        if self.mean is not None:
            x -= self.mean.astype(dtype)
        if self.std is not None:
            x /= self.std.astype(dtype)
        return x, self.y[idx]

    def subset(self, idx, name=None):
        """A dataset over samples idx, sharing this one's normalization."""
        out = ArrayDataset.__new__(ArrayDataset)
        out.__dict__.update(self.__dict__)
        out.x, out.y, out.name = self.x[idx], self.y[idx], name or self.name
        return out


def epoch_order(n, seed, epoch, shuffle=True):
    """Sample order of one epoch: a permutation drawn from (seed, epoch) alone.

    Being a pure function of (seed, epoch), it is the same on every rank and after a resume.
    """
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_slices(n, batch_size, drop_last=False):
    """[(start, stop)] covering range(n) in batches; the last one may be smaller unless drop_last."""
    stops = range(batch_size, n + (0 if drop_last else batch_size), batch_size)
    return [(s - batch_size, min(s, n)) for s in stops if s - batch_size < n]
