"""The environment variables pydtnn reads, each parsed and checked in one place.

An unset or empty variable means its default. A bad value is a user error (ConfigError: one line and
exit code 2 at the command line) naming the variable, its value and what was expected.

| variable | read by | values |
| --- | --- | --- |
| PYDTNN_CPU_KERNELS | backends/cpu/backend.py | auto (default: numba when installed), numba, numpy |
| PYDTNN_CONV_AUTOTUNE | run.py | default of --conv_autotune: 1/0 (true/false, yes/no, on/off); unset: true |
| PYDTNN_CUDA_AWARE_MPI | distributed/gpu_comm.py | 1/0 (true/false, yes/no, on/off); unset: ask the MPI library |
| PYDTNN_VECTOR_BITS | backends/cpu/isa.py | vector width of the compiled CPU kernels: 128, 256 or 512; unset: the CPU's |
| OMP_NUM_THREADS, OPENBLAS_NUM_THREADS | backends/cpu/threads.py | threads of the CPU backend, a positive integer (OpenMP's list "4,2": the first), at most 4 per core this process may use (at least 64) |

The launchers' variables (PMI_SIZE, OMPI_COMM_WORLD_RANK, ...) are read by distributed/launch.py, and
the data directory, PYDTNN_DATA (or the older PYDTNN_DATA_DIR), by data/download.py, which checks it
the same way.
"""

import os

from pydtnn.errors import ConfigError

CPU_KERNELS = ("auto", "numba", "numpy")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _get(name):
    """The variable's value without surrounding blanks; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(name, expected):
    return ConfigError(f"environment variable {name}={os.environ.get(name, '')}: expected {expected}")


def cpu_kernels():
    """PYDTNN_CPU_KERNELS: 'auto' (default), 'numba' or 'numpy' (any case)."""
    value = _get("PYDTNN_CPU_KERNELS")
    if value is None:
        return "auto"
    if value.lower() not in CPU_KERNELS:
        raise _bad("PYDTNN_CPU_KERNELS", f"one of {', '.join(CPU_KERNELS)}")
    return value.lower()


VECTOR_BITS = (128, 256, 512)


def vector_bits():
    """PYDTNN_VECTOR_BITS: 128, 256 or 512; None when unset (the kernels then use the CPU's width)."""
    value = _get("PYDTNN_VECTOR_BITS")
    if value is None:
        return None
    if value not in {str(b) for b in VECTOR_BITS}:
        raise _bad("PYDTNN_VECTOR_BITS", "128, 256 or 512 (or unset: the CPU's own width)")
    return int(value)


def conv_autotune():
    """PYDTNN_CONV_AUTOTUNE: whether a pydtnn-train run on the CPU measures its convolution algorithms
    when --conv_autotune is not given (default True)."""
    value = _flag("PYDTNN_CONV_AUTOTUNE")
    return True if value is None else value


def cuda_aware_mpi():
    """PYDTNN_CUDA_AWARE_MPI: True or False as set, None when unset (then the MPI library is asked)."""
    return _flag("PYDTNN_CUDA_AWARE_MPI")


def _flag(name):
    value = _get(name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _bad(name, "1 or 0 (true/false, yes/no, on/off)")


def omp_threads(most=None, why=""):
    """Threads asked for by OMP_NUM_THREADS, else OPENBLAS_NUM_THREADS; None when neither is set.

    OpenMP allows a list for nested levels ("4,2"): its first entry counts. most: the largest count
    accepted (None: any), and why, which the error gives as its reason.
    """
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = _get(name)
        if value is None:
            continue
        first = value.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise _bad(name, "a positive integer (the number of threads)")
        if most is not None and int(first) > most:
            raise _bad(name, f"at most {most} threads" + (f" ({why})" if why else ""))
        return int(first)
    return None
