"""pydtnn: training deep neural networks on one machine or a cluster, with NumPy/CuPy and MPI."""

from setuptools import find_packages, setup

setup(
    name="pydtnn",
    version="0.1.0",
    description="Research library for (distributed) deep neural network training with NumPy and MPI",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    packages=find_packages(include=["pydtnn", "pydtnn.*"]),
    package_data={"pydtnn.data": ["mnist5k/*"]},
    install_requires=[
        "numpy>=1.24",
        "numba>=0.61",  # compiled CPU kernels (pydtnn/backends/cpu/kernels/); the NumPy path works without it
        "tqdm>=4.60",
        "safetensors>=0.4",
        "pyyaml>=6",
        "Pillow>=9.1",
        "matplotlib>=3.5",
        "threadpoolctl>=3",
    ],
    extras_require={
        "test": ["pytest>=7", "torch==2.13.0", "mpi4py>=4", "mpich", "onnx>=1.15", "onnxruntime>=1.17",
                 "cuda-pathfinder>=1.3.4"],  # the GPU backend's library discovery, tested without a GPU
        # data-parallel runs under mpirun/mpiexec; use your cluster's MPI instead of the mpich wheel if it has one
        "mpi": ["mpi4py>=4", "mpich"],
        # GPU backend (--enable_gpu): CuPy, cuDNN and its frontend, NCCL (--enable_nccl)
        # (cuda-pathfinder finds libcudart, libcublasLt and libcudnn for the cuDNN frontend; CuPy links the CUDA
        # runtime statically, so the runtime itself comes from CUDA wheels: [ctk], or nvidia-cuda-runtime-cu12)
        "gpu": ["cupy-cuda12x>=13", "nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12", "nvidia-cudnn-cu12>=9",
                "nvidia-cudnn-frontend>=1.10", "nvidia-nccl-cu12", "cuda-pathfinder>=1.3.4"],
        "gpu-cuda13": ["cupy-cuda13x[ctk]>=14", "nvidia-cudnn-cu13>=9", "nvidia-cudnn-frontend>=1.10",
                       "nvidia-nccl-cu13", "cuda-pathfinder>=1.3.4"],
        # ONNX export (pydtnn-export, pydtnn.export.to_onnx)
        "onnx": ["onnx>=1.15"],
    },
    entry_points={"console_scripts": ["pydtnn-train=pydtnn.cli:main", "pydtnn-plot=pydtnn.plot:main",
                                        "pydtnn-export=pydtnn.export:main",
                                        "pydtnn-generate=pydtnn.generate:main",
                                        "pydtnn-perfmodel=pydtnn.perfmodel.cli:main"]},
    classifiers=["Programming Language :: Python :: 3"],
)
