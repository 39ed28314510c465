"""How the compiled kernels are compiled and launched.

Each kernel computes a range [lo, hi) of samples, channels or elements (its last two arguments); its
`*_chunks(n, t, ...)` twin runs [0, n) in the t chunks of threads.split on Numba's threads. (One
generic runner taking the kernel as an argument would not be cached: it compiled again, 1-2 s per
kernel, in every process.) Kernels are cached on disk by Numba (cache_dir).
"""

import os

import numba

from pydtnn.backends.cpu import isa

if isa.VECTOR_BITS != isa.native_bits():
    # kernels of a forced width (PYDTNN_VECTOR_BITS) are cached apart: Numba's cache does not see the width
    _base = numba.config.CACHE_DIR or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pydtnn")
    numba.config.CACHE_DIR = os.path.join(_base, f"kernels-vector{isa.VECTOR_BITS}")

jit = numba.njit(nogil=True, fastmath=True, error_model="numpy", cache=True)
# without fastmath's no-NaN and no-infinity assumptions, for kernels whose results depend on them
# (fastmath=False said outright: a function compiled without the option takes its caller's flags)
exact = numba.njit(nogil=True, fastmath=False, error_model="numpy", cache=True)
parallel = numba.njit(parallel=True, nogil=True, cache=True)
# reassociating (so sums over a row vectorize) but keeping infinities and NaN: for kernels whose inputs may hold
# -inf (masked attention scores) or a diverged NaN that must reach the loss
reassoc = numba.njit(nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"}, error_model="numpy", cache=True)

MODULES = ("col2im", "conv3x3", "convkxk", "depthwise3x3", "elementwise", "normalization", "pooling", "updates",
           "vectors", "winograd")


def cache_dir():
    """The folder where Numba caches these kernels, and whether it holds them already (else the first
    use compiles them, 10-30 s). Numba's own choice: next to the kernels when that folder is writable,
    else a per-user cache folder (so a read-only install works), or $NUMBA_CACHE_DIR when set; for a
    vector width forced by $PYDTNN_VECTOR_BITS other than the CPU's, a folder of that width's."""
    from numba.core.caching import CacheImpl

    for locator in CacheImpl._locator_classes:  # any function of this folder locates its kernels' cache
        found = locator.from_function(cache_dir, __file__)
        if found is not None:
            path = found.get_cache_path()
            held = os.path.isdir(path) and any(
                n.split(".")[0] in MODULES and n.endswith(".nbi") for n in os.listdir(path)
            )
            return path, held
    return None, False


def launch(chunks, n, t, args):
    """chunks(n, t, *args) on at most t of Numba's threads."""
    numba.set_num_threads(min(t, numba.config.NUMBA_NUM_THREADS))
    chunks(n, t, *args)
