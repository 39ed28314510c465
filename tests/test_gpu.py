"""GPU backend: every layer, optimizer updates and whole training steps against the CPU backend.

Tests marked `gpu` need CuPy and a visible NVIDIA GPU; without one they are skipped with the reason
(CuPy missing, or CUDA's own error such as cudaErrorInsufficientDriver). TF32 is off for this
module (NVIDIA_TF32_OVERRIDE=0, read by cuDNN and cuBLAS when CUDA starts), so float32 results
must match the CPU within 1e-4 relative. The first tests run everywhere: they check that the CPU
path never imports CuPy and that asking for a GPU without one is a clear user error.
"""

import os
import subprocess
import sys

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # before anything starts CUDA in this process

import numpy as np
import pytest

from pydtnn import layers as L
from pydtnn.backends import CPUBackend
from pydtnn.backends.gpu import gpu_status

COUNT, REASON = gpu_status()
needs_gpu = pytest.mark.skipif(not COUNT, reason=f"no GPU: {REASON}")
RTOL = 1e-4


# -- everywhere ------------------------------------------------------------------------------
def test_cpu_path_never_imports_cupy():
    code = (
        "import sys, numpy as np\n"
        "import pydtnn\n"
        "from pydtnn import models, losses, optim\n"
        "from pydtnn.backends import get_backend\n"
        "from pydtnn.trainer import Trainer\n"
        "from pydtnn.distributed import reducers\n"
        "m = models.create('simplecnn', input_shape=(1, 28, 28), num_classes=10, backend=get_backend('cpu'))\n"
        "t = Trainer(m, losses.create('categorical_cross_entropy'), optim.create('sgd', m.parameters()))\n"
        "x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)\n"
        "t.train_step(x, np.eye(10, dtype=np.float32)[[0, 1, 2, 3]])\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('cupy', 'cupyx', 'cudnn'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_gpu_status_gives_a_reason_or_a_count():
    count, reason = gpu_status()
    assert (count > 0 and reason == "") or (count == 0 and len(reason) > 10)


@pytest.mark.skipif(bool(COUNT), reason="checks the error raised on a machine without a GPU")
def test_gpu_backend_without_gpu_is_a_config_error():
    from pydtnn.backends import get_backend
    from pydtnn.errors import ConfigError

    with pytest.raises(ConfigError, match="GPU"):
        get_backend("gpu")


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    from pydtnn.backends import get_backend

    return get_backend("gpu", "float32", seed=0)


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def close(got, want, what, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = relative_error(got, want)
    assert np.isfinite(got).all() and err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.1e}"


def layer_state(layer):
    """[(name, array)] of the parameters and buffers of a layer and its children."""
    return [(f"{path}.{k}", v) for path, sub in layer.named_layers() for d in (sub.params, sub.buffers)
            for k, v in d.items()]


def layer_grads(layer):
    return [(f"{path}.{k}", sub.grads[k]) for path, sub in layer.named_layers() for k in sub.params]


def build_pair(make, in_shape, gpu):
    """The same layer on the CPU and on the GPU, with the CPU layer's parameters and buffers."""
    cpu_layer, gpu_layer = make(), make()
    cpu_layer.build(in_shape, np.float32, CPUBackend(np.float32, seed=0))
    gpu_layer.build(in_shape, np.float32, gpu)
    for (_, a), (_, b) in zip(layer_state(cpu_layer), layer_state(gpu_layer)):
        b[...] = gpu.asarray(a)
    return cpu_layer, gpu_layer


def compare_layer(make, x_shape, gpu, training=True, seed=0):
    rng = np.random.default_rng(seed)
    cpu_layer, gpu_layer = build_pair(make, x_shape[1:], gpu)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y_cpu = cpu_layer.forward(x.copy(), training=training)
    y_gpu = gpu_layer.forward(gpu.asarray(x), training=training)
    name = type(cpu_layer).__name__
    close(gpu.to_numpy(y_gpu), y_cpu, f"{name} forward")
    dy = rng.standard_normal(y_cpu.shape).astype(np.float32)
    dx_cpu = cpu_layer.backward(dy.copy())
    dx_gpu = gpu_layer.backward(gpu.asarray(dy))
    if dx_cpu is not None:
        close(gpu.to_numpy(dx_gpu), dx_cpu, f"{name} dx")
    for (pname, g_cpu), (_, g_gpu) in zip(layer_grads(cpu_layer), layer_grads(gpu_layer)):
        close(gpu.to_numpy(g_gpu), g_cpu, f"{name} d{pname}")
    for (bname, b_cpu), (_, b_gpu) in zip(layer_state(cpu_layer), layer_state(gpu_layer)):
        close(gpu.to_numpy(b_gpu), b_cpu, f"{name} {bname} after the step")


LAYER_CASES = [
    ("dense", lambda: L.Dense(16), (8, 32)),
    ("dense no bias", lambda: L.Dense(5, use_bias=False), (3, 7)),
    ("conv 3x3 p1", lambda: L.Conv2D(8, 3, padding=1), (4, 3, 12, 12)),
    ("conv 3x3 s2", lambda: L.Conv2D(6, 3, stride=2, padding=1), (2, 4, 9, 9)),
    ("conv 1x1", lambda: L.Conv2D(8, 1), (2, 16, 7, 7)),
    ("conv dilated", lambda: L.Conv2D(6, 3, dilation=2, padding=2), (2, 4, 9, 9)),
    ("conv grouped", lambda: L.Conv2D(6, 3, groups=2, padding=1), (2, 4, 7, 7)),
    ("conv depthwise s2", lambda: L.Conv2D(8, 3, groups=8, stride=2, padding=1), (2, 8, 8, 8)),
    ("conv same even kernel", lambda: L.Conv2D(3, 4, padding="same"), (2, 2, 7, 6)),
    ("conv 7x7 s2 p3", lambda: L.Conv2D(8, 7, stride=2, padding=3, use_bias=False), (2, 3, 32, 32)),
    ("maxpool 2x2", lambda: L.MaxPool2D(2), (2, 3, 8, 8)),
    ("maxpool 3x3 s2 p1", lambda: L.MaxPool2D(3, 2, padding=1), (2, 3, 9, 9)),
    ("maxpool ceil_mode", lambda: L.MaxPool2D(3, 2, ceil_mode=True), (2, 3, 10, 10)),
    ("avgpool 2x2", lambda: L.AvgPool2D(2), (2, 3, 8, 8)),
    ("avgpool 3x3 s1 p1", lambda: L.AvgPool2D(3, 1, padding=1), (2, 3, 7, 7)),
    ("global avgpool", lambda: L.GlobalAvgPool2D(), (2, 5, 6, 6)),
    ("adaptive avgpool", lambda: L.AdaptiveAvgPool2D(3), (2, 4, 7, 7)),
    ("batchnorm 2d", lambda: L.BatchNorm(), (4, 6, 5, 5)),
    ("batchnorm 1d", lambda: L.BatchNorm(), (8, 10)),
    ("relu", lambda: L.ReLU(), (4, 3, 5, 5)),
    ("relu6", lambda: L.ReLU6(), (4, 3, 5, 5)),
    ("leaky relu", lambda: L.LeakyReLU(0.1), (4, 20)),
    ("sigmoid", lambda: L.Sigmoid(), (4, 20)),
    ("tanh", lambda: L.Tanh(), (4, 20)),
    ("softmax", lambda: L.Softmax(), (4, 10)),
    ("flatten", lambda: L.Flatten(), (2, 3, 4, 4)),
    ("addition block", lambda: L.AdditionBlock(L.Conv2D(4, 3, padding=1), L.Conv2D(4, 1)), (2, 4, 6, 6)),
    ("concatenation block", lambda: L.ConcatenationBlock(L.Conv2D(3, 3, padding=1), L.MaxPool2D(3, 1, padding=1)),
     (2, 4, 6, 6)),
]


# -- on a GPU --------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("make,x_shape", [c[1:] for c in LAYER_CASES], ids=[c[0] for c in LAYER_CASES])
def test_layer_matches_cpu(gpu, make, x_shape):
    compare_layer(make, x_shape, gpu)


@needs_gpu
@pytest.mark.gpu
def test_batchnorm_evaluation_matches_cpu(gpu):
    compare_layer(lambda: L.BatchNorm(), (4, 6, 5, 5), gpu, training=False)


@needs_gpu
@pytest.mark.gpu
def test_dropout_mask_is_inverted_reproducible_and_keyed(gpu):
    layer = L.Dropout(0.25)
    layer.build((64, 64), np.float32, gpu)
    x = gpu.asarray(np.ones((32, 64, 64), np.float32))
    gpu.reseed([1, 2, 3])
    y1 = gpu.to_numpy(layer.forward(x))
    dx = gpu.to_numpy(layer.backward(gpu.asarray(np.full((32, 64, 64), 2.0, np.float32))))
    gpu.reseed([1, 2, 3])
    y2 = gpu.to_numpy(layer.forward(x))
    gpu.reseed([1, 2, 4])
    y3 = gpu.to_numpy(layer.forward(x))
    assert set(np.unique(y1).tolist()) == {0.0, np.float32(1 / 0.75)}
    assert abs((y1 == 0).mean() - 0.25) < 0.01
    np.testing.assert_array_equal(y1, y2)
    assert (y1 != y3).mean() > 0.2
    np.testing.assert_allclose(dx, 2 * y1, rtol=1e-6)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name,options", [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("sgd", {"lr": 0.1, "momentum": 0.5, "dampening": 0.3}),
    ("adam", {"lr": 1e-2, "weight_decay": 1e-2}),
    ("adamw", {"lr": 1e-2}),
    ("nadam", {"lr": 1e-2}),
    ("rmsprop", {"lr": 1e-2, "momentum": 0.9}),
])
def test_optimizer_updates_match_cpu(gpu, name, options):
    from pydtnn import optim

    rng = np.random.default_rng(1)
    shapes = [(7, 5), (5,), (3, 2, 3, 3)]
    p_cpu = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    g_cpu = [np.zeros_like(p) for p in p_cpu]
    p_gpu = [gpu.asarray(p) for p in p_cpu]
    g_gpu = [gpu.asarray(g) for g in g_cpu]
    opt_cpu = optim.create(name, [(f"p{i}", p, g) for i, (p, g) in enumerate(zip(p_cpu, g_cpu))], **options)
    opt_gpu = optim.create(name, [(f"p{i}", p, g) for i, (p, g) in enumerate(zip(p_gpu, g_gpu))], backend=gpu,
                           **options)  # the GPU backend's update kernels (SGD, Adam, AdamW)
    for _ in range(5):
        for g, gg in zip(g_cpu, g_gpu):
            g[...] = rng.standard_normal(g.shape)
            gg[...] = gpu.asarray(g)
        opt_cpu.step()
        opt_gpu.step()
    for i, (a, b) in enumerate(zip(p_cpu, p_gpu)):
        close(gpu.to_numpy(b), a, f"{name} p{i} after 5 steps")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model,shape,batch", [("simplecnn", (1, 28, 28), 16), ("resnet20_cifar10", (3, 32, 32), 16),
                                               ("vgg16_cifar10", (3, 32, 32), 16),
                                               ("resnet50_imagenet", (3, 224, 224), 4)])
