#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the GPU tests, then training throughput against PyTorch.
#
#   bash benchmarks/gpu_check.sh              # results in $OUT (the device tool's folder) or ./gpu-results
#
# Wheels the machine lacks (nvidia-cudnn-frontend, mpich...) can be put in .whl/ beforehand; they are
# installed into /tmp/site first. Needs: python3 with CuPy, PyTorch + torchvision, pytest, and pydtnn's
# own dependencies (numpy, tqdm, safetensors, pyyaml, Pillow, matplotlib, threadpoolctl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
# the CUDA libraries of carried wheels (cuDNN, NCCL), where CuPy and the cuDNN frontend look for them
for lib in /tmp/site/nvidia/*/lib; do
    [ -d "$lib" ] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import cupy, cudnn, numpy, torch; print('cupy', cupy.__version__, 'cuDNN', cudnn.backend_version_string(), \
'cudnn-frontend', getattr(cudnn, '__version__', '?'), 'numpy', numpy.__version__, 'torch', torch.__version__)"
} 2>&1 | tee "$OUT/versions.txt"

# within the device tool's 10 minutes per command: tests at most 4 minutes, benchmarks at most 5
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}

timeout 300 python3 benchmarks/gpu_train.py --out "$OUT/gpu_train.md" --json "$OUT/gpu_train.json" 2>&1 \
    | tee "$OUT/gpu_train.log"
echo "gpu tests exit code: $tests"
exit "$tests"
