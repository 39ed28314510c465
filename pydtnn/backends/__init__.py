"""Backends: the array module, dtype, RNG and per-device kernels of one model.

`CPUBackend` (NumPy) is always available. A GPU backend is imported only when asked for, so
`import pydtnn` never imports CuPy.
"""

import numpy as np

from pydtnn.backends.cpu import ConvGeometry, CPUBackend
from pydtnn.errors import ConfigError

NAMES = ("cpu", "gpu")


def array_module(a):
    """numpy or cupy, whichever `a` belongs to, without importing cupy for NumPy arrays."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def get_backend(name="cpu", dtype="float32", seed=0, **options):
    """Backend by name: 'cpu', or 'gpu' (CuPy + cuDNN; options: device, tf32; see backends/gpu.py)."""
    if name == "cpu":
        return CPUBackend(dtype=dtype, seed=seed)
    if name == "gpu":
        from pydtnn.backends.gpu import GPUBackend

        return GPUBackend(dtype=dtype, seed=seed, **options)
    raise ConfigError(f"unknown backend {name!r}; expected one of {', '.join(NAMES)}")


__all__ = ["NAMES", "CPUBackend", "ConvGeometry", "array_module", "get_backend"]
