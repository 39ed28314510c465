"""The GPU backend's host-side logic, checked here without a GPU.

- CUDA library discovery (load_cuda_libraries): a missing library is one clear line naming it and how to
  install it; errors from the cuDNN frontend keep their type and message, with context added.
- The NCCL unique id: CuPy 14 gives and takes bytes, CuPy 13 a tuple of signed chars; both cross MPI.
- NcclComm: the id reaches NcclCommunicator in CuPy's own form; asynchronous errors are raised; a
  reduction that never finishes is reported as a stall and the job aborted.
- The copy stream of input batches (transfers.BatchCopier) and the pinned uploads (Uploader), run on a
  stand-in for CUDA streams and events that executes queued work in the most hostile order CUDA
  allows: copies as early as possible, computation as late as possible. Every batch the computation
  reads must be the one it was given.
"""

import sys
import types

import numpy as np
import pytest

from pydtnn.errors import ConfigError


# -- CUDA library discovery ------------------------------------------------------------------------
def test_first_missing_cuda_library_is_one_line_naming_it_and_how_to_install_it(monkeypatch):
    pytest.importorskip("cuda.pathfinder")
    from pydtnn.backends.gpu import device

    monkeypatch.delenv("CUDNN_FRONTEND_CUDART_LIB_NAME", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    try:  # the real search, on a machine without a whole CUDA: it fails on the first library missing
        device.load_cuda_libraries()
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg
        named = [lib for lib in ("libcudart.so.13", "libcublasLt.so.13", "libcudnn.so.9") if lib in msg]
        assert len(named) == 1 and "pip install" in msg and "which was not found" in msg, msg
    else:
        pytest.skip("this machine has the CUDA runtime, cuBLASLt and cuDNN")


def _fake_pathfinder(monkeypatch, missing, loaded):
    mod = types.ModuleType("cuda.pathfinder")

    class DynamicLibNotFoundError(RuntimeError):
        pass

    def load_nvidia_dynamic_lib(name):
        if name == missing:
            raise DynamicLibNotFoundError(f"Failure finding lib{name}.so\nsearched: ...")
        loaded.append(name)
        return types.SimpleNamespace(abs_path=f"/opt/nvidia/lib/lib{name}.so")

    mod.DynamicLibNotFoundError, mod.load_nvidia_dynamic_lib = DynamicLibNotFoundError, load_nvidia_dynamic_lib
    cuda = types.ModuleType("cuda")
    cuda.pathfinder = mod
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", mod)


def test_missing_cudnn_names_libcudnn_and_its_wheel(monkeypatch):
    from pydtnn.backends.gpu import device

    loaded = []
    _fake_pathfinder(monkeypatch, "cudnn", loaded)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    with pytest.raises(ConfigError) as e:
        device.load_cuda_libraries()
    msg = str(e.value)
    assert "libcudnn.so.9" in msg and "pip install nvidia-cudnn-cu13" in msg and "Failure finding libcudnn" in msg
    assert "\n" not in msg and loaded == ["cudart", "cublasLt"]


def test_found_runtime_is_the_one_the_frontend_is_told_to_use(monkeypatch):
    from pydtnn.backends.gpu import device

    loaded = []
    _fake_pathfinder(monkeypatch, None, loaded)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    monkeypatch.delenv("CUDNN_FRONTEND_CUDART_LIB_NAME", raising=False)
    found = device.load_cuda_libraries()
    assert loaded == ["cudart", "cublasLt", "cudnn"] and found["cudnn"] == "/opt/nvidia/lib/libcudnn.so"
    import os

    assert os.environ["CUDNN_FRONTEND_CUDART_LIB_NAME"] == "/opt/nvidia/lib/libcudart.so"


def test_where_cuda_pathfinder_fails_the_wheels_on_sys_path_are_searched(monkeypatch, tmp_path):
    """cuda.pathfinder before 1.7 raises for cuDNN: libcudnn.so.9 of the nvidia-cudnn wheel is loaded directly."""
    from pydtnn.backends.gpu import device

    lib = tmp_path / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudnn.so.9").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path)])
    assert device.wheel_library("cudnn") == str(lib / "libcudnn.so.9")
    assert device.wheel_library("cudart") is None
    opened = []
    monkeypatch.setattr(device.ctypes, "CDLL", lambda path, mode=0: opened.append(path))
    _fake_pathfinder(monkeypatch, "cudnn", [])
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    found = device.load_cuda_libraries()
    assert found["cudnn"] == str(lib / "libcudnn.so.9") and opened == [found["cudnn"]]


def test_without_cuda_pathfinder_the_error_says_what_to_install(monkeypatch):
    from pydtnn.backends.gpu import device

    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # import fails
    with pytest.raises(ConfigError, match="pip install cuda-pathfinder"):
        device.load_cuda_libraries()


def test_cudnn_on_ld_library_path_comes_first_as_the_frontend_looks(monkeypatch, tmp_path):
    from pydtnn.backends.gpu import device

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "libcudnn.so.9").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert device.cudnn_on_ld_library_path() == str(tmp_path / "b" / "libcudnn.so.9")
    # an unloadable file there is an error naming it, not a silent fall back to another cuDNN
    _fake_pathfinder(monkeypatch, None, [])
    with pytest.raises(ConfigError, match=r"cannot load .*libcudnn\.so\.9 \(found on LD_LIBRARY_PATH\)"):
        device.load_cuda_libraries()


