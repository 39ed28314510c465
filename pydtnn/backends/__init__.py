"""Backends: the array module, dtype, RNG and per-device kernels of one model.

`CPUBackend` (NumPy) is always available. A GPU backend is imported only when asked for, so
`import pydtnn` never imports CuPy.
"""

import numpy as np

from pydtnn.backends.cpu import ConvGeometry, CPUBackend
from pydtnn.errors import ConfigError

NAMES = ("cpu",)


def array_module(a):
    """numpy or cupy, whichever `a` belongs to, without importing cupy for NumPy arrays."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def get_backend(name="cpu", dtype="float32", seed=0):
    """Backend by name: 'cpu'."""
    if name == "cpu":
        return CPUBackend(dtype=dtype, seed=seed)
    raise ConfigError(f"unknown backend {name!r}; expected one of {', '.join(NAMES)}")


__all__ = ["array_module", "CPUBackend", "ConvGeometry", "get_backend", "NAMES"]
