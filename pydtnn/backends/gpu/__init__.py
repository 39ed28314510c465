"""GPU backend: CuPy arrays, cuDNN frontend graphs for convolution, CUDA kernels for pooling and dropout.

The Backend contract of backends/base.py: its generic operations run here on `cupy` (Dense is a
cuBLAS GEMM through CuPy's matmul, activations and BatchNorm are CuPy elementwise and reduction
kernels), and this class overrides the ones a GPU does its own way:

- convolution forward, data gradient and weight gradient: one cuDNN frontend graph per
  (operation, batch size, geometry), built on first use and cached (`ConvGraphs`);
- max and average pooling: CUDA kernels compiled once by CuPy, NCHW, one thread per output
  (forward) or per input element (backward: a gather, so results do not depend on thread order);
- dropout masks: a counter-based hash of (seed, element index), seeded from the host Generator,
  so masks are reproducible, cheap, and follow `reseed()` exactly as on the CPU;
- the SGD and Adam/AdamW updates: one CuPy elementwise kernel each, the math of base.py in one pass.

Why this stack: CuPy 14 no longer wraps cuDNN, and NVIDIA's cuDNN frontend Python package
(`nvidia-cudnn-frontend`) is the maintained way to reach cuDNN's graph API; pycuda needs a full CUDA
toolkit to build and scikit-cuda is unmaintained and fails on NumPy 2.

Initialization draws from the same host NumPy Generator as the CPU backend, so a model built with
the same seed starts from the same weights on either device.

Nothing here is imported by `import pydtnn` or by the CPU path: `get_backend("gpu")` imports it, and
CuPy and cuDNN only when a backend is made.

    backend.py      GPUBackend: the contract's operations on CuPy, cuDNN and the kernels below
    conv_graphs.py  ConvGraphs: the cuDNN frontend graphs of a backend's convolutions
    kernels.py      CUDA sources (pooling, dropout masks) and the elementwise SGD/Adam update kernels
    device.py       what is installed and visible (gpu_status), the CUDA libraries the cuDNN frontend
                    needs (load_cuda_libraries), and which GPU a rank takes
    transfers.py    host-to-device copies that never wait for the GPU (batches on a copy stream)
"""

from pydtnn.backends.gpu.backend import GPUBackend
from pydtnn.backends.gpu.device import gpu_status

__all__ = ["GPUBackend", "gpu_status"]
