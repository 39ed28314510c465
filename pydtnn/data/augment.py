"""Training-time augmentation (random crop with zero padding, horizontal flip) and normalization.

Every function works on a whole batch x (N, C, H, W) at once (no per-sample Python loop) and draws
its randomness from the Generator it is given, so a batch is a pure function of (data, Generator):
the trainer's per-batch Generator makes augmented runs reproducible and resumable.

    aug = Augmentation(flip=True, crop=True, crop_padding=4)
    x = aug(x_uint8, rng)       # training view; aug(x, None) is the deterministic evaluation view
    train = with_augmentation(train, flip=True, crop=True)   # any dataset; used when rng is given
"""

import numbers

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pydtnn.errors import ConfigError


def normalize(x, dtype=np.float32, scale=1.0, mean=None, std=None, out=None):
    """(x * scale - mean) / std per channel, as a new array of `dtype`, or written into `out` (same shape).

    x: (N, C, H, W) of any numeric dtype; mean, std: (C,) or None (skipped).
    """
    if out is None:
        out = np.asarray(x).astype(dtype)
    else:
        out[...] = x
    if scale != 1.0:
        out *= scale  # a Python float keeps the array's dtype
    c = out.shape[1]
    if mean is not None:
        out -= np.asarray(mean, dtype).reshape(1, c, 1, 1)
    if std is not None:
        out /= np.asarray(std, dtype).reshape(1, c, 1, 1)
    return out


def random_flip(x, rng, prob=0.5):
    """Each image of x (N, C, H, W) mirrored left-right with probability `prob`; a new array."""
    flip = rng.random(len(x)) < prob
    return np.where(flip[:, None, None, None], x[..., ::-1], x)


def random_crop(x, rng, size=None, padding=4, prob=1.0, fill=0):
    """A random (size x size) window of each image of x (N, C, H, W) padded by `padding` pixels.

    size: output side (None: keep H x W, i.e. a random shift of at most `padding` pixels).
    prob: fraction of images cropped at random; the others take the centre window.
    fill: value of the padding (0 = black for raw pixels), a scalar or one value per channel.
    Returns a new array (N, C, size, size).
    """
    n, c, h, w = x.shape
    check_crop((c, h, w), padding, size)
    sh, sw = (h, w) if size is None else (size, size)
    ph, pw = h + 2 * padding, w + 2 * padding
    padded = np.empty((n, c, ph, pw), x.dtype)
    padded[...] = np.asarray(fill, x.dtype).reshape(1, -1, 1, 1) if np.ndim(fill) else fill
    padded[:, :, padding:padding + h, padding:padding + w] = x
    top = rng.integers(0, ph - sh + 1, n)
    left = rng.integers(0, pw - sw + 1, n)
    if prob < 1.0:
        keep = rng.random(n) >= prob
        top[keep], left[keep] = (ph - sh) // 2, (pw - sw) // 2
    windows = sliding_window_view(padded, (sh, sw), axis=(2, 3))  # (N, C, ph-sh+1, pw-sw+1, sh, sw)
    return windows[np.arange(n), :, top, left]  # advanced indices around a slice: (N, C, sh, sw)


def check_crop(input_shape, padding, size=None):
    """ConfigError unless a crop of `size` (None: the image size) from images (C, H, W) padded by
    `padding` pixels fits. Padding beyond the image only adds black, and a huge one would allocate a
    huge batch; it is refused before the first batch."""
    h, w = input_shape[1:]
    if padding > max(h, w):
        raise ConfigError(f"crop_padding={padding} is larger than the {h}x{w} image; "
                          f"expected at most {max(h, w)}")
    ph, pw = h + 2 * padding, w + 2 * padding
    if size is not None and (size > ph or size > pw):
        raise ConfigError(f"crop size {size} exceeds the padded image {ph}x{pw} (image {h}x{w}, padding {padding})")


def center_crop(x, size):
    """The centre (size x size) window of each image of x (N, C, H, W); a view when it fits."""
    h, w = x.shape[2:]
    if size is None or (size >= h and size >= w):
        return x
    top, left = (h - size) // 2, (w - size) // 2
    return x[:, :, top:top + size, left:left + size]


def _probability(name, p):
    if not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def black(dataset):
    """(C,) value of a black (zero) pixel after `dataset`'s normalization (its mean and std, if any)."""
    value = np.zeros(dataset.input_shape[0])
    mean, std = getattr(dataset, "mean", None), getattr(dataset, "std", None)
    if mean is not None:
        value -= np.asarray(mean, np.float64).reshape(-1)
    if std is not None:
        value /= np.asarray(std, np.float64).reshape(-1)
    return value