def test_frontend_errors_keep_their_type_and_message_with_context_added():
    from pydtnn.backends.gpu.conv_graphs import with_context

    class CudnnGraphNotSupportedError(RuntimeError):
        pass

    e = with_context(CudnnGraphNotSupportedError("CUDNN_STATUS_NOT_SUPPORTED: no engine"), "conv fprop, batch 8")
    assert type(e) is CudnnGraphNotSupportedError and str(e) == "CUDNN_STATUS_NOT_SUPPORTED: no engine"
    notes = getattr(e, "__notes__", None)
    assert notes == ["conv fprop, batch 8"] or "conv fprop, batch 8" in str(e)


# -- NCCL ------------------------------------------------------------------------------------------
def test_nccl_id_crosses_mpi_in_cupy_14_and_13_forms():
    import json

    from pydtnn.distributed.gpu_comm import nccl_id_from_wire, nccl_id_to_wire

    raw = bytes(range(256))[::2]  # 128 bytes, half of them above 127
    wire = json.loads(json.dumps(nccl_id_to_wire(raw)))
    assert nccl_id_from_wire(wire) == raw and isinstance(nccl_id_from_wire(wire), bytes)
    signed = tuple(b - 256 if b > 127 else b for b in raw)  # CuPy 13's tuple of C chars
    wire = json.loads(json.dumps(nccl_id_to_wire(signed)))
    back = nccl_id_from_wire(wire)
    assert back == signed and isinstance(back, tuple) and min(back) < 0
    with pytest.raises(ValueError, match="expected 128"):
        nccl_id_to_wire(b"\x00" * 127)


class _FakeNccl(types.ModuleType):
    """cupy.cuda.nccl as CuPy 14 has it: get_unique_id() -> bytes; NcclCommunicator takes bytes."""

    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_SUM = 6, 7, 8, 0
    available = True

    def __init__(self, id_form=bytes):
        super().__init__("cupy.cuda.nccl")
        self.id_form, self.made, self.async_error = id_form, [], None
        nccl = self

        class NcclCommunicator:
            def __init__(self, ndev, comm_id, rank):
                if not isinstance(comm_id, nccl.id_form):
                    raise TypeError(f"commId: expected {nccl.id_form.__name__}, got {type(comm_id).__name__}")
                nccl.made.append((ndev, comm_id, rank))
                self.aborted = False

            def allReduce(self, *args):  # noqa: N802 (CuPy's name)
                pass

            def check_async_error(self):
                if nccl.async_error:
                    raise RuntimeError(nccl.async_error)

            def abort(self):
                self.aborted = True

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        raw = bytes((7 * i) % 256 for i in range(128))
        return raw if self.id_form is bytes else tuple(b - 256 if b > 127 else b for b in raw)


class _Event:
    def __init__(self, done=True):
        self.done = done

    def record(self, stream=None):
        pass


def _fake_cupy(monkeypatch, nccl, events_done=True, bus="0000:1A:00.0"):
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cuda.Device = lambda device=None: types.SimpleNamespace(pci_bus_id=bus)
    cuda.Event = lambda disable_timing=True: _Event(events_done)
    cuda.Stream = lambda non_blocking=True: types.SimpleNamespace(ptr=1, wait_event=lambda e: None)
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0, wait_event=lambda e: None)
    cupy.cuda, cupy.ndarray = cuda, _DeviceArray
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, mod)