def test_training_step_matches_cpu(gpu, model, shape, batch):
    """Three forward/backward/SGD-with-momentum steps of a whole model, from the same weights, on the same
    batches: the losses equal the CPU backend's, and every parameter and buffer is as close to a float64
    run as the CPU's float32 run is (within 1e-3 relative, or 4 times the CPU's own error where float32
    rounding, amplified by deep nets on small batches, leaves the CPU itself further off)."""
    from pydtnn import losses, models, optim
    from pydtnn.trainer import Trainer

    options = {"dropout": 0.0} if model.startswith("vgg") else {}  # masks differ between the devices

    def trainer(backend):
        m = models.create(model, input_shape=shape, num_classes=10, backend=backend, **options)
        return Trainer(m, losses.create("categorical_cross_entropy"),
                       optim.create("sgd", m.parameters(), backend=backend, lr=0.05, momentum=0.9), progress=False)

    t_cpu, t_gpu, t_64 = trainer(CPUBackend(np.float32, seed=0)), trainer(gpu), trainer(CPUBackend(np.float64, seed=0))
    for (_, a), (_, b), (_, c) in zip(t_cpu.model.named_state(), t_gpu.model.named_state(), t_64.model.named_state()):
        b[...] = gpu.asarray(a)
        c[...] = a
    rng = np.random.default_rng(2)
    for _ in range(3):
        x = rng.standard_normal((batch,) + shape).astype(np.float32)
        y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, batch)]
        loss_cpu, _ = t_cpu.train_step(x, y)
        loss_gpu, _ = t_gpu.train_step(gpu.asarray(x), gpu.asarray(y))
        t_64.train_step(x.astype(np.float64), y.astype(np.float64))
        assert abs(loss_gpu - loss_cpu) <= 1e-4 * abs(loss_cpu), (loss_gpu, loss_cpu)
    for (name, a), (_, b), (_, c) in zip(t_cpu.model.named_state(), t_gpu.model.named_state(),
                                         t_64.model.named_state()):
        cpu_error = relative_error(a, c)
        close(gpu.to_numpy(b), c, f"{model} {name} after three steps (CPU float32: {cpu_error:.1e})",
              rtol=max(1e-3, 4 * cpu_error))


