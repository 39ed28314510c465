"""Threads for the CPU backend: a kernel's work split over the cores it was given.

NumPy's copies and element-wise loops run on one core, and release the GIL while they run, so a
kernel that splits its batch into one contiguous chunk per thread uses every core. The GEMMs are
split the same way, each chunk calling BLAS with one thread (pydtnn.runtime.configure limits BLAS
to one thread per caller): a BLAS with threads of its own would keep them spinning after each call,
on the cores the next NumPy loop needs (measured: with two threads a training step was no faster
than with one; docs/performance.md).
The compiled (Numba) kernels split the same way through `split_compiled`, but their chunks run on
Numba's own threads (its OpenMP layer where the system has libgomp): those wait spinning for about
a millisecond after each kernel (runtime.GOMP_SPINCOUNT), so the next kernel starts on both cores
within microseconds, where a hand-off to this module's pool costs about a hundred on this VM (its
thread must wake, then take the GIL).
Each chunk writes its own samples only and adds in the same order as the unsplit loop, so those
results are bit-identical whatever the thread count. The exceptions are GEMMs split over the
columns of their product (a convolution's dw, Dense): each chunk's GEMM rounds in its own
blocking, so they differ from the one-thread result in the last bits.

The thread count is process-wide, like the cores: `set_threads(n)`, which pydtnn.runtime.configure
calls (the trainer and the command line call that; under MPI one share of the cores per rank).
Until then kernels run unsplit, on the calling thread.
"""

import os
import threading

from pydtnn import env
from pydtnn.errors import ConfigError

_state = threading.local()  # marks pool threads, which must not split again
_threads = 1
_workers = []  # the pool: threads() - 1 _Worker, started on first use
_lock = threading.Lock()  # guards _threads and _workers
_busy = threading.Lock()  # held by the split that uses the pool; a concurrent split runs unsplit

BLAS_THREADS = 1  # threads BLAS may use inside one chunk: the pool, not BLAS, spreads work over the cores
# the most threads a count may ask for per core this process may use: more only contend for the same cores,
# and a count in the thousands starts more threads than the system lets a process have
THREADS_PER_CORE = 4
# ... but never fewer than this: oversubscribed settings that ran before (an OMP_NUM_THREADS=16 inherited by a
# process bound to 2 cores) still run; only counts that cannot (thousands of threads) are refused
MIN_THREADS_CAP = 64


def usable_cores():
    """The cores this process may use (its CPU affinity; all the machine's where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def max_threads():
    """(the largest thread count accepted, why): THREADS_PER_CORE x the cores this process may use, at least
    MIN_THREADS_CAP."""
    cores = usable_cores()
    return (max(THREADS_PER_CORE * cores, MIN_THREADS_CAP),
            f"{THREADS_PER_CORE} per core, and this process may use {cores}; never fewer than {MIN_THREADS_CAP}")


def check_threads(n, source):
    """n, or ConfigError naming `source` (the flag or argument it came from) when it is more threads than
    max_threads() accepts."""
    most, why = max_threads()
    if n > most:
        raise ConfigError(f"{source} {n}: more threads than this process can use; expected at most {most} ({why})")
    return n


def default_threads():
    """OMP_NUM_THREADS / OPENBLAS_NUM_THREADS (checked by pydtnn.env, at most max_threads()), else the cores
    this process may use."""
    asked = env.omp_threads(*max_threads())
    return usable_cores() if asked is None else asked


def threads():
    """Threads a split kernel uses now (1: no split)."""
    return _threads


def set_threads(n):
    """Use n threads (n >= 1) for split kernels from now on (process-wide; see pydtnn.runtime)."""
    global _threads
    with _busy, _lock:
        _threads = max(1, int(n))
        _stop_workers()


class _Worker:
    """A pool thread that runs one chunk at a time, handed over and back with two locks: a round
    trip costs a few tens of microseconds, where a ThreadPoolExecutor's futures cost about 150."""

    def __init__(self, i):
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task = self.error = None
        threading.Thread(target=self._run, name=f"pydtnn-cpu-{i}", daemon=True).start()

    def _run(self):
        _state.worker = True
        while True:
            self.go.acquire()
            if self.task is None:
                return
            fn, lo, hi = self.task
            try:
                fn(lo, hi)
            except BaseException as e:  # handed to the caller of split
                self.error = e
            self.done.release()

    def start(self, fn, lo, hi):
        self.task, self.error = (fn, lo, hi), None
        self.go.release()

    def join(self):
        """Wait for the chunk; its error, if it raised one."""
        self.done.acquire()
        return self.error

    def stop(self):
        self.task = None
        self.go.release()


def _stop_workers():
    for w in _workers:
        w.stop()
    _workers.clear()


def _forget_workers():  # in a forked child: the pool's threads were not copied
    global _busy, _lock
    _workers.clear()
    _busy, _lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _chunks(n, nbytes, min_bytes):
    """How many chunks a call over n items touching nbytes splits into (1: run it unsplit)."""
    if _threads == 1 or getattr(_state, "worker", False) or (nbytes is not None and nbytes < min_bytes):
        return 1
    return max(1, min(threads(), n))


def split(n, fn, nbytes=None, min_bytes=0):
    """fn(lo, hi) over [0, n) in contiguous chunks, one per thread, the first in the calling thread.

    nbytes: how much memory the whole call touches; calls under min_bytes (the backend's
    tuning.split_min_bytes: a hand-off costs 30-100 microseconds) run unsplit in the calling thread.
    """
    t = _chunks(n, nbytes, min_bytes)
    if t == 1 or not _busy.acquire(blocking=False):  # busy: another thread of the program splits now
        fn(0, n)
        return
    try:
        with _lock:
            while len(_workers) < threads() - 1:
                _workers.append(_Worker(len(_workers) + 1))
        bounds = [n * i // t for i in range(t + 1)]
        used = _workers[: t - 1]
        for i, w in enumerate(used, 1):
            w.start(fn, bounds[i], bounds[i + 1])
        try:
            fn(bounds[0], bounds[1])
        finally:
            errors = [w.join() for w in used]  # every chunk is over before the caller reads the buffers
        for e in errors:
            if e is not None:
                raise e
    finally:
        _busy.release()


def split_compiled(kernel, chunks, n, args, nbytes=None, min_bytes=0):
    """kernel(*args, lo, hi) over [0, n) in the chunks of split, for a compiled (Numba) kernel and its
    twin chunks(n, t, *args) (kernels/): the chunks run on Numba's threads, which take
    a chunk in microseconds where this module's pool, whose threads must wake and take the GIL,
    needs about a hundred."""
    t = _chunks(n, nbytes, min_bytes)
    if t == 1 or not _busy.acquire(blocking=False):
        kernel(*args, 0, n)
        return
    try:
        from pydtnn.backends.cpu.kernels.jit import launch

        launch(chunks, n, t, args)
    finally:
        _busy.release()
