"""Datasets by name: the embedded MNIST subset, and MNIST / Fashion-MNIST from IDX files.

Each loader returns (train, test) ArrayDatasets with pixels scaled to [0, 1].
"""

import os

from pydtnn.data.dataset import ArrayDataset
from pydtnn.data.idx import read_idx
from pydtnn.errors import ConfigError, DataError

EMBEDDED_DIR = os.path.join(os.path.dirname(__file__), "mnist5k")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _find(directory, stem):
    for name in (stem + ".gz", stem):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise DataError(
        f"{directory}: no {stem}[.gz]; expected the four MNIST IDX files "
        f"({', '.join(s for pair in IDX_FILES.values() for s in pair)}), gzipped or not"
    )


def load_idx_split(directory, split, name):
    """ArrayDataset of one split ('train' or 't10k' files) of an MNIST-layout IDX directory."""
    img_stem, lbl_stem = IDX_FILES[split]
    images, labels = read_idx(_find(directory, img_stem)), read_idx(_find(directory, lbl_stem))
    if images.ndim != 3 or labels.ndim != 1:
        raise DataError(f"{directory}: {split} images must be (N, H, W) and labels (N,), got {images.shape}, {labels.shape}")
    return ArrayDataset(images[:, None], labels, 10, scale=1 / 255, name=f"{name}/{split}")


def load_mnist_like(name, train_path=None, test_path=None, default_dir=None):
    train_dir = train_path or default_dir
    if train_dir is None:
        raise ConfigError(f"dataset {name} needs --dataset_train_path DIR holding its IDX files")
    return load_idx_split(train_dir, "train", name), load_idx_split(test_path or train_dir, "test", name)


LOADERS = {
    "mnist5k": lambda train_path=None, test_path=None: load_mnist_like("mnist5k", train_path, test_path, EMBEDDED_DIR),
    "mnist": lambda train_path=None, test_path=None: load_mnist_like("mnist", train_path, test_path),
    "fashion_mnist": lambda train_path=None, test_path=None: load_mnist_like("fashion_mnist", train_path, test_path),
}
NAMES = tuple(LOADERS)


def load(name, train_path=None, test_path=None):
    """(train, test) datasets by name; see NAMES."""
    if name not in LOADERS:
        raise ConfigError(f"unknown dataset {name!r}; expected one of {', '.join(NAMES)}")
    return LOADERS[name](train_path, test_path)
