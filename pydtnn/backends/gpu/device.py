"""What is installed and visible (gpu_status), and which GPU a rank takes (local_rank)."""

import os

from pydtnn.errors import ConfigError

_INSTALL = "pip install -e '.[gpu-cuda13]' (CUDA 13) or '.[gpu]' (CUDA 12)"


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


def require_cudnn():
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