class _DeviceArray:
    def __init__(self, n):
        self.size, self.dtype = n, np.dtype(np.float32)
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.data = types.SimpleNamespace(ptr=1234)


class _World:
    """A one-process communicator with what NcclComm asks of MPIComm."""

    rank, size, name, stall_timeout = 0, 1, "fake", None

    def __init__(self):
        self.aborted = None

    def bcast_obj(self, obj, root=0):
        import json

        return json.loads(json.dumps(obj))  # what MPI carries: JSON

    def allgather_obj(self, obj):
        return [self.bcast_obj(obj)]

    def abort(self, code=1):
        self.aborted = code


class _TwoOnOneNode(_World):
    """Rank 0 of two on one node, the other rank on GPU `other_bus`."""

    size = 2

    def __init__(self, other_bus):
        super().__init__()
        self.other_bus = other_bus

    def allgather_obj(self, obj):
        return [obj, [obj[0], self.other_bus]]


@pytest.mark.parametrize("other_bus", ["0000:1a:00.0", "0000:1A:00.0"])
def test_nccl_refuses_two_ranks_on_one_gpu_before_nccl_starts(monkeypatch, other_bus):
    from pydtnn.distributed import gpu_comm
    from pydtnn.errors import ConfigError

    nccl = _FakeNccl()
    _fake_cupy(monkeypatch, nccl, bus="0000:1A:00.0")
    with pytest.raises(ConfigError) as e:
        gpu_comm.NcclComm(_TwoOnOneNode(other_bus))
    message = str(e.value)
    assert "\n" not in message and "ranks 0 and 1 share the GPU 0000:1A:00.0 of node" in message
    assert "expected one GPU per rank" in message
    assert nccl.made == []  # refused before NCCL was asked


def test_nccl_takes_two_ranks_on_two_gpus(monkeypatch):
    from pydtnn.distributed import gpu_comm

    nccl = _FakeNccl()
    _fake_cupy(monkeypatch, nccl, bus="0000:1A:00.0")
    comm = gpu_comm.NcclComm(_TwoOnOneNode("0000:1B:00.0"))
    assert comm.size == 2 and len(nccl.made) == 1


def test_shared_gpu_names_the_first_pair_per_node():
    from pydtnn.distributed.gpu_comm import shared_gpu

    assert shared_gpu([("a", "0:1"), ("a", "0:2"), ("b", "0:1"), ("b", "0:2")]) is None
    assert shared_gpu([("a", "0:1"), ("b", "0:1"), ("a", "0:2"), ("b", "0:1")]) == (1, 3, "b", "0:1")
    assert shared_gpu([]) is None


@pytest.mark.parametrize("id_form", [bytes, tuple], ids=["cupy14-bytes", "cupy13-tuple"])
def test_nccl_comm_gives_nccl_the_id_in_cupys_own_form(monkeypatch, id_form):
    from pydtnn.distributed import gpu_comm

    nccl = _FakeNccl(id_form)
    _fake_cupy(monkeypatch, nccl)
    monkeypatch.setattr(gpu_comm, "is_device_array", lambda a: isinstance(a, _DeviceArray))
    gpu_comm.NcclComm(_World())
    (ndev, comm_id, rank), = nccl.made
    assert (ndev, rank) == (1, 0) and comm_id == nccl.get_unique_id()


def test_nccl_async_error_is_raised_at_the_next_reduction(monkeypatch):
    from pydtnn.distributed import gpu_comm

    nccl = _FakeNccl()
    _fake_cupy(monkeypatch, nccl)
    monkeypatch.setattr(gpu_comm, "is_device_array", lambda a: isinstance(a, _DeviceArray))
    comm = gpu_comm.NcclComm(_World())
    comm.iallreduce(_DeviceArray(10), "grads").wait()
    nccl.async_error = "NCCL error: remote process exited or there was a network error"
    with pytest.raises(RuntimeError, match="remote process exited"):
        comm.iallreduce(_DeviceArray(10), "grads")


