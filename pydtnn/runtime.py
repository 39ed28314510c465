"""Process-wide settings, in one explicit call: `pydtnn.runtime.configure(...)`.

Making a backend, building a layer or importing pydtnn changes nothing outside itself. What must be
set for the whole process is set here, by the command line and the trainer (`ensure_configured`),
or by a user who drives layers and backends directly and wants the same speed:

- threads: how many threads the CPU backend splits each kernel over (backends/cpu/threads.py);
  default OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, else the cores this process may use. Until
  configure runs, kernels run unsplit on the calling thread.
- BLAS at one thread per caller: the backend's threads split the GEMMs themselves, and a BLAS with
  threads of its own keeps them spinning on the cores the next NumPy loop needs.
- glibc malloc keeps freed memory (keep_freed_memory): every step's activations and gradients reuse
  the last step's pages instead of faulting in fresh ones.
- GOMP_SPINCOUNT: how long Numba's OpenMP threads spin after a compiled kernel before they sleep.
- tf32 (GPU): False turns TF32 off in every CUDA library (NVIDIA_TF32_OVERRIDE=0); it must come
  before the first CUDA call of the process.
"""

import ctypes
import os
import warnings

# glibc malloc: blocks up to this size come from the heap (not a fresh mmap each time), and freed
# heap memory is kept up to KEEP_FREED_BYTES instead of being handed back to the system.
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit systems
KEEP_FREED_BYTES = 1 << 30

# After each parallel region libgomp's threads spin this many iterations before they sleep (its
# default, 300,000, is about 8 ms here): long enough to catch the next compiled kernel (waking a
# sleeping thread costs 1-1.5 ms on this VM), short enough to leave the core to the pool's thread
# for the NumPy and BLAS work in between (docs/performance.md). It takes effect only when set before
# Numba loads libgomp (the first compiled kernel split over threads).
GOMP_SPINCOUNT = "30000"

_applied = None  # what the last configure() set


def configure(threads=None, blas_threads=1, keep_freed_memory=True, gomp_spincount=GOMP_SPINCOUNT, tf32=None):
    """Set the process-wide settings; returns {setting: value applied} (see the module docstring).

    threads: CPU backend threads (None: OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, else the cores); at most
    4 per core this process may use, at least 64 (ConfigError above: threads.max_threads()).
    blas_threads: BLAS threads per caller (None leaves BLAS alone).
    keep_freed_memory: tune glibc malloc (skipped when MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
    is set, or the C library has no mallopt).
    gomp_spincount: set as GOMP_SPINCOUNT unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY (None: leave it).
    tf32: False sets NVIDIA_TF32_OVERRIDE=0, True removes an override this call set; None leaves it.
    """
    global _applied
    from pydtnn.backends.cpu import threads as cpu_threads

    n = cpu_threads.default_threads() if threads is None else int(threads)
    if n < 1:
        raise ValueError(f"runtime.configure: threads={threads!r}; expected a positive integer")
    cpu_threads.check_threads(n, "runtime.configure: threads")
    applied = {"threads": n}
    if blas_threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(blas_threads, user_api="blas")
        applied["blas_threads"] = blas_threads
    cpu_threads.set_threads(n)
    if keep_freed_memory:
        applied["keep_freed_memory"] = _keep_freed_memory()
    if gomp_spincount is not None and "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        if gomp_loaded():  # too late for this process; child processes (and a libgomp loaded later) still see it
            _warn_gomp_loaded(gomp_spincount, n)
        os.environ["GOMP_SPINCOUNT"] = str(gomp_spincount)
    applied["gomp_spincount"] = os.environ.get("GOMP_SPINCOUNT")
    if tf32 is False:
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    elif tf32 is True and (_applied or {}).get("tf32") is False:
        os.environ.pop("NVIDIA_TF32_OVERRIDE", None)
    if tf32 is not None:
        applied["tf32"] = tf32
    _applied = applied
    return dict(applied)


def gomp_loaded():
    """Whether a libgomp is mapped into this process already (it read its environment when it loaded)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return b"libgomp" in f.read()
    except OSError:  # not Linux: nothing to tell
        return False


def _warn_gomp_loaded(spincount, threads):
    """libgomp came in before configure (another library, such as torch, imported first): its threads keep
    spinning about 8 ms after each compiled kernel, on the cores the pool's threads need next. Measured on a
    1x1 convolution at two threads on a 2-core Intel Xeon VM with AVX-512: no faster than one (2.9 ms
    forward either way), against 1.9 ms when configure came first (docs/performance.md)."""
    if threads > 1:
        warnings.warn(f"pydtnn.runtime.configure: libgomp was loaded before GOMP_SPINCOUNT could be set (another "
                      f"library, such as torch, was imported first), so {threads} threads may run no faster than "
                      f"one; set GOMP_SPINCOUNT={spincount} in the environment, or call configure() before "
                      f"importing that library", RuntimeWarning, stacklevel=3)


def configured():
    """What the last configure() applied, or None when it has not run in this process."""
    return None if _applied is None else dict(_applied)


def ensure_configured():
    """configure() with its defaults, unless it has run already (the caller's choices stand)."""
    return configured() if _applied is not None else configure()


def _keep_freed_memory():
    """Make glibc's malloc reuse freed memory for the next step's activations and gradients.

    By default glibc serves each block over its dynamic threshold with a fresh mmap and returns
    freed memory at the top of the heap to the system, so every new array touches fresh pages: a
    ResNet-20 step at batch 64 took about 2,500 page faults on one thread and 4,400 on two (blocks
    freed by the pool's threads move the threshold less), each costing microseconds on a VM. With a
    fixed threshold and no trimming a step takes almost none (docs/performance.md). Returns whether set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)) and bool(mallopt(m_trim_threshold, KEEP_FREED_BYTES))