def _final_test_accuracy(*flags, env=None):
    """pydtnn-train's test accuracy (its `final:` line) for the default model and data with these flags."""
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--num_epochs", "5", "--seed", "0", *flags], check=False,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    final = [line for line in r.stdout.splitlines() if line.startswith("final:")]
    assert final, r.stdout[-2000:]
    return float(final[-1].split("test_accuracy ")[1].split(",")[0])


@needs_gpu
@pytest.mark.gpu
def test_default_model_trains_on_the_gpu_to_the_cpus_accuracy():
    """pydtnn-train --enable_gpu, the default model and data (simplecnn, mnist5k), 5 epochs: within one point
    of the CPU's test accuracy, and well above chance."""
    cpu = _final_test_accuracy("--enable_gpu", "false", env={**os.environ, "PYDTNN_CPU_KERNELS": "numpy"})
    gpu_accuracy = _final_test_accuracy("--enable_gpu", "true")
    assert cpu > 0.9 and abs(gpu_accuracy - cpu) <= 0.01, (gpu_accuracy, cpu)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["blocking", "per_layer", "bucketed"])
def test_nccl_reduction_with_one_rank(gpu, strategy):
    """NCCL on a world of one: every strategy leaves gradients as computed (times the weight, 1)."""
    from pydtnn import models
    from pydtnn.distributed import reducers
    from pydtnn.distributed.comm import SingleProcess
    from pydtnn.distributed.gpu_comm import DeviceComm, NcclComm

    comm = NcclComm(DeviceComm(SingleProcess()))
    buf = gpu.asarray(np.arange(10, dtype=np.float32))
    comm.allreduce(buf, "check")
    np.testing.assert_array_equal(gpu.to_numpy(buf), np.arange(10, dtype=np.float32))

    model = models.create("simplecnn", input_shape=(1, 28, 28), num_classes=10, backend=gpu)
    reducer = reducers.create(strategy, comm).attach(model)
    rng = np.random.default_rng(3)
    x = gpu.asarray(rng.standard_normal((8, 1, 28, 28)).astype(np.float32))
    with reducer.no_sync():  # backward first, so the gradients can be read before the reduction scales them
        out = model.forward(x)
        model.backward(gpu.asarray(rng.standard_normal(out.shape).astype(np.float32)))
    want = {n: gpu.to_numpy(g).copy() for n, _, g in model.parameters()}
    reducer.begin_step(0.25)  # scaled in place on the device, then summed over a world of one
    reducer.replay()
    reducer.finish()
    gpu.synchronize()
    for n, _, g in model.parameters():
        np.testing.assert_array_equal(gpu.to_numpy(g), 0.25 * want[n], err_msg=n)


