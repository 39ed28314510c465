"""Datasets by name: `load(name, train_path, test_path, download)` -> (train, test).

With no train_path, a dataset with published files is read from where `fetch(name)` puts it in the
data directory (`locate(name)`), downloaded there first when download=True (--download).

    mnist5k          the embedded 5,000 MNIST digits (no files needed)
    mnist            MNIST IDX files, gzipped or not
    fashion_mnist    Fashion-MNIST IDX files, gzipped or not
    cifar10          CIFAR-10 binary version (data_batch_1..5.bin, test_batch.bin)
    cifar100         CIFAR-100 binary version (train.bin, test.bin; fine labels)
    imagenet         ImageNet as train/<class>/*.JPEG + val/<class>/*.JPEG, or .npy shards
    synthetic        generated images, any shape and number of classes (options below)
    text             next-token windows of a UTF-8 text file or folder (default: the fortunes package)
    tiny_shakespeare Karpathy's Tiny Shakespeare (1.1 MB), a text dataset fetched with download=True

docs/datasets.md gives each layout, where to get the files and the normalization.
"""

import inspect
import json
import os
import shutil
import tempfile

import numpy as np

from pydtnn.data import cifar, imagenet, synthetic, text
from pydtnn.data.dataset import ArrayDataset
from pydtnn.data.download import cache_dir, download, extract_tar, human_size, say, temp_file
from pydtnn.data.folder import require_folder
from pydtnn.data.idx import read_idx
from pydtnn.data.streamed import check_dataset_labels, check_float_pixels, check_pixel_dtype
from pydtnn.errors import ConfigError, DataError
from pydtnn.files import read_bytes
from pydtnn.suggest import did_you_mean

EMBEDDED_DIR = os.path.join(os.path.dirname(__file__), "mnist5k")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_LAYOUT = f"the four MNIST IDX files ({', '.join(s for pair in IDX_FILES.values() for s in pair)}), gzipped or not"
IDX_TEST_LAYOUT = f"{' and '.join(IDX_FILES['test'])}, gzipped or not"


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
    labels = check_dataset_labels(labels, 10, lbl_path)
    scale = 1 / 255 if images.dtype == np.uint8 else 1.0
    return ArrayDataset(images[:, None], labels, 10, scale=scale, name=f"{name}/{split}")


