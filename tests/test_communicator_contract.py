"""The Communicator contract (pydtnn/distributed/communicator.py), checked without MPI processes or a GPU.

- Every communicator of the package subclasses Communicator and none forwards calls with __getattr__.
- The rule for the collectives: each concrete communicator defines every method of COLLECTIVES in its own
  class body (implemented, delegated by name, or refused in one line); only the methods of GENERIC, whose
  base bodies are generic, may be inherited; the base refuses what a subclass leaves out, naming both.
- No getattr/hasattr probe in the distributed package or the step prediction: capabilities are the
  contract's methods and properties (the MPI module's constants are the one narrow exception).
- DeviceComm stages device arrays through host buffers for allgatherv and reduce_scatterv (a fake device
  array and a fake host communicator stand in for CuPy and MPI); the registry refuses or accepts each
  device combination in one line.
"""

import ast
import importlib
import inspect
import pathlib
import pkgutil
import sys
import types

import numpy as np
import pytest

import pydtnn.distributed
from pydtnn.distributed import reducers
from pydtnn.distributed.comm import MPIComm, SingleProcess
from pydtnn.distributed.communicator import COLLECTIVES, GENERIC, CollectiveUnsupported, Communicator
from pydtnn.distributed.gpu_comm import DeviceComm, NcclComm
from pydtnn.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONCRETE = (SingleProcess, MPIComm, DeviceComm, NcclComm)
# a class that defines one of these is a communicator (model_parallel.Group's allreduce/allgather are not)
SIGNS = ("iallreduce", "allgatherv", "reduce_scatterv", "bcast_obj", "allgather_obj", "split_shared")


def _distributed_modules():
    return [importlib.import_module(m.name) for m in
            pkgutil.walk_packages(pydtnn.distributed.__path__, "pydtnn.distributed.")]


def _subclasses(cls):
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_every_communicator_subclasses_the_contract_and_forwards_nothing():
    looks_like = {cls for mod in _distributed_modules() for _, cls in inspect.getmembers(mod, inspect.isclass)
                  if cls.__module__ == mod.__name__ and cls is not Communicator
                  and any(sign in vars(cls) for sign in SIGNS)}
    assert looks_like == set(CONCRETE)
    assert {c for c in _subclasses(Communicator) if c.__module__.startswith("pydtnn.")} == set(CONCRETE)
    for cls in CONCRETE:
        assert all("__getattr__" not in vars(k) for k in cls.__mro__ if k is not object), cls
    forwarding = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in sorted((ROOT / "pydtnn").rglob("*.py"))
                  for node in ast.walk(ast.parse(p.read_text()))
                  if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
                  and "distributed" in p.parts]
    assert forwarding == []


def test_each_communicator_defines_every_collective_and_inherits_only_the_generic_ones():
    public = {n for n, v in vars(Communicator).items() if callable(v) and not n.startswith("_")}
    assert public == set(COLLECTIVES) | set(GENERIC)  # a new method of the base is classified in one of them
    for cls in CONCRETE:
        missing = [op for op in COLLECTIVES if op not in vars(cls)]
        assert missing == [], f"{cls.__name__} inherits {missing}: define each (implement, delegate or refuse)"
        assert vars(cls).get("device", None) in ("cpu", "gpu", "nccl"), cls


def test_the_base_refuses_what_a_subclass_leaves_out_naming_both():
    class Bare(Communicator):
        name, rank, size = "bare", 0, 2

    comm = Bare()
    calls = {"allreduce": (np.zeros(2),), "iallreduce": (np.zeros(2),), "bcast": (np.zeros(2),),
             "allgatherv": (np.zeros(1), np.zeros(2), [1, 1]), "iallgatherv": (np.zeros(1), np.zeros(2), [1, 1]),
             "reduce_scatterv": (np.zeros(2), np.zeros(1), [1, 1]),
             "ireduce_scatterv": (np.zeros(2), np.zeros(1), [1, 1]),
             "alltoallv": (np.zeros(2), [1, 1], np.zeros(2), [1, 1]),
             "ireduce": (np.zeros(2),), "ibcast": (np.zeros(2),), "bcast_obj": ({},), "allgather_obj": ({},),
             "split": (0, 0), "split_shared": (), "progress_thread": (), "barrier": (), "abort": ()}
    assert set(calls) == set(COLLECTIVES)
    for op, args in calls.items():
        with pytest.raises(CollectiveUnsupported) as e:
            getattr(comm, op)(*args)
        msg = str(e.value)
        assert msg.startswith(f"{op}: this run's communicator is bare; expected") and f"Bare does not override " \
            f"Communicator.{op}" in msg and "\n" not in msg, msg
    assert isinstance(CollectiveUnsupported("x"), ConfigError)  # one line at the command line, exit code 2
    assert comm.settle() is None and comm.check_errors() is None
    assert (comm.stall_timeout, comm.debug, comm.seq, comm.device) == (None, False, 0, "cpu")


