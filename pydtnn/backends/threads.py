"""Threads for the CPU backend's own loops: a kernel's batch split over the cores it was given.

Only BLAS uses several cores by itself; NumPy's copies and element-wise loops run on one. NumPy
releases the GIL inside those loops, so a kernel that splits its batch into one contiguous chunk
per thread (pooling and depthwise convolution, which use no BLAS) uses every core.
Each chunk writes its own samples only and adds in the same order as the unsplit loop, so results
are bit-identical whatever the thread count.

The thread count follows the BLAS one: `set_threads(n)` (called by
`pydtnn.distributed.launch.limit_blas_threads`, one per rank under MPI) or, until then,
OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, else the number of cores this process may use.
"""

import os
import threading
from concurrent.futures import wait

_state = threading.local()  # marks pool threads, which must not split again
_threads = None
_pool = None  # (executor, workers)
_lock = threading.Lock()

MIN_BYTES = 1 << 18  # below this a kernel runs unsplit: a hand-off costs tens of microseconds


def default_threads():
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads():
    """Threads a split kernel uses now (1: no split)."""
    global _threads
    if _threads is None:
        _threads = default_threads()
    return _threads


def set_threads(n):
    """Use n threads (n >= 1) for split kernels from now on."""
    global _threads, _pool
    with _lock:
        _threads = max(1, int(n))
        if _pool is not None and _pool[1] != _threads - 1:
            _pool[0].shutdown(wait=True)
            _pool = None


def _executor():
    global _pool
    with _lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            workers = threads() - 1
            _pool = (ThreadPoolExecutor(workers, thread_name_prefix="pydtnn-cpu", initializer=_mark), workers)
        return _pool[0]


def _mark():
    _state.worker = True


def split(n, fn, nbytes=None):
    """fn(lo, hi) over [0, n) in contiguous chunks, one per thread, the first in the calling thread.

    nbytes: how much memory the whole call touches; small calls run unsplit in the calling thread.
    """
    t = min(threads(), n)
    if t <= 1 or getattr(_state, "worker", False) or (nbytes is not None and nbytes < MIN_BYTES):
        fn(0, n)
        return
    bounds = [n * i // t for i in range(t + 1)]
    pool = _executor()
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, t)]
    try:
        fn(bounds[0], bounds[1])
    finally:
        wait(futures)  # every chunk is over before the caller reads or reuses the buffers
    for f in futures:
        f.result()  # re-raises a chunk's error
