#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the GPU tests, then training throughput against PyTorch.
#
#   bash benchmarks/gpu_check.sh [all|tests,nccl,loader,profile,bench]   # results in $OUT (the device tool's folder)
#                                                                        # or ./gpu-results
# tests: tests/test_gpu.py (with two processes on the GPU where an mpiexec is found). nccl: what NCCL itself
# does with two ranks on one GPU (pydtnn refuses it before NCCL starts). loader: benchmarks/loader.py on the
# machine's cores, then ResNet-50 trained from a JPEG folder against the same from memory.
#
# Sized for a command limit of 10 minutes: each stage has its own limit (TESTS_S, NCCL_S, LOADER_S, PROFILE_S, BENCH_S seconds), every
# test its own (TEST_S), the tests' CPU reference runs the NumPy kernels (no Numba compiles), and the
# benchmark writes its table after every row, so a stage cut short still reports what it did.
#
# Wheels the machine lacks (nvidia-cudnn-frontend...) can be put in .whl/ beforehand; they are installed
# into /tmp/site first. Needs: python3 with CuPy, PyTorch + torchvision, pytest (+ pytest-timeout), and
# pydtnn's own dependencies (numpy, tqdm, safetensors, pyyaml, Pillow, matplotlib, threadpoolctl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
STAGE=${1:-all}  # or some of the stages, comma-separated
want() { [ "$STAGE" = all ] || [[ ",$STAGE," == *",$1,"* ]]; }
# Open MPI as root, in a container: allowed, oversubscribed, no single-copy mechanism (MPICH ignores these)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism=none
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nproc
    python3 -m pip list 2>/dev/null | grep -i -E "^(cupy|cuda-pathfinder|nvidia-cudnn|nvidia-nccl|torch |numpy |mpi4py|pytest)"
    # the library's own search for the CUDA libraries, before anything is put on LD_LIBRARY_PATH
    python3 -c "from pydtnn.backends.gpu.device import load_cuda_libraries as f; print('found:', f())" \
        && found=1 || found=0
    if [ "$found" = 0 ]; then  # go on with NVIDIA's wheels on LD_LIBRARY_PATH, to check everything else
        for lib in $(python3 -c "import glob, sys; print(' '.join(sorted({p.rsplit('/', 1)[0] for d in sys.path \
for p in glob.glob(d + '/nvidia/*/lib/*.so*')})))"); do
            export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        done
        echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    fi
    python3 -c "import cupy, cudnn, numpy, torch; from pydtnn.backends.gpu.device import require_cudnn; require_cudnn(); \
print('cupy', cupy.__version__, 'cuDNN', cudnn.backend_version_string(), 'cudnn-frontend', \
getattr(cudnn, '__version__', '?'), 'numpy', numpy.__version__, 'torch', torch.__version__)"
    python3 -c "from cupy.cuda import nccl; print('NCCL', nccl.get_version())"
    python3 -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    echo "mpiexec: $(command -v mpiexec || echo none on PATH)"
} > "$OUT/versions.txt" 2>&1
# the frontend's graph API as installed, for reading beside a failure
python3 -c "import pydoc, cudnn; print(pydoc.render_doc(cudnn.pygraph, renderer=pydoc.plaintext))" \
    > "$OUT/cudnn_api.txt" 2>&1
cat "$OUT/versions.txt"

tests=0
if want tests; then
    PYDTNN_CPU_KERNELS=numpy timeout "${TESTS_S:-180}" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
        --timeout "${TEST_S:-120}" --junitxml "$OUT/gpu_tests.xml" -k "${TESTS_K:-}" tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
    tests=${PIPESTATUS[0]}
fi
if want nccl && command -v mpiexec >/dev/null; then
    timeout "${NCCL_S:-60}" mpiexec -n 2 python3 -c "
from mpi4py import MPI
from pydtnn.backends.gpu.device import load_cuda_libraries
load_cuda_libraries()
import cupy
from cupy.cuda import nccl
comm = MPI.COMM_WORLD
cupy.cuda.Device(0).use()
uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None)
try:
    c = nccl.NcclCommunicator(2, uid, comm.rank)
    x = cupy.ones(4, cupy.float32)
    c.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, cupy.cuda.get_current_stream().ptr)
    cupy.cuda.get_current_stream().synchronize()
    print('rank', comm.rank, 'NCCL with two ranks on GPU 0: allreduce gave', x.get())
except Exception as e:
    print('rank', comm.rank, 'NCCL with two ranks on GPU 0:', type(e).__name__, e)
" 2>&1 | tee "$OUT/nccl_two_ranks.log"
fi
if want loader; then
    timeout "${LOADER_S:-170}" python3 benchmarks/loader.py --images 2048 --batch 64 --repeats 1 --workers 1,2,4,8,16 \
        --train resnet50_imagenet --gpu --train_workers 1,4,8,16 --train_steps 32 --train_warmup 8 \
        --folder /tmp/pydtnn-jpegs --out "$OUT/loader.md" --json "$OUT/loader.json" 2>&1 | tee "$OUT/loader.log"
fi
if want profile; then
    timeout "${PROFILE_S:-45}" python3 benchmarks/gpu_profile.py --torch --out "$OUT/gpu_profile.md" 2>&1 | tail -n 80
fi
if want bench; then
    timeout "${BENCH_S:-150}" python3 benchmarks/gpu_train.py --steps "${STEPS:-8}" --warmup 3 \
        --out "$OUT/gpu_train.md" --json "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.log"
fi
echo "gpu tests exit code: $tests"
exit "$tests"
