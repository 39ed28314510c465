"""Backends: the array module, dtype, RNG and per-device operations of one model.

base.py writes the contract (Backend) once, with generic implementations; `CPUBackend` (backends/cpu/,
NumPy + Numba) is always available. The GPU backend (gpu/, CuPy + cuDNN) is imported only when asked
for, so `import pydtnn` never imports CuPy.
"""

import numpy as np

from pydtnn.backends.base import Backend
from pydtnn.backends.cpu import CPUBackend
from pydtnn.backends.geometry import ConvGeometry
from pydtnn.errors import ConfigError

NAMES = ("cpu", "gpu")


def is_device_array(a):
    """Whether a is a CuPy array, without importing cupy."""
    return type(a).__module__.split(".")[0] == "cupy"


def array_module(a):
    """numpy or cupy, whichever `a` belongs to, without importing cupy for NumPy arrays."""
    if is_device_array(a):
        import cupy

        return cupy
    return np


def backend_for(a):
    """A backend for arrays like a, for code handed arrays without their model's backend (an optimizer
    built from bare parameters): a CPUBackend for NumPy arrays, the generic Backend over CuPy else."""
    if is_device_array(a):
        return Backend(array_module(a), a.dtype)
    return CPUBackend(a.dtype if a.dtype in (np.float32, np.float64) else np.float32)


def get_backend(name="cpu", dtype="float32", seed=0, **options):
    """Backend by name: 'cpu' (options: kernels, tuning; see backends/cpu), or 'gpu' (CuPy + cuDNN;
    options: device; see backends/gpu/)."""
    if name == "cpu":
        return CPUBackend(dtype=dtype, seed=seed, **options)
    if name == "gpu":
        from pydtnn.backends.gpu import GPUBackend

        return GPUBackend(dtype=dtype, seed=seed, **options)
    raise ConfigError(f"unknown backend {name!r}; expected one of {', '.join(NAMES)}")


__all__ = ["NAMES", "Backend", "CPUBackend", "ConvGeometry", "array_module", "backend_for", "get_backend",
           "is_device_array"]
