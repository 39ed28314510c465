"""Datasets whose images stay in storage and are read per batch.

StreamedDataset is the common part: labels in memory, images read by a subclass's `_read(rows, rng)`
as raw pixels (uint8, or float in [0, 1]), then the optional Augmentation (training batches only),
then per-channel normalization. ShardedArrayDataset reads from one or more (n, C, H, W) arrays,
typically memory-mapped files (CIFAR binary batches, .npy shards), so memory holds one batch.
"""

import copy

import numpy as np

from pydtnn.data.augment import normalize
from pydtnn.errors import DataError

PIXEL_CONTRACT = "uint8 (0..255) or float in [0, 1]"
# Float pixels may stray from [0, 1] by rounding in someone's preprocessing; 0..255 floats or
# standardized values must not pass, or training diverges and the learning rate gets the blame.
PIXEL_RANGE = (-1e-3, 1 + 1e-3)


def check_pixel_dtype(dtype, where):
    """DataError naming `where` unless images of `dtype` are raw pixels: uint8, or float."""
    dtype = np.dtype(dtype)
    if dtype != np.uint8 and dtype.kind != "f":
        raise DataError(f"{where}: images of dtype {dtype}; expected {PIXEL_CONTRACT}")


def check_float_pixels(x, where, samples=None, value_range=PIXEL_RANGE):
    """DataError naming `where` and the first sample of float images x (n, ...) holding NaN or Inf, or
    (value_range given) a value outside it. samples: the sample number of each row (default 0..n-1)."""
    if x.size == 0:
        return
    flat = x.reshape(len(x), -1)
    samples = np.arange(len(x)) if samples is None else samples
    lo, hi = flat.min(axis=1), flat.max(axis=1)  # NaN propagates: two reductions cover finiteness too
    finite = np.isfinite(lo) & np.isfinite(hi)
    if not finite.all():
        raise DataError(f"{where}: sample {int(samples[np.argmin(finite)])} contains NaN or Inf; "
                        f"expected finite pixel values")
    if value_range is not None:
        bad = (lo < value_range[0]) | (hi > value_range[1])
        if bad.any():
            i = np.argmax(bad)
            raise DataError(f"{where}: sample {int(samples[i])} has pixel values from {lo[i]:g} to {hi[i]:g}; "
                            f"expected {PIXEL_CONTRACT}")


def check_dataset_labels(labels, num_classes, where):
    """A dataset's label array, checked when it is loaded: int64 (N,) for any N; DataError naming `where`
    (the file) and the first label outside 0..num_classes-1. Batches are checked by losses.check_batch_labels."""
    y = np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"{where}: labels must be a vector (N,), got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where}: labels must be integers, got dtype {y.dtype}")
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if bad.size:
        raise DataError(f"{where}: label {int(y[bad[0]])} of sample {int(bad[0])} out of range; "
                        f"expected 0..{num_classes - 1}")
    return y.astype(np.int64)


class StreamedDataset:
    """Base of datasets read per batch; subclasses implement `_read(rows, rng)`.

    labels: int64 (N,), checked. input_shape: (C, H, W) of what `_read` returns. Pixels are scaled by
    `scale`, then normalized with `mean`/`std` (C,) when given. A subset is a view: it keeps the
    storage and maps its sample i to storage row `rows[i]`.
    """

    def __init__(self, labels, num_classes, input_shape, name, scale=1 / 255, mean=None, std=None):
        self.y = check_dataset_labels(labels, num_classes, name)
        self.rows = np.arange(len(self.y))
        self.num_classes, self.name = int(num_classes), name
        self.raw_shape = tuple(int(d) for d in input_shape)
        self.scale, self.mean, self.std = scale, mean, std
        self.augment = None

    def __len__(self):
        return len(self.y)

    @property
    def input_shape(self):
        return self.augment.output_shape(self.raw_shape) if self.augment is not None else self.raw_shape

    def _read(self, rows, rng):
        """Raw pixels (len(rows), C, H, W) of storage rows; rng is None for the evaluation view."""
        raise NotImplementedError

    def get_batch(self, idx, dtype=np.float32, rng=None, out=None):
        """(x, y) for samples idx: x (len(idx), C, H, W) in `dtype`, normalized; y (len(idx),) int64.

        rng: the training batch's Generator (random augmentation); None for the evaluation view.
        out: an array (len(idx), C, H, W) of `dtype` to write x into (pydtnn.data.workers' shares).
        """
        idx = np.asarray(idx, dtype=np.int64)
        x = self._read(self.rows[idx], rng)
        if self.augment is not None:
            x = self.augment(x, rng)  # raw pixels: zero padding is black
        return normalize(x, dtype, self.scale, self.mean, self.std, out), self.y[idx]

    def subset(self, idx, name=None):
        """A view on samples idx (same storage, normalization and augmentation)."""
        out = copy.copy(self)
        out.rows, out.y, out.name = self.rows[idx], self.y[idx], name or self.name
        return out

    def with_augmentation(self, augmentation):
        """This dataset with `augmentation` (an augment.Augmentation, or None) on training batches;
        ConfigError if its crop does not fit these images."""
        if augmentation is not None:
            augmentation.output_shape(self.raw_shape)
        out = copy.copy(self)
        out.augment = augmentation
        return out


class ShardedArrayDataset(StreamedDataset):
    """Images in one or more arrays (n_i, C, H, W), e.g. memory-mapped files, read per batch.

    shards: the image arrays, all of one dtype and sample shape; labels: all labels, in shard order;
    files: the file of each shard (for error messages). Float shards are checked for NaN/Inf, and
    for values outside `value_range` when given (e.g. PIXEL_RANGE), as their batches are read (a
    whole-dataset scan would read every byte at start-up).
    """

    def __init__(self, shards, labels, num_classes, files, name, scale=1 / 255, mean=None, std=None,
                 value_range=None):
        shapes = {tuple(s.shape[1:]) for s in shards}
        dtypes = {s.dtype for s in shards}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise DataError(f"{name}: shards {', '.join(map(str, files))} differ in sample shape {sorted(shapes)} "
                            f"or dtype {sorted(map(str, dtypes))}; expected one of each")
        counts = [len(s) for s in shards]
        if sum(counts) != len(labels):
            raise DataError(f"{name}: {sum(counts)} images but {len(labels)} labels")
        super().__init__(labels, num_classes, shapes.pop(), name, scale, mean, std)
        self.shards, self.files = list(shards), [str(f) for f in files]
        self.offsets = np.cumsum([0] + counts)
        self.dtype = dtypes.pop()
        self.value_range = value_range

    def _read(self, rows, rng):
        out = np.empty((len(rows),) + self.raw_shape, self.dtype)
        shard = np.searchsorted(self.offsets, rows, side="right") - 1
        for s in np.unique(shard):
            mask = shard == s
            local = rows[mask] - self.offsets[s]
            part = self.shards[s][local]
            if self.dtype.kind == "f":
                check_float_pixels(part, self.files[s], local, self.value_range)
            out[mask] = part
        return out
