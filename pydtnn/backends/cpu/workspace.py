"""What every CPU algorithm is handed as `b`: the kernels ('numba' or 'numpy'), the Tuning, the scratch
pool and the thread split. A CPUBackend is one; autotune.measure times convolution algorithms on one of
its own, so that timing needs no backend."""

from pydtnn.backends.cpu import threads
from pydtnn.backends.cpu.scratch import ScratchPool


class Workspace:
    """kernels: 'numba' or 'numpy' (already resolved); tuning: a Tuning (tuning.py); a scratch pool of its own."""

    def __init__(self, kernels, tuning):
        self.kernels, self.tuning, self.pool = kernels, tuning, ScratchPool()

    def split(self, n, fn, nbytes=None):
        """fn(lo, hi) over [0, n) split over the threads (threads.split)."""
        threads.split(n, fn, nbytes, self.tuning.split_min_bytes)

    def split_compiled(self, kernel, chunks, n, args, nbytes=None):
        """A compiled kernel over [0, n) split over Numba's threads (threads.split_compiled)."""
        threads.split_compiled(kernel, chunks, n, args, nbytes, self.tuning.split_min_bytes)

    def gemm_bytes(self, flops, *arrays):
        """A GEMM's work in bytes for the split rule: its FLOPs over tuning.gemm_flops_per_byte plus its operands."""
        return flops // self.tuning.gemm_flops_per_byte + sum(a.nbytes for a in arrays)