def load_mnist_like(name, train_path=None, test_path=None, default_dir=None):
    train_dir = train_path or default_dir
    if train_dir is None:
        raise ConfigError(f"dataset {name} needs train_path=DIR holding {IDX_LAYOUT} "
                          f"(or download=True to fetch them)")
    require_folder(train_dir, "dataset folder", IDX_LAYOUT, f"{IDX_FILES['train'][0]}[.gz]")
    if test_path:
        require_folder(test_path, "dataset test folder", IDX_TEST_LAYOUT, f"{IDX_FILES['test'][0]}[.gz]")
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
    "text": text.load_text,
    "tiny_shakespeare": lambda train_path=None, test_path=None, context_length=text.DEFAULT_CONTEXT, tokenizer="chars":
        text.load_text(_shakespeare_file(train_path), test_path, context_length, tokenizer, "tiny_shakespeare"),
}
TEXT = ("text", "tiny_shakespeare")  # token datasets: options context_length and tokenizer, no fixed sample shape
NAMES = tuple(LOADERS)
# (C, H, W) and classes of each dataset's images as its loader gives them (ImageNet: the evaluation view's
# centre crop), known without reading a file: what the performance model and the ONNX export build for.
# "synthetic" has none of its own (pydtnn-train generates it at the model's design shape).
SHAPES = {"mnist5k": ((1, 28, 28), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
          "cifar10": ((3, 32, 32), 10), "cifar100": ((3, 32, 32), 100), "imagenet": ((3, 224, 224), 1000)}

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
    "tiny_shakespeare": [  # SHA-256 and size as tensorflow_datasets/url_checksums/tiny_shakespeare.txt records them
        (("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/",), "input.txt", 1115394,
         "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
    ],
    "cifar100": [
        (_KRIZ, "cifar-100-binary.tar.gz", 168513733,
         "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec"),
    ],
}


MARKER = ".pydtnn-fetched.json"  # written by fetch() once every file is checked: the sizes locate() compares


class DatasetNotFound(DataError, ConfigError):
    """No path given and no fetched copy in the data directory (a DataError; a ConfigError for older callers)."""


def _layout(name):
    if name in TEXT:
        return "input.txt (UTF-8 text)" if name == "tiny_shakespeare" else "UTF-8 text"
    return cifar.layout(name) if name in cifar.LAYOUTS else IDX_LAYOUT


def _shakespeare_file(path):
    """Tiny Shakespeare's input.txt in a fetched folder, or the file given."""
    if path is not None and os.path.isdir(path) and os.path.isfile(os.path.join(path, "input.txt")):
        return os.path.join(path, "input.txt")
    return path


def _unknown(name):
    return ConfigError(f"unknown dataset {name!r}{did_you_mean(name, NAMES) or ';'} expected one of {', '.join(NAMES)}")


def _check_downloadable(name):
    if name not in LOADERS:
        raise _unknown(name)
    if name not in REMOTE:
        raise ConfigError(f"dataset {name!r} cannot be downloaded; downloadable: {', '.join(REMOTE)}; "
                          f"pass train_path=DIR instead")


def _folder(name, dest):
    """The folder under dest = root/name that the loader reads: dest itself, or a CIFAR archive's folder."""
    return os.path.join(dest, cifar.LAYOUTS[name]["folder"]) if name in cifar.LAYOUTS else dest


def _read_files(name, folder):
    """Names (relative to folder) of the files the loader of `name` reads."""
    if name in cifar.LAYOUTS:
        return cifar.LAYOUTS[name]["train"] + cifar.LAYOUTS[name]["test"]
    return [f for _, f, _, _ in REMOTE[name]]


def fetch(name, root=None, progress=True):
    """Directory holding dataset `name`'s files, downloaded (and extracted) into root/name first if
    needed; root defaults to cache_dir(). Every file is checked (size, SHA-256), including those
    already there; then a marker records the sizes, so that `locate` finds the copy without hashing
    it again. Pass the result as train_path to `load` (or call `load(name, download=True)`)."""
    _check_downloadable(name)
    dest = os.path.join(os.fspath(root) if root else cache_dir(), name)
    try:
        return _fetch_into(name, dest, progress)
    except DataError:
        raise
    except OSError as e:  # a data folder that exists but cannot be written (a shared $PYDTNN_DATA)
        where = e.filename or dest
        raise DataError(f"cannot write dataset {name} into {dest} ({where}: {e.strerror or e}); expected a "
                        f"writable folder: set PYDTNN_DATA to another") from None


def _fetch_into(name, dest, progress):
    files = [f for _, f, _, _ in REMOTE[name]]
    hint = (f"put {', '.join(files)} into {dest} by hand, or pass train_path=DIR holding {_layout(name)}")
    paths = [download([m + f for m in mirrors], dest, sha, f, size, hint, progress)
             for mirrors, f, size, sha in REMOTE[name]]
    folder = _folder(name, dest)
    if name in cifar.LAYOUTS:
        problem = _marker_problem(name, dest, folder)
        # No marker but every file there: extracted by an older version, or by another process just now
        # (extract_tar renames the folder into place whole); kept. A file missing or changed since the
        # marker was written: extracted again.
        if problem is not None and (problem != "not fetched" or _missing(name, dest, folder)):
            if progress:
                say(f"extracting {paths[0]}")
            _extract_replacing(paths[0], dest, folder)
    _write_marker(name, dest, folder)
    return folder


def _extract_replacing(archive, dest, folder):
    """Extract archive into a temporary folder, then swap its copy of `folder` for the one there.

    Renames only, so a process reading or extracting the same dataset at the same time sees a whole
    folder, old or new, never a half-deleted one."""
    tmp = tempfile.mkdtemp(prefix=".extract.", dir=dest)
    try:
        extract_tar(archive, tmp)
        new = os.path.join(tmp, os.path.basename(folder))
        if not os.path.isdir(new):
            return  # _write_marker names what the archive lacks
        try:
            os.rename(folder, os.path.join(tmp, ".old"))
        except FileNotFoundError:
            pass  # none there, or another process moved it first
        try:
            os.rename(new, folder)
        except OSError:
            if not os.path.isdir(folder):  # else another process put a complete copy in first: kept
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _missing(name, dest, folder):
    """'no <file>' for the first file the loader of `name` reads that is not in folder, else None."""
    for f in _read_files(name, folder):
        if not os.path.isfile(os.path.join(folder, f)):
            return f"no {os.path.relpath(os.path.join(folder, f), dest)}"
    return None


def _write_marker(name, dest, folder):
    sizes = {}
    for f in _read_files(name, folder):
        path = os.path.join(folder, f)
        if not os.path.isfile(path):
            archive = cifar.LAYOUTS[name]["archive"] if name in cifar.LAYOUTS else f
            raise DataError(f"{os.path.join(dest, archive)} holds no {os.path.relpath(path, dest)}; "
                            f"expected {_layout(name)}")
        sizes[f] = os.path.getsize(path)
    fd, tmp = temp_file(folder, f"{MARKER}.")  # a name of its own: other processes may write one too
    try:
        with os.fdopen(fd, "w") as out:
            json.dump({"dataset": name, "files": sizes}, out, indent=1)
        os.replace(tmp, os.path.join(folder, MARKER))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _marker_problem(name, dest, folder):
    """None if folder's marker lists files that all have their recorded sizes, else what is wrong.

    The marker lies in the folder the loader reads (dest, or the extracted CIFAR folder, so that it
    goes when that folder is deleted or extracted again)."""
    path = os.path.join(folder, MARKER)
    if not os.path.lexists(path):
        return "not fetched"
    try:
        files = json.loads(read_bytes(path, "marker", 1 << 20, DataError))["files"]
        recorded = [(os.path.join(folder, f), int(files[f])) for f in _read_files(name, folder)]
    except (DataError, OSError, ValueError, TypeError, KeyError, AttributeError):
        return f"unreadable {os.path.relpath(path, dest)}"
    for f, n in recorded:
        got = os.path.getsize(f) if os.path.isfile(f) else None
        if got != n:
            rel = os.path.relpath(f, dest)
            return f"no {rel} (fetched with {n} bytes)" if got is None else f"{rel}: {got} bytes, {n} when fetched"
    return None


def _fetched_copy(name, root):
    """(folder, None) if root/name holds a complete fetched copy of `name`, else (None, what is missing).

    Complete: the sizes in the marker fetch() wrote all match; with no marker (a copy fetched by an
    older version), the downloaded files at their published sizes and, for CIFAR, the extracted files.
    Sizes only: hashing 170 MB on every run would cost seconds; fetch() checked the SHA-256.
    """
    dest = os.path.join(root, name)
    folder = _folder(name, dest)
    problem = _marker_problem(name, dest, folder)
    if problem is None:
        return folder, None
    if problem != "not fetched":
        return None, problem
    for _, f, size, _ in REMOTE[name]:
        path = os.path.join(dest, f)
        got = os.path.getsize(path) if os.path.isfile(path) else None
        if got is None:
            return None, f"no {f}"
        if size is not None and got != size:
            return None, f"{f}: {got} bytes, expected {size}"
    missing = _missing(name, dest, folder)
    return (None, missing) if missing else (folder, None)


def locate(name, root=None):
    """Folder holding a complete fetched copy of dataset `name` (what fetch() returns), or None.

    root: the data directory (default cache_dir(); ConfigError if $PYDTNN_DATA names a file). None
    as well for datasets that are never downloaded (imagenet, synthetic, the embedded mnist5k).
    Only file sizes are checked, so it is cheap enough for every run.
    """
    if name not in LOADERS:
        raise _unknown(name)
    if name not in REMOTE:
        return None
    return _fetched_copy(name, os.fspath(root) if root else cache_dir())[0]


def source_folders(name, train_path=None, test_path=None):
    """The folders dataset `name` is read from (given, fetched, or embedded), without loading it: what a
    command must not write into. Folders that do not exist are left out."""
    if name not in LOADERS:
        raise _unknown(name)
    found = [train_path, test_path]
    if train_path is None:
        found.append(EMBEDDED_DIR if name == "mnist5k" else text.FORTUNES if name == "text" else None)
        if name in REMOTE:
            try:
                found.append(locate(name))
            except ConfigError:  # a $PYDTNN_DATA that is no folder: load() says so
                pass
    return [os.fspath(f) for f in found if f is not None and os.path.isdir(f)]


def source_files(name, train_path=None, test_path=None):
    """([files], [folders]) dataset `name` reads, named without reading any (what a command must not
    write over): its IDX, CIFAR or ImageNet shard files where they would be looked for, and ImageNet's
    image folders (train/, val/), whose files it reads as it goes. Paths that do not exist are kept:
    comparing them costs nothing."""
    dirs = source_folders(name, train_path, test_path)
    test_dirs = [os.fspath(test_path)] if test_path else dirs
    files, folders = [], []
    if name in ("mnist5k", "mnist", "fashion_mnist"):
        for split, where in (("train", dirs[:1]), ("test", test_dirs[:1])):
            files += [os.path.join(d, stem + gz) for d in where for stem in IDX_FILES[split] for gz in ("", ".gz")]
    elif name in cifar.LAYOUTS:
        spec = cifar.LAYOUTS[name]
        for split, where in (("train", dirs[:1]), ("test", test_dirs[:1])):
            for d in where:  # the files, directly or in the archive's folder
                files += [os.path.join(base, f) for base in (d, os.path.join(d, spec["folder"])) for f in spec[split]]
    elif name in TEXT:  # a file given, or every file of the folders read
        files += [os.fspath(p) for p in (train_path, test_path) if p and not os.path.isdir(p)]
        folders += dirs
    elif name == "imagenet":
        for d in {*dirs, *test_dirs}:
            files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".npy")]
            folders += [os.path.join(d, sub) for sub in ("train", "val") if os.path.isdir(os.path.join(d, sub))]
        folders += [os.fspath(test_path)] if test_path and os.path.isdir(test_path) else []
    return files, folders