def test_nccl_reduction_that_never_ends_is_reported_as_a_stall(monkeypatch, capsys):
    from pydtnn.distributed import gpu_comm

    nccl = _FakeNccl()
    _fake_cupy(monkeypatch, nccl, events_done=False)  # the reduction never completes
    monkeypatch.setattr(gpu_comm, "is_device_array", lambda a: isinstance(a, _DeviceArray))
    world = _World()
    world.stall_timeout = 0.05
    comm = gpu_comm.NcclComm(world)
    comm.iallreduce(_DeviceArray(10), "bucket 3")
    comm.settle()
    err = capsys.readouterr().err
    assert world.aborted == 1 and comm.nccl_comm.aborted
    assert "rank 0: stalled" in err and "NCCL allreduce (bucket 3)" in err and "stall_timeout=0.05 s" in err


# -- copies on streams, in the most hostile order CUDA allows ------------------------------------
class _Gpu:
    """Streams as queues of operations; an operation runs when it heads its queue and every event it
    waits for has run. With prefer="copy", copy-stream work runs first and computing work only when
    nothing else can run, so a missing wait shows up as a batch overwritten before it is read; with
    prefer="compute" the other way round, so a batch read before it has arrived shows up."""

    def __init__(self, prefer="copy"):
        self.prefer, self.streams = prefer, []
        self.clobbered = []  # fresh memory written before the work queued earlier had finished with it
        self.compute = self.stream("compute")

    def stream(self, name):
        s = _Stream(self, name)
        self.streams.append(s)
        return s

    def step(self):
        for s in sorted(self.streams, key=lambda s: (s is self.compute) == (self.prefer == "copy")):
            if s.queue:
                fn, deps = s.queue[0]
                if all(d.ran for d in deps):
                    s.queue.pop(0)
                    fn()
                    return True
        return False

    def run_until(self, cond):
        while not cond():
            if not self.step():
                raise AssertionError("deadlock: the condition waited for can never hold")

    def drain(self):
        while self.step():
            pass
        assert not any(s.queue for s in self.streams), "work left that can never run"


class _Op:
    def __init__(self):
        self.ran = False


class _Stream:
    def __init__(self, gpu, name):
        self.gpu, self.name, self.queue = gpu, name, []
        self.ptr = id(self)

    def enqueue(self, fn, deps=()):
        self.queue.append((fn, list(deps)))

    def wait_event(self, event):
        if event.op is not None:  # CUDA: waits for the event's most recent record at the time of the call
            self.enqueue(lambda: None, [event.op])


class _SimEvent:
    def __init__(self, gpu):
        self.gpu, self.op = gpu, None

    def record(self, stream):
        op = self.op = _Op()

        def mark():
            op.ran = True

        stream.enqueue(mark)

    @property
    def done(self):
        return self.op is None or self.op.ran

    def synchronize(self):
        self.gpu.run_until(lambda: self.done)


class _SimArray:
    def __init__(self, gpu, shape, dtype):
        self.gpu, self.value = gpu, np.zeros(shape, dtype)
        self.shape, self.dtype = self.value.shape, self.value.dtype

    def set(self, host, stream):
        stream.enqueue(lambda: self.value.__setitem__(Ellipsis, host))  # reads the pinned buffer when it runs


def _sim_cupy(gpu):
    cp = types.SimpleNamespace()
    cp.cuda = types.SimpleNamespace(
        Stream=lambda non_blocking=True: gpu.stream("copy"),
        Event=lambda disable_timing=True: _SimEvent(gpu),
        get_current_stream=lambda: gpu.compute,
    )
    def empty(shape, dtype):
        """Memory from a stream-ordered pool: work queued earlier on the computing stream may still read
        it (a freed activation), so a write ordered before that work clobbers it."""
        a = _SimArray(gpu, shape, dtype)
        a.value[...] = -7
        gpu.compute.enqueue(lambda: None if (a.value == -7).all() else gpu.clobbered.append(a))
        return a

    cp.empty = empty
    return cp


