"""What is installed and visible (gpu_status), the CUDA libraries the cuDNN frontend needs
(load_cuda_libraries), and which GPU a rank takes (local_rank)."""

import ctypes
import glob
import os
import sys

from pydtnn.errors import ConfigError

_INSTALL = "pip install -e '.[gpu-cuda13]' (CUDA 13) or '.[gpu]' (CUDA 12)"

# (cuda.pathfinder's name, the library, how to get it): what the cuDNN frontend needs in the process.
# CuPy links the CUDA runtime statically, so a CuPy-only process has no libcudart loaded; the frontend
# dlopens it by soname, and finds libcudnn only on LD_LIBRARY_PATH or in sysconfig's purelib.
CUDA_LIBRARIES = (
    ("cudart", "the CUDA runtime (libcudart.so.13 or .12)",
     "pip install 'cupy-cuda13x[ctk]' (CUDA 13) or nvidia-cuda-runtime-cu12 (CUDA 12), or put a CUDA toolkit's "
     "lib64 on LD_LIBRARY_PATH"),
    ("cublasLt", "cuBLASLt (libcublasLt.so.13 or .12)",
     "pip install 'cupy-cuda13x[ctk]' (CUDA 13) or nvidia-cublas-cu12 (CUDA 12), or put a CUDA toolkit's lib64 "
     "on LD_LIBRARY_PATH"),
    ("cudnn", "cuDNN 9 (libcudnn.so.9)",
     "pip install nvidia-cudnn-cu13 (CUDA 13) or nvidia-cudnn-cu12 (CUDA 12), or put cuDNN's lib folder on "
     "LD_LIBRARY_PATH"),
)
# the file names of each library in NVIDIA's wheels (nvidia/<package>/lib/), newest CUDA first
SONAMES = {"cudart": ("libcudart.so.13", "libcudart.so.12"), "cublasLt": ("libcublasLt.so.13", "libcublasLt.so.12"),
           "cudnn": ("libcudnn.so.9",)}


def gpu_status():
    """(number of visible GPUs, reason when none can be used): never raises."""
    try:
        import cupy
    except ImportError as e:
        return 0, f"CuPy is not installed ({e}); {_INSTALL}"
    except Exception as e:  # noqa: BLE001 (a broken CUDA installation fails at import in many ways)
        return 0, f"CuPy cannot be imported: {e}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 (cudaErrorInsufficientDriver, cudaErrorNoDevice, no libcuda...)
        return 0, f"no usable GPU: {e}"
    return count, ("" if count else "no GPU is visible (CUDA reports 0 devices)")


def require_cupy():
    count, reason = gpu_status()
    if not count:
        raise ConfigError(f"the GPU backend needs CuPy and a visible GPU; {reason}")
    import cupy

    return cupy


def load_cuda_libraries():
    """Load the CUDA runtime, cuBLASLt and cuDNN into this process, where the cuDNN frontend will find them;
    {name: path}. Raises ConfigError naming the first library missing and how to install it.

    Found by cuda.pathfinder (already loaded, then NVIDIA wheels on sys.path, conda, the dynamic linker,
    CUDNN_PATH/CUDA_HOME), except that a libcudnn.so.9 on LD_LIBRARY_PATH comes first, as the frontend
    itself prefers it: one cuDNN in the process, whichever looks for it. Where cuda.pathfinder fails (before
    1.7 it has no entry for cuDNN), NVIDIA's wheels on sys.path are searched directly (wheel_library).
    CUDNN_FRONTEND_CUDART_LIB_NAME is
    set to the runtime found (unless already set), so the frontend uses that one runtime.
    """
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:
        raise ConfigError(f"the GPU backend needs cuda-pathfinder to find the CUDA libraries ({e}); pip install "
                          f"cuda-pathfinder (CuPy 14 installs it; part of {_INSTALL})") from None
    found = {}
    for name, what, install in CUDA_LIBRARIES:
        if name == "cudnn":
            preferred = cudnn_on_ld_library_path()
            if preferred is not None:
                try:
                    ctypes.CDLL(preferred)
                except OSError as e:
                    raise ConfigError(f"the GPU backend cannot load {preferred} (found on LD_LIBRARY_PATH): {e}; "
                                      f"{install}") from None
        try:
            found[name] = load_nvidia_dynamic_lib(name).abs_path
        except Exception as e:  # noqa: BLE001 (DynamicLibNotFoundError; older releases raise others for cuDNN)
            path, error = wheel_library(name), e
            if path is not None:  # cuda.pathfinder before 1.7 has no entry for cuDNN: NVIDIA's wheel, directly
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    found[name] = path
                    continue
                except OSError as load_error:
                    error = load_error
            why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"the GPU backend needs {what}, which was not found or could not be loaded ({why}); "
                              f"{install}") from None
    if found.get("cudart"):
        os.environ.setdefault("CUDNN_FRONTEND_CUDART_LIB_NAME", found["cudart"])
    return found


def wheel_library(name):
    """The path of library `name` (a key of SONAMES) in an NVIDIA wheel on sys.path (nvidia/*/lib/), or None."""
    for folder in sys.path:
        for soname in SONAMES[name]:
            hits = sorted(glob.glob(os.path.join(folder or ".", "nvidia", "*", "lib", soname)))
            if hits:
                return hits[0]
    return None


def cudnn_on_ld_library_path():
    """The first libcudnn.so.9 (or libcudnn.so) in LD_LIBRARY_PATH's folders, as the frontend looks; or None."""
    for folder in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        for name in ("libcudnn.so.9", "libcudnn.so"):
            if folder and os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def require_cudnn():
    """The cuDNN frontend module, imported after load_cuda_libraries(); ConfigError if anything is missing."""
    load_cuda_libraries()
    try:
        import cudnn
    except ImportError as e:
        raise ConfigError(
            f"the GPU backend needs NVIDIA's cuDNN frontend ({e}); pip install nvidia-cudnn-frontend "
            f"(part of {_INSTALL})"
        ) from None
    return cudnn


def local_rank():
    """This process's rank among the processes of its node, from the launcher's environment (0 alone)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "PMI_LOCAL_RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0