def _probes(path):
    """getattr/hasattr calls in `path`, except those on the MPI module (its constants, by name)."""
    for node in ast.walk(ast.parse(path.read_text())):
        probe = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id in ("getattr", "hasattr"))
        if probe and (not node.args or ast.unparse(node.args[0]) not in ("self.MPI", "MPI")):
            yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"


def test_no_probing_of_communicators_or_reducers():
    """Capabilities are the contract's (comm.device, comm.progress_thread(), comm.settle(), ...): no getattr or
    hasattr in pydtnn/distributed (communicator.py aside) or in the step prediction, but on the MPI module."""
    files = [p for p in sorted((ROOT / "pydtnn" / "distributed").rglob("*.py")) if p.name != "communicator.py"]
    files.append(ROOT / "pydtnn" / "perfmodel" / "predict.py")
    found = [probe for p in files for probe in _probes(p)]
    assert found == []


# -- DeviceComm over a fake host communicator, with a fake device array -------------------------------
class _DeviceArray:
    """A stand-in CuPy array (its module is cupy's, as is_device_array checks) over a NumPy array."""

    def __init__(self, values, view=False):
        self.values = values if view else np.array(values)
        self.shape, self.dtype, self.size, self.nbytes = (self.values.shape, self.values.dtype, self.values.size,
                                                          self.values.nbytes)

    def get(self, out):
        out[...] = self.values

    def set(self, host):
        self.values[...] = host

    def __getitem__(self, index):  # a view, as CuPy's slices are
        return _DeviceArray(self.values[index], view=True)

    def __setitem__(self, index, other):
        self.values[index] = other.values if isinstance(other, _DeviceArray) else other

    def copy(self):
        return _DeviceArray(self.values)


_DeviceArray.__module__ = "cupy._stand_in"


class _Host(Communicator):
    """Two ranks over MPI as seen from rank 0: the other rank's data is rank 0's plus 100. Records the types of
    the buffers it is given; MPI would take only host arrays from a library that is not CUDA-aware."""

    name, device, rank, size = "mpi", "cpu", 0, 2

    def __init__(self):
        self.given = []

    def allgatherv(self, send, recv, counts, label=""):
        self.given += [type(send), type(recv)]
        if isinstance(recv, np.ndarray):  # a CUDA-aware MPI would fill a device array alike
            recv[: counts[0]] = send
            recv[counts[0]:] = send + 100
        return recv

    def reduce_scatterv(self, send, recv, counts, label=""):
        self.given += [type(send), type(recv)]
        recv[...] = 2 * send[: counts[0]] + 100
        return recv


@pytest.fixture
def fake_cupy(monkeypatch):
    synced = []
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(
        synchronize=lambda: synced.append(1)))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda n, dtype: np.empty(n, dtype)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    return synced


def test_device_comm_stages_allgatherv_and_reduce_scatterv_through_the_host(fake_cupy):
    """Device arrays never reach a host-only MPI: each is copied to a host buffer, the collective runs there,
    and the result comes back into the device array (allgatherv is topk's; reduce_scatterv is the contract's,
    for any caller of device arrays)."""
    host = _Host()
    comm = DeviceComm(host, cuda_aware=False)
    send, recv = _DeviceArray(np.arange(3.0)), _DeviceArray(np.zeros(6))
    assert comm.allgatherv(send, recv, [3, 3], "topk values") is recv
    np.testing.assert_array_equal(recv.values, [0, 1, 2, 100, 101, 102])
    out = _DeviceArray(np.zeros(3))
    comm.reduce_scatterv(_DeviceArray(np.arange(6.0)), out, [3, 3], "dx")
    np.testing.assert_array_equal(out.values, [100, 102, 104])
    assert host.given == [np.ndarray] * 4
    assert len(fake_cupy) == 2  # each result reached its device array before its host buffer went back to the pool
    direct = _Host()
    DeviceComm(direct, cuda_aware=True).allgatherv(send, _DeviceArray(np.zeros(6)), [3, 3])
    assert direct.given == [_DeviceArray, _DeviceArray]  # CUDA-aware MPI takes device buffers as they are