def _train_like(copier_cls, gpu, steps=12, same_shape=False, **kw):
    """Inputs and targets per step (of two shapes, or of one), each read by the computation of its step,
    with a last smaller batch; returns (what was sent, what the computation read)."""
    cp = _sim_cupy(gpu)
    copier = copier_cls(cp, empty_pinned=lambda shape, dtype: np.empty(shape, dtype), **kw)
    rng = np.random.default_rng(0)
    sent, read = [], []
    for step in range(steps):
        n = 4 if step < steps - 1 else 2
        x = rng.standard_normal((n, 3)).astype(np.float32)
        y = rng.standard_normal((n, 3)).astype(np.float32) if same_shape else rng.integers(0, 10, n)
        sent.append((x.copy(), y.copy()))
        dx, dy = copier(x, y)
        x[...], y[...] = 0, 0  # the caller may reuse its arrays at once
        got = []
        gpu.compute.enqueue(lambda dx=dx, dy=dy, got=got: got.extend([dx.value.copy(), dy.value.copy()]))
        read.append(got)
    gpu.drain()
    return sent, read


@pytest.mark.parametrize("same_shape", [False, True], ids=["labels", "targets-shaped-like-inputs"])
@pytest.mark.parametrize("prefer", ["copy", "compute"])
def test_batch_copier_gives_each_step_its_own_batch_in_any_order_cuda_allows(prefer, same_shape):
    from pydtnn.backends.gpu.transfers import BatchCopier

    gpu = _Gpu(prefer)
    sent, read = _train_like(BatchCopier, gpu, same_shape=same_shape)
    assert not gpu.clobbered
    for i, ((x, y), got) in enumerate(zip(sent, read)):
        np.testing.assert_array_equal(got[0], x, err_msg=f"step {i} inputs")
        np.testing.assert_array_equal(got[1], y, err_msg=f"step {i} labels")


def test_the_stand_in_catches_a_copier_that_does_not_wait():
    """Without the copy stream's wait for the computation, the hostile order overwrites batches."""
    from pydtnn.backends.gpu.transfers import BatchCopier

    gpu = _Gpu()
    real_stream = gpu.stream

    def careless(name):
        s = real_stream(name)
        if name == "copy":
            s.wait_event = lambda event: None
        return s

    gpu.stream = careless
    sent, read = _train_like(BatchCopier, gpu)
    assert any(not np.array_equal(got[0], x) for (x, _), got in zip(sent, read))


@pytest.mark.parametrize("prefer", ["copy", "compute"])
def test_uploads_arrive_whole_though_pinned_buffers_are_reused(prefer):
    from pydtnn.backends.gpu.transfers import Uploader

    gpu = _Gpu(prefer)
    up = Uploader(_sim_cupy(gpu), per_size=2, empty_pinned=lambda n, dtype: np.empty(n, dtype))
    rng = np.random.default_rng(1)
    sent, outs = [], []
    for _ in range(9):
        m = rng.standard_normal((5, 2)).astype(np.float32)
        sent.append(m.copy())
        outs.append(up(m))
        m[...] = 0
    gpu.drain()
    assert not gpu.clobbered
    for i, (m, out) in enumerate(zip(sent, outs)):
        np.testing.assert_array_equal(out.value, m, err_msg=f"upload {i}")


# -- CUDA-aware MPI detection ----------------------------------------------------------------------
def test_mpi_libraries_are_found_in_the_process_map(tmp_path):
    from pydtnn.distributed.gpu_comm import loaded_mpi_libraries

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 r--p 00000000 08:01 2 /opt/venv/lib/libmpi.so.12\n"
        "7f04-7f05 r-xp 00001000 08:01 2 /opt/venv/lib/libmpi.so.12\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
        "7f08-7f09 r--p 00000000 08:01 3 /opt/ompi/lib/libmpi.so.40.30.0\n"
        "7f0a-7f0b r--p 00000000 08:01 4 /opt/x/libmpix_helper.so\n")
    assert loaded_mpi_libraries(str(maps)) == ["/opt/venv/lib/libmpi.so.12", "/opt/ompi/lib/libmpi.so.40.30.0"]
    assert loaded_mpi_libraries(str(tmp_path / "absent")) == []


