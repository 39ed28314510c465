"""The CPU backend: NumPy, BLAS and compiled Numba kernels, split over the cores (backend.py is the
entry; tuning.py holds every tuning value, threads.py the thread split, kernels/ the compiled kernels)."""

from pydtnn.backends.cpu.backend import CPUBackend, resolve_kernels
from pydtnn.backends.cpu.tuning import Tuning

__all__ = ["CPUBackend", "Tuning", "resolve_kernels"]
