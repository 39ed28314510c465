"""Datasets by name: `load(name, train_path, test_path)` -> (train, test); `fetch(name)` downloads.

    mnist5k          the embedded 5,000 MNIST digits (no files needed)
    mnist            MNIST IDX files, gzipped or not
    fashion_mnist    Fashion-MNIST IDX files, gzipped or not
    cifar10          CIFAR-10 binary version (data_batch_1..5.bin, test_batch.bin)
    cifar100         CIFAR-100 binary version (train.bin, test.bin; fine labels)
    imagenet         ImageNet as train/<class>/*.JPEG + val/<class>/*.JPEG, or .npy shards
    synthetic        generated images, any shape and number of classes (options below)

docs/datasets.md gives each layout, where to get the files and the normalization.
"""

import inspect
import os

import numpy as np

from pydtnn.data import cifar, imagenet, synthetic
from pydtnn.data.dataset import ArrayDataset
from pydtnn.data.download import cache_dir, download, extract_tar
from pydtnn.data.idx import read_idx
from pydtnn.data.streamed import check_float_pixels, check_labels, check_pixel_dtype
from pydtnn.errors import ConfigError, DataError

EMBEDDED_DIR = os.path.join(os.path.dirname(__file__), "mnist5k")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_LAYOUT = f"the four MNIST IDX files ({', '.join(s for pair in IDX_FILES.values() for s in pair)}), gzipped or not"


def _find(directory, stem):
    for name in (stem + ".gz", stem):
        path = os.path.join(directory, name)
        if os.path.lexists(path):  # anything there, so that read_idx can say what is wrong with it
            return path
    raise DataError(f"{directory}: no {stem}[.gz]; expected {IDX_LAYOUT}")


def load_idx_split(directory, split, name):
    """ArrayDataset of one split ('train' or 't10k' files) of an MNIST-layout IDX directory.

    Images are uint8 (scaled by 1/255) or float in [0, 1] (used as they are); anything else is refused.
    """
    img_path, lbl_path = (_find(directory, stem) for stem in IDX_FILES[split])
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"{img_path}, {lbl_path}: images {images.shape} and labels {labels.shape}; "
                        f"expected (N, H, W) and (N,) with the same N")
    if len(images) == 0:
        raise DataError(f"{img_path} has 0 samples (an IDX array of shape {images.shape}); expected at least 1 image")
    if images[0].size == 0:
        raise DataError(f"{img_path}: images of shape {images.shape[1:]}; expected at least 1 pixel")
    check_pixel_dtype(images.dtype, img_path)
    if images.dtype.kind == "f":
        check_float_pixels(images, img_path)
    labels = check_labels(labels, 10, lbl_path)
    scale = 1 / 255 if images.dtype == np.uint8 else 1.0
    return ArrayDataset(images[:, None], labels, 10, scale=scale, name=f"{name}/{split}")


def load_mnist_like(name, train_path=None, test_path=None, default_dir=None):
    train_dir = train_path or default_dir
    if train_dir is None:
        raise ConfigError(f"dataset {name} needs --dataset_train_path DIR holding {IDX_LAYOUT} "
                          f"(or pydtnn.data.fetch({name!r}) to download them)")
    return load_idx_split(train_dir, "train", name), load_idx_split(test_path or train_dir, "test", name)


def load_synthetic(train_path=None, test_path=None, input_shape=(3, 32, 32), num_classes=10, train_size=10000,
                   test_size=2000, seed=0):
    """Synthetic (train, test); the paths are ignored (nothing is read)."""
    return synthetic.load_synthetic(input_shape, num_classes, train_size, test_size, seed)


# name -> loader(train_path, test_path, **options) returning (train, test)
LOADERS = {
    "mnist5k": lambda train_path=None, test_path=None: load_mnist_like("mnist5k", train_path, test_path,
                                                                       EMBEDDED_DIR),
    "mnist": lambda train_path=None, test_path=None: load_mnist_like("mnist", train_path, test_path),
    "fashion_mnist": lambda train_path=None, test_path=None: load_mnist_like("fashion_mnist", train_path, test_path),
    "cifar10": lambda train_path=None, test_path=None: cifar.load_cifar("cifar10", train_path, test_path),
    "cifar100": lambda train_path=None, test_path=None: cifar.load_cifar("cifar100", train_path, test_path),
    "imagenet": imagenet.load_imagenet,
    "synthetic": load_synthetic,
}
NAMES = tuple(LOADERS)