def download_size(name):
    """Bytes to download for dataset `name` (None if a size is not known); ConfigError if it has none."""
    _check_downloadable(name)
    sizes = [size for _, _, size, _ in REMOTE[name]]
    return None if None in sizes else sum(sizes)


def _not_found(name, root):
    dest = os.path.join(root, name)
    _, problem = _fetched_copy(name, root)
    where = f"is not in {dest}" if not os.path.isdir(dest) else f"in {dest} is incomplete ({problem})"
    size = download_size(name)
    return DatasetNotFound(f"dataset {name} {where}; pass download=True to fetch it"
                           f"{f' ({human_size(size)})' if size else ''}, or train_path=DIR holding "
                           f"{_layout(name)}")


def load(name, train_path=None, test_path=None, download=False, **options):
    """(train, test) datasets by name; see NAMES and docs/datasets.md.

    With no train_path, a downloadable dataset (REMOTE: mnist, fashion_mnist, cifar10, cifar100) is
    read from the copy fetch() made in the data directory (found by `locate`); if there is none,
    download=True fetches it (verified) first, and download=False raises DatasetNotFound saying how
    to get it. test_path: where the test files are, when not with the training files.
    options: loader options, e.g. for synthetic input_shape, num_classes, train_size, test_size,
    seed; for imagenet size, resize.
    """
    if name not in LOADERS:
        raise _unknown(name)
    loader = LOADERS[name]
    accepted = [k for k in inspect.signature(loader).parameters if k not in ("train_path", "test_path")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hint = did_you_mean(unknown[0], accepted) if len(unknown) == 1 else ""
        raise ConfigError(f"dataset {name!r} has no option {', '.join(unknown)}{hint or ';'} "
                          f"it takes {', '.join(accepted) or 'no options'}")
    if train_path is None and name in REMOTE:
        root = cache_dir()
        train_path = locate(name, root)
        if train_path is None:
            if not download:
                raise _not_found(name, root)
            train_path = fetch(name, root)
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