class Augmentation:
    """Random crop (zero padding) then horizontal flip, applied to training batches only.

    flip, flip_prob: mirror each image with probability flip_prob (PyDTNN's --flip_images,
    --flip_images_prob). crop, crop_padding, crop_size, crop_prob: pad by crop_padding zeros and take
    a random crop_size window (default the image size) from a crop_prob fraction of the images
    (--crop_images, --crop_images_padding, --crop_images_size, --crop_images_prob). A crop_size
    smaller than the image changes the input shape, and the evaluation view then takes the centre.
    """

    def __init__(self, flip=False, flip_prob=0.5, crop=False, crop_padding=4, crop_size=None, crop_prob=1.0):
        self.flip, self.crop = bool(flip), bool(crop)
        self.flip_prob = _probability("flip_prob", flip_prob)
        self.crop_prob = _probability("crop_prob", crop_prob)
        if not isinstance(crop_padding, numbers.Integral) or crop_padding < 0:
            raise ConfigError(f"crop_padding must be a non-negative integer, got {crop_padding!r}")
        if crop_size is not None and (not isinstance(crop_size, numbers.Integral) or crop_size < 1):
            raise ConfigError(f"crop_size must be a positive integer or None, got {crop_size!r}")
        self.crop_padding, self.crop_size = int(crop_padding), crop_size

    def output_shape(self, input_shape):
        """Sample shape (C, H, W) after this augmentation; ConfigError if the crop does not fit (check_crop)."""
        if self.crop:
            check_crop(input_shape, self.crop_padding, self.crop_size)
        if not self.crop or self.crop_size is None:
            return tuple(input_shape)
        return (input_shape[0], self.crop_size, self.crop_size)

    def __call__(self, x, rng=None, fill=0):
        """Augmented batch (rng given) or the deterministic evaluation view (rng None) of x (N, C, H, W)."""
        if rng is None:
            return center_crop(x, self.crop_size) if self.crop else x
        if self.crop:
            x = random_crop(x, rng, self.crop_size, self.crop_padding, self.crop_prob, fill)
        if self.flip:
            x = random_flip(x, rng, self.flip_prob)
        return x

    def __repr__(self):
        return (f"Augmentation(flip={self.flip}, flip_prob={self.flip_prob}, crop={self.crop}, "
                f"crop_padding={self.crop_padding}, crop_size={self.crop_size}, crop_prob={self.crop_prob})")


class AugmentedDataset:
    """Any dataset (e.g. an in-memory ArrayDataset) with an Augmentation on its normalized batches.

    The padding takes the value a black pixel has after the dataset's normalization, so the result
    equals augmenting the raw pixels first.
    """

    def __init__(self, dataset, augmentation):
        augmentation.output_shape(dataset.input_shape)  # refuses a crop that does not fit, now
        self.dataset, self.augment = dataset, augmentation
        self.num_classes, self.name = dataset.num_classes, getattr(dataset, "name", "dataset")
        self.fill = black(dataset)

    def __len__(self):
        return len(self.dataset)

    @property
    def input_shape(self):
        return self.augment.output_shape(self.dataset.input_shape)

    @property
    def y(self):
        return self.dataset.y

    def get_batch(self, idx, dtype=np.float32, rng=None, out=None):
        """(x, y) as the wrapped dataset gives them, augmented when rng is a Generator (x written into out)."""
        x, y = self.dataset.get_batch(idx, dtype)
        x = self.augment(x, rng, self.fill)
        if out is not None:
            out[...] = x
            return out, y
        return np.ascontiguousarray(x, dtype=dtype), y

    def subset(self, idx, name=None):
        return AugmentedDataset(self.dataset.subset(idx, name=name), self.augment)


def with_augmentation(dataset, flip=False, flip_prob=0.5, crop=False, crop_padding=4, crop_size=None, crop_prob=1.0):
    """`dataset` with random flips and/or crops on its training batches (those given an rng).

    Returns the dataset itself when neither flip nor crop is asked for. Datasets that read raw pixels
    per batch (CIFAR, ImageNet, shards, synthetic) augment before normalizing; others are wrapped.
    ConfigError if the crop does not fit the dataset's images (see check_crop).
    """
    aug = Augmentation(flip, flip_prob, crop, crop_padding, crop_size, crop_prob)
    if not (aug.flip or aug.crop):
        return dataset
    if hasattr(dataset, "with_augmentation"):
        return dataset.with_augmentation(aug)
    return AugmentedDataset(dataset, aug)
