"""Datasets, file formats, downloads, augmentation, validation splits and batch ordering."""

from pydtnn.data.augment import (Augmentation, AugmentedDataset, center_crop, normalize, random_crop, random_flip,
                                 with_augmentation)
from pydtnn.data.cifar import load_cifar, read_records
from pydtnn.data.dataset import ArrayDataset, batch_slices, epoch_order
from pydtnn.data.datasets import (NAMES, REMOTE, TEXT, DatasetNotFound, download_size, fetch, load, locate,
                                  source_files, source_folders)
from pydtnn.data.download import cache_dir, download, extract_tar, sha256_file
from pydtnn.data.idx import read_idx, write_idx
from pydtnn.data.imagenet import ImageFolder, load_imagenet, load_shards
from pydtnn.data.split import resolve_validation, split_validation
from pydtnn.data.streamed import ShardedArrayDataset, StreamedDataset
from pydtnn.data.synthetic import SyntheticDataset, load_synthetic
from pydtnn.data.text import TextDataset, Tokenizer, load_text

__all__ = [
    "ArrayDataset", "batch_slices", "epoch_order", "load", "fetch", "locate", "download_size", "DatasetNotFound",
    "NAMES", "REMOTE", "TEXT", "TextDataset", "Tokenizer", "load_text", "source_files", "source_folders", "read_idx", "write_idx",
    "Augmentation", "AugmentedDataset", "with_augmentation", "random_crop", "random_flip", "center_crop", "normalize",
    "split_validation", "resolve_validation", "download", "cache_dir", "extract_tar", "sha256_file",
    "StreamedDataset", "ShardedArrayDataset", "ImageFolder", "SyntheticDataset",
    "load_cifar", "read_records", "load_imagenet", "load_shards", "load_synthetic",
]