def test_device_comm_gathers_a_layers_parameters_through_the_host_and_is_done_at_once(fake_cupy):
    """iallgatherv (ZeRO stage 3's gather of a layer's parameters) of device arrays: staged through the host as
    allgatherv is, the request it returns already complete."""
    host = _Host()
    send, recv = _DeviceArray(np.arange(2.0)), _DeviceArray(np.zeros(4))
    assert DeviceComm(host, cuda_aware=False).iallgatherv(send, recv, [2, 2], "zero gather 0").test()
    np.testing.assert_array_equal(recv.values, [0, 1, 100, 101])
    assert host.given == [np.ndarray] * 2


def test_device_comm_reduce_scatters_in_place_through_the_host(fake_cupy):
    """ireduce_scatterv with recv None (ZeRO stage 2's, in place): this rank's block of the sum lands at the start
    of the device array, the rest as it was, and the request is done when it returns."""
    comm = DeviceComm(_Host(), cuda_aware=False)
    send = _DeviceArray(np.arange(6.0))
    assert comm.ireduce_scatterv(send, None, [3, 3], "zero bucket 0").test()
    np.testing.assert_array_equal(send.values, [100, 102, 104, 3, 4, 5])


def test_device_comm_refuses_the_hierarchical_reducers_collectives_in_one_line(fake_cupy):
    comm = DeviceComm(_Host(), cuda_aware=False)
    for op, args in (("split", (0, 0)), ("split_shared", ()), ("ireduce", (None,)), ("ibcast", (None,))):
        with pytest.raises(CollectiveUnsupported, match=f"^{op}: this run's communicator is mpi\\+host-staged; "
                                                        "expected mpi or single"):
            getattr(comm, op)(*args)
    assert comm.device == "gpu" and comm.stall_timeout is None and comm.debug is False


@pytest.mark.parametrize("device", ["gpu", "nccl"])
def test_the_registry_stages_topk_on_a_gpu_and_refuses_what_cannot_run_there(device):
    """--enable_gpu --reduction topk: its allgathers are staged through the host (above), so it is taken;
    hierarchical (host MPI groups) and, with NCCL, the progress thread are refused in one line each."""
    assert reducers.validate("topk", "none", "test", device) is None
    assert reducers.validate("bucketed", "fp16", "test", device) is None
    with pytest.raises(ConfigError) as e:
        reducers.validate("hierarchical", "none", "test", device)
    assert str(e.value).startswith(f"hierarchical reducer: device '{device}'; expected cpu (on a GPU over ")
    assert "blocking, per_layer, bucketed, topk" in str(e.value)
    if device == "nccl":
        with pytest.raises(ConfigError, match="bucketed reducer: progress 'thread' on device 'nccl'; expected test"):
            reducers.validate("bucketed", "none", "thread", device)
    else:
        assert reducers.validate("bucketed", "none", "thread", device) is None


def test_create_checks_the_combination_against_the_communicators_device():
    class OnNccl(SingleProcess):
        name, device, size = "nccl", "nccl", 2

    with pytest.raises(ConfigError, match=r"^hierarchical reducer: device 'nccl'; expected cpu"):
        reducers.create("hierarchical", OnNccl())
    with pytest.raises(ConfigError, match=r"^blocking reducer: unknown option 'bucket_mb'; expected none"):
        reducers.create("blocking", SingleProcess(), bucket_mb=4.0)
    with pytest.raises(ConfigError, match=r"^unknown reduction strategy 'ring'; expected one of blocking, "):
        reducers.validate("ring")
    with pytest.raises(ConfigError, match=r"^unknown progress 'background'; expected one of test, thread$"):
        reducers.validate("bucketed", progress="background")
