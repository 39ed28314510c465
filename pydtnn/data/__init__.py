"""Datasets, file formats and batch ordering."""

from pydtnn.data.dataset import ArrayDataset, batch_slices, epoch_order
from pydtnn.data.datasets import NAMES, load
from pydtnn.data.idx import read_idx, write_idx

__all__ = ["ArrayDataset", "batch_slices", "epoch_order", "load", "NAMES", "read_idx", "write_idx"]