def test_this_machines_mpi_is_asked_and_says_it_takes_no_device_buffers(monkeypatch):
    """MPICH from its wheel (no CUDA) has MPIX_Query_cuda_support, found through the process map; it says 0.
    The environment variable overrides it."""
    import ctypes

    MPI = pytest.importorskip("mpi4py.MPI")
    from pydtnn.distributed.gpu_comm import loaded_mpi_libraries, mpi_cuda_aware

    monkeypatch.delenv("PYDTNN_CUDA_AWARE_MPI", raising=False)
    libs = loaded_mpi_libraries()
    assert libs, f"no MPI library mapped after importing mpi4py ({MPI.Get_library_version()[:40]})"
    if not any(hasattr(ctypes.CDLL(p), "MPIX_Query_cuda_support") for p in libs):
        pytest.skip("this MPI library has no MPIX_Query_cuda_support")
    assert mpi_cuda_aware() is False
    monkeypatch.setenv("PYDTNN_CUDA_AWARE_MPI", "1")
    assert mpi_cuda_aware() is True


# -- the cuDNN graph cache -----------------------------------------------------------------------
def test_conv_graph_cache_is_bounded_and_drops_the_least_recently_used(monkeypatch):
    from pydtnn.backends.gpu import conv_graphs

    ran = []
    fake = types.SimpleNamespace(create_handle=lambda: 1, destroy_handle=lambda h: None,
                                 set_stream=lambda handle, stream: None)
    monkeypatch.setattr(conv_graphs, "require_cudnn", lambda: fake)
    backend = types.SimpleNamespace(cupy=types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)),
        empty=lambda n, dtype: np.empty(n, np.uint8), uint8=np.uint8))
    graphs = conv_graphs.ConvGraphs(backend, max_graphs=3)
    built = []

    class Graph:
        def execute(self, arrays, ws, handle):
            ran.append(arrays)

    def build(kind, n, g, w_shape):
        built.append(n)
        return conv_graphs._Entry(Graph(), {"X": "X"}, 16, None, None)

    monkeypatch.setattr(graphs, "_build", build)
    for n in (1, 2, 3, 1, 4, 2, 1):  # 1 is used again before 4 arrives, so 2 is dropped, then built again
        graphs.run("fprop", n, "g", (8, 3, 3, 3), {"X": n})
    assert built == [1, 2, 3, 4, 2] and len(graphs.cache) == 3
    assert [key[1] for key in graphs.cache] == [4, 2, 1] and len(ran) == 7


def test_conv_graphs_pass_buffers_by_position_or_else_by_mapping_and_set_the_stream_once(monkeypatch):
    """Buffers go to the frontend by position with their uids; a frontend that refuses that gets the mapping
    from then on. The handle is given the stream only when the current stream changes."""
    from pydtnn.backends.gpu import conv_graphs

    streams_set, current = [], [7]
    fake = types.SimpleNamespace(create_handle=lambda: 1, destroy_handle=lambda h: None,
                                 set_stream=lambda handle, stream: streams_set.append(stream))
    monkeypatch.setattr(conv_graphs, "require_cudnn", lambda: fake)
    backend = types.SimpleNamespace(cupy=types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=current[0])),
        empty=lambda n, dtype: np.empty(n, np.uint8), uint8=np.uint8))
    graphs = conv_graphs.ConvGraphs(backend)
    calls = []

    class Graph:
        def __init__(self, positional):
            self.positional = positional

        def execute(self, arrays, ws, handle, tensor_uids=None):
            if tensor_uids is not None and not self.positional:
                raise TypeError("tensor_uids")
            calls.append((arrays, tensor_uids))

    order = ("X", "W", "Y")
    uids = tuple(conv_graphs.UIDS[k] for k in order)
    entries = {1: conv_graphs._Entry(Graph(True), dict(zip(order, "xwy")), 0, order, uids),
               2: conv_graphs._Entry(Graph(False), dict(zip(order, "xwy")), 0, order, uids)}
    monkeypatch.setattr(graphs, "_build", lambda kind, n, g, w_shape: entries[n])
    arrays = {"Y": "out", "X": "in", "W": "weight"}
    graphs.run("fprop", 1, "g", (1,), arrays)
    assert calls[-1] == (["in", "weight", "out"], (1, 2, 3))
    graphs.run("fprop", 2, "g", (1,), arrays)  # refused by position: the mapping, and from then on
    assert calls[-1] == ({"y": "out", "x": "in", "w": "weight"}, None) and entries[2].uids is None
    graphs.run("fprop", 2, "g", (1,), arrays)
    assert len(calls) == 3 and calls[-1][1] is None
    current[0] = 9
    graphs.run("fprop", 1, "g", (1,), arrays)
    assert streams_set == [7, 9]
