"""CIFAR-10 and CIFAR-100, binary versions (cifar-10-binary.tar.gz, cifar-100-binary.tar.gz).

A file is a sequence of records: the label byte(s), then 3072 pixel bytes: the red, green and blue
planes of a 32x32 image, each row-major. CIFAR-10 records have 1 label byte; CIFAR-100 records have
the coarse then the fine label byte (we use the fine label, 100 classes). Files are memory-mapped,
so only the batches being read are in memory. The pickled "python version" is never read.
"""

import os

import numpy as np

from pydtnn.data.folder import require_folder
from pydtnn.data.streamed import ShardedArrayDataset, check_dataset_labels
from pydtnn.errors import ConfigError, DataError
from pydtnn.files import open_regular

PIXELS = 3 * 32 * 32

# Per-channel mean and std of the training images in [0, 1] (the usual constants).
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)

LAYOUTS = {
    "cifar10": dict(
        folder="cifar-10-batches-bin", train=[f"data_batch_{i}.bin" for i in range(1, 6)], test=["test_batch.bin"],
        label_bytes=1, label_at=0, num_classes=10, mean=CIFAR10_MEAN, std=CIFAR10_STD,
        archive="cifar-10-binary.tar.gz",
    ),
    "cifar100": dict(
        folder="cifar-100-binary", train=["train.bin"], test=["test.bin"],
        label_bytes=2, label_at=1, num_classes=100, mean=CIFAR100_MEAN, std=CIFAR100_STD,
        archive="cifar-100-binary.tar.gz",
    ),
}


def layout(name):
    """One-line description of the expected files of `name` ('cifar10' or 'cifar100')."""
    spec = LAYOUTS[name]
    files = spec["train"] + spec["test"]
    listed = f"{files[0]}..{files[-2]}, {files[-1]}" if len(files) > 3 else ", ".join(files)
    per = "1 label byte" if spec["label_bytes"] == 1 else "coarse and fine label bytes"
    return (f"{spec['folder']}/ as extracted from {spec['archive']} (or its files directly): {listed}, "
            f"records of {per} + 3072 pixel bytes")


def read_records(path, label_bytes=1, label_at=0, num_classes=10):
    """(images, labels) of one CIFAR binary file: images a read-only memory map (N, 3, 32, 32) uint8,
    labels int64 (N,) from byte `label_at` of each record."""
    path = os.fspath(path)
    record = label_bytes + PIXELS
    per_record = f"{label_bytes} label byte{'s' if label_bytes > 1 else ''} + {PIXELS} pixel bytes per record"
    try:
        f = open_regular(path, "CIFAR file", DataError)
    except FileNotFoundError:
        raise DataError(f"cannot read CIFAR file {path}: no such file") from None
    with f:  # the map keeps its own reference to the file
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise DataError(f"{path} has 0 samples (wrong length 0 bytes); expected records of {per_record}")
        if size % record:
            raise DataError(f"{path}: wrong length {size} bytes; expected a positive multiple of {record} "
                            f"({per_record})")
        try:
            mm = np.memmap(f, np.uint8, mode="r", shape=(size // record, record))
        except OSError as e:
            raise DataError(f"cannot read CIFAR file {path}: {e.strerror or e}") from None
    labels = check_dataset_labels(np.array(mm[:, label_at]), num_classes, path)
    return mm[:, label_bytes:].reshape(-1, 3, 32, 32), labels


def find_dir(path, name, first_file):
    """The directory under `path` (itself or its extracted folder) that holds `first_file`."""
    spec = LAYOUTS[name]
    for candidate in (path, os.path.join(path, spec["folder"])):
        if os.path.lexists(os.path.join(candidate, first_file)):  # read_records says what is wrong with it
            return candidate
    raise DataError(f"{path}: no {first_file}; expected {layout(name)}")


def load_split(directory, name, split):
    """ShardedArrayDataset of split 'train' or 'test' of CIFAR `name` from `directory`."""
    spec = LAYOUTS[name]
    files = [os.path.join(directory, f) for f in spec[split]]
    for f in files:
        if not os.path.lexists(f):
            raise DataError(f"{directory}: no {os.path.basename(f)}; expected {layout(name)}")
    parts = [read_records(f, spec["label_bytes"], spec["label_at"], spec["num_classes"]) for f in files]
    return ShardedArrayDataset([p[0] for p in parts], np.concatenate([p[1] for p in parts]), spec["num_classes"],
                               files, f"{name}/{split}", scale=1 / 255, mean=spec["mean"], std=spec["std"])


def load_cifar(name, train_path=None, test_path=None):
    """(train, test) of 'cifar10' or 'cifar100' from the binary files under train_path (test_path)."""
    if train_path is None:
        raise ConfigError(f"dataset {name} needs train_path=DIR holding {layout(name)} "
                          f"(or download=True to fetch it)")
    spec = LAYOUTS[name]
    train_path = os.fspath(train_path)
    _require_folder(train_path, "dataset folder", name, layout(name), spec["train"][0])
    train_dir = find_dir(train_path, name, spec["train"][0])
    if test_path:
        test_path = os.fspath(test_path)
        _require_folder(test_path, "dataset test folder", name,
                        f"{', '.join(spec['test'])} (or {spec['folder']}/ holding them)", spec["test"][0])
    test_dir = find_dir(test_path, name, spec["test"][0]) if test_path else train_dir
    return load_split(train_dir, name, "train"), load_split(test_dir, name, "test")


def _require_folder(path, role, name, expected, first):
    if path.endswith((".tar.gz", ".tgz", ".tar")) and os.path.isfile(path):  # the archive named instead of its folder
        raise DataError(f"{role} {path} is an archive, not a folder; extract it (tar xzf {path}) and pass the "
                        f"folder holding its {LAYOUTS[name]['folder']}/")
    require_folder(path, role, expected, first)