class _TwoRanks:
    """A stand-in MPI communicator of size 2 whose collectives double host arrays in place (as a sum of
    two equal ranks would), and that records what it was given: enough to drive DeviceComm's staging
    path in one process."""

    name, rank, size = "stand-in", 0, 2

    def __init__(self):
        self.seen = []

    def allreduce(self, buf, label=""):
        self.seen.append(buf)
        buf *= 2
        return buf

    def iallreduce(self, buf, label=""):
        from pydtnn.distributed.communicator import Completed

        self.allreduce(buf, label)
        return Completed()

    def bcast(self, buf, root=0):
        self.seen.append(buf)
        buf += 1
        return buf


@needs_gpu
@pytest.mark.gpu
def test_device_comm_staging_round_trip(gpu):
    """Host-staged collectives of device arrays go through page-locked host buffers, reused by size, and
    bring the collective's result back to the device array."""
    from pydtnn.distributed.gpu_comm import DeviceComm

    inner = _TwoRanks()
    comm = DeviceComm(inner, cuda_aware=False)
    want = np.linspace(0, 1, 1000, dtype=np.float32)
    a = gpu.asarray(want)
    comm.allreduce(a)
    comm.iallreduce(a).wait()
    comm.bcast(a)
    np.testing.assert_array_equal(gpu.to_numpy(a), want * 4 + 1)
    assert type(a).__module__.startswith("cupy")
    assert len(inner.seen) == 3 and all(isinstance(h, np.ndarray) for h in inner.seen)  # staged on the host
    assert len({h.ctypes.data for h in inner.seen}) == 1  # one pinned buffer, taken and given back each time
    b = gpu.asarray(want[:10])
    comm.allreduce(b)
    assert inner.seen[-1].ctypes.data != inner.seen[0].ctypes.data  # another size, another buffer