# Published files. SHA-256 and sizes as recorded by TensorFlow Datasets (tensorflow/datasets,
# tensorflow_datasets/url_checksums/{mnist,fashion_mnist,cifar10,cifar100}.txt); the MNIST mirrors
# serve byte-identical copies of yann.lecun.com's files (same sizes, same MD5s as torchvision's).
_MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/",
                  "https://storage.googleapis.com/cvdf-datasets/mnist/",
                  "http://yann.lecun.com/exdb/mnist/")
_FASHION = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
_KRIZ = ("https://www.cs.toronto.edu/~kriz/",)
# name -> [(mirrors, file name, bytes, SHA-256)]
REMOTE = {
    "mnist": [
        (_MNIST_MIRRORS, "train-images-idx3-ubyte.gz", 9912422,
         "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
        (_MNIST_MIRRORS, "train-labels-idx1-ubyte.gz", 28881,
         "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
        (_MNIST_MIRRORS, "t10k-images-idx3-ubyte.gz", 1648877,
         "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
        (_MNIST_MIRRORS, "t10k-labels-idx1-ubyte.gz", 4542,
         "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
    ],
    "fashion_mnist": [
        (_FASHION, "train-images-idx3-ubyte.gz", 26421880,
         "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
        (_FASHION, "train-labels-idx1-ubyte.gz", 29515,
         "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
        (_FASHION, "t10k-images-idx3-ubyte.gz", 4422102,
         "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
        (_FASHION, "t10k-labels-idx1-ubyte.gz", 5148,
         "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
    ],
    "cifar10": [
        (_KRIZ, "cifar-10-binary.tar.gz", 170052171,
         "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd"),
    ],
    "cifar100": [
        (_KRIZ, "cifar-100-binary.tar.gz", 168513733,
         "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec"),
    ],
}


def _layout(name):
    return cifar.layout(name) if name in cifar.LAYOUTS else IDX_LAYOUT


def fetch(name, root=None, progress=True):
    """Directory holding dataset `name`'s files, downloaded (and extracted) into root/name first if
    needed; root defaults to cache_dir(). Pass the result as train_path to `load`."""
    if name not in REMOTE:
        raise ConfigError(f"dataset {name!r} cannot be downloaded; downloadable: {', '.join(REMOTE)}")
    dest = os.path.join(root or cache_dir(), name)
    files = [f for _, f, _, _ in REMOTE[name]]
    hint = (f"put {', '.join(files)} into {dest} by hand, or pass --dataset_train_path DIR holding {_layout(name)}")
    paths = [download([m + f for m in mirrors], dest, sha, f, size, hint, progress)
             for mirrors, f, size, sha in REMOTE[name]]
    if name in cifar.LAYOUTS:
        folder = os.path.join(dest, cifar.LAYOUTS[name]["folder"])
        if not os.path.isdir(folder):
            extract_tar(paths[0], dest)
        return folder
    return dest


def load(name, train_path=None, test_path=None, download=False, **options):
    """(train, test) datasets by name; see NAMES and docs/datasets.md.

    download: with no train_path, fetch the published files into the cache first (mnist,
    fashion_mnist, cifar10, cifar100). options: loader options, e.g. for synthetic input_shape,
    num_classes, train_size, test_size, seed; for imagenet size, resize.
    """
    if name not in LOADERS:
        raise ConfigError(f"unknown dataset {name!r}; expected one of {', '.join(NAMES)}")
    loader = LOADERS[name]
    accepted = [k for k in inspect.signature(loader).parameters if k not in ("train_path", "test_path")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"dataset {name!r} has no option {', '.join(unknown)}; "
                          f"it takes {', '.join(accepted) or 'no options'}")
    if download and train_path is None and name in REMOTE:
        train_path = fetch(name)
    train, test = loader(train_path, test_path, **options)
    check_pair(name, train, test, train_path, test_path or train_path)
    return train, test


def check_pair(name, train, test, train_path, test_path):
    """DataError unless train and test (None: no test set) are non-empty and agree in sample shape and
    classes: a mismatch would otherwise train, checkpoint, then fail in the final evaluation."""
    where = {"training": train_path, "test": test_path}
    for split, ds in (("training", train), ("test", test)):
        if ds is not None and len(ds) == 0:
            raise DataError(f"{name}: the {split} set ({where[split] or 'built in'}) has 0 samples; "
                            f"expected at least 1")
    if test is None:
        return
    (a, m), (b, n) = (tuple(train.input_shape), train.num_classes), (tuple(test.input_shape), test.num_classes)
    if (a, m) != (b, n):
        raise DataError(f"{name}: training images {a} in {m} classes ({train_path or 'built in'}) but test images "
                        f"{b} in {n} classes ({test_path or 'built in'}); expected the same shape and classes")