@needs_gpu
@pytest.mark.gpu
def test_batches_reach_the_device_intact_on_the_copy_stream(gpu):
    """batch_to_device copies on its own stream into buffers reused per shape: many batches in a row, of
    several shapes (more than the 8 kept), each used by a computation queued before later batches
    arrive, as in training; the host may overwrite its array at once. Device sums equal the host's."""
    cp = gpu.cupy
    rng = np.random.default_rng(5)
    want, sums = [], []
    for i in range(30):
        shape = (64, 3, 16, 16 + i % 10)  # 10 shapes
        x = rng.standard_normal(shape).astype(np.float32)
        want.append(float((x.astype(np.float64) ** 2).sum()))
        d = gpu.batch_to_device(x)
        x[...] = 0  # the caller may reuse its array at once
        assert d.shape == shape
        sums.append((d.astype(cp.float64) ** 2).sum())  # queued on the computing stream, not read yet
    got = [float(s) for s in sums]
    np.testing.assert_allclose(got, want, rtol=1e-12)


# -- several processes on one GPU ----------------------------------------------------------------------------
def _mpiexec():
    """The mpiexec of the MPI library mpi4py uses: next to this Python, else on PATH; None without one."""
    import shutil

    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


MPI_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
needs_mpiexec = pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec next to python or on PATH")


def _train_gpu(n, tmp_path, *flags):
    """pydtnn-train --enable_gpu on n processes (all on this machine's first GPU when it has one): the process
    and its metrics file's records."""
    import json

    out = tmp_path / f"m{n}-{len(list(tmp_path.iterdir()))}.jsonl"
    cmd = ([_mpiexec(), "-n", str(n)] if n > 1 else []) + [
        sys.executable, "-m", "pydtnn", "--model", "simplemlp", "--num_epochs", "1", "--steps_per_epoch", "12",
        "--global_batch_size", "48", "--progress", "false", "--enable_gpu", "true", "--sync_every", "1",
        "--metrics_file", str(out), *flags]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240,
                       env={**MPI_ENV, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")})
    records = [json.loads(s) for s in out.read_text().splitlines()] if out.exists() else []
    return r, records


@needs_gpu
@needs_mpiexec
@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["bucketed", "per_layer", "blocking"])
def test_two_processes_sharing_the_gpu_equal_one_process(tmp_path, reduction):
    """Data parallelism over two processes on one GPU, gradients reduced by MPI through host memory
    (DeviceComm): the same losses and test accuracy as one process, within float32 rounding."""
    r1, one = _train_gpu(1, tmp_path)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2, two = _train_gpu(2, tmp_path, "--reduction", reduction)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert two[-1]["world_size"] == 2 and one[-1]["world_size"] == 1
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-4)
    assert two[-1]["test_loss"] == pytest.approx(one[-1]["test_loss"], rel=1e-3)


@needs_gpu
@needs_mpiexec
@pytest.mark.gpu
def test_topk_reduction_on_two_processes_sharing_the_gpu(tmp_path):
    """topk's allgatherv of device gradients, staged through host memory: trains, and the loss falls."""
    r, records = _train_gpu(2, tmp_path, "--reduction", "topk", "--density", "0.1", "--num_epochs", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [rec["loss"] for rec in records if "epoch" in rec and rec.get("loss") is not None]
    assert len(losses) == 2 and np.isfinite(losses).all() and losses[1] < losses[0], records


@needs_gpu
@needs_mpiexec
@pytest.mark.gpu
def test_nccl_with_two_processes_on_one_gpu_is_refused_in_one_line(tmp_path):
    r, _ = _train_gpu(2, tmp_path, "--enable_nccl", "true")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [s for s in r.stderr.splitlines() if "share the GPU" in s]
    assert lines and "expected one GPU per rank" in lines[0], r.stderr[-3000:]
