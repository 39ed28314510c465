"""Collectives on GPU arrays: NCCL on its own CUDA stream, or MPI (CUDA-aware, or through pinned host memory).

Two Communicators (communicator.py), for the GPU backend; each defines every collective of the contract:

- DeviceComm wraps the MPI communicator (MPIComm or SingleProcess). Host arrays go straight through.
  Device arrays go straight through too when the MPI library is CUDA-aware: PYDTNN_CUDA_AWARE_MPI=1
  (or 0) says so, otherwise the library's own MPIX_Query_cuda_support() is asked (Open MPI and
  MPICH builds with CUDA have it). Else they are staged through page-locked host buffers, taken
  from a pool by size for each collective and returned when it completes. float16 (fp16 gradient
  compression) is always staged: its sum is a Python operator that reads host memory. The trainer,
  BatchNorm synchronization and the start-of-run broadcast use it; so do the reducers when NCCL is off.
- NcclComm reduces gradients with NCCL. Each reduction runs on a dedicated stream, after an event
  recorded on the computing stream once the gradients are produced, so it overlaps the rest of
  backward; wait() makes the computing stream wait for it (the host does not block). The NCCL unique
  id travels from rank 0 over MPI as JSON (a list of byte values, and whether CuPy gave bytes, as
  CuPy 14 does, or signed chars, as CuPy 13 does). Every reduction checks NCCL's asynchronous errors;
  settle() waits from the host for what is queued, watched by stall_timeout like MPI's collectives.
  Collectives of other kinds go to the wrapped DeviceComm, each by its own method.

Neither module imports CuPy until it is constructed: the CPU path never touches it.
"""

import contextlib
import socket
import sys
import time

import numpy as np

from pydtnn import env
from pydtnn.backends import is_device_array
from pydtnn.distributed.communicator import Communicator, Completed
from pydtnn.errors import ConfigError


def mpi_cuda_aware():
    """Whether MPI accepts device pointers: PYDTNN_CUDA_AWARE_MPI if set (1 or 0), else the library's
    MPIX_Query_cuda_support() (False when the library has no such function).

    The function is looked up in every MPI library mapped into the process (/proc/self/maps: mpi4py
    may load libmpi itself rather than link it), then through mpi4py's module (its dependencies), then
    in the global namespace. A yes means MPI takes device buffers; it does not promise that their
    non-blocking reductions progress without the host, so reductions still overlap only as far as
    the MPI library progresses them."""
    said = env.cuda_aware_mpi()
    if said is not None:
        return said
    try:
        import ctypes

        from mpi4py import MPI
    except ImportError:
        return False
    for handle in (*loaded_mpi_libraries(), MPI.__file__, None):
        try:
            query = ctypes.CDLL(handle).MPIX_Query_cuda_support
        except (AttributeError, OSError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


def loaded_mpi_libraries(maps="/proc/self/maps"):
    """Paths of the MPI libraries mapped into this process (libmpi*, libmpich*), in the order first mapped."""
    found = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/") and name.startswith(("libmpi.", "libmpich.", "libmpi_")) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


# what a device communicator answers for the hierarchical reducer's collectives
HOST_ONLY = ("mpi or single (the hierarchical reducer reduces host arrays; on a GPU use blocking, per_layer, "
             "bucketed or topk)")


class DeviceComm(Communicator):
    """MPI collectives that also take CuPy arrays, over the host communicator `comm` (see the module docstring).

    Every collective is defined here: those on arrays go to MPI directly (host arrays; device arrays when
    MPI is CUDA-aware) or staged through page-locked host buffers; the others go to `comm` by name; the
    hierarchical reducer's (ireduce, ibcast, split, split_shared) are refused.
    """

    device = "gpu"

    def __init__(self, comm, cuda_aware=None):
        import cupy

        self.cupy, self.comm = cupy, comm
        self.rank, self.size = comm.rank, comm.size
        self.cuda_aware = (comm.size > 1 and mpi_cuda_aware()) if cuda_aware is None else cuda_aware
        self.name = f"{comm.name}+{'cuda-aware' if self.cuda_aware else 'host-staged'}"
        self._pool = {}  # (nbytes, dtype) -> free page-locked host buffers

    # the host communicator's watch settings and collective count
    stall_timeout = property(lambda self: self.comm.stall_timeout)
    debug = property(lambda self: self.comm.debug)
    seq = property(lambda self: self.comm.seq)

    # -- staging -------------------------------------------------------------------------
    def _take(self, buf, copy=True):
        """A page-locked host buffer shaped like device buffer `buf`, holding a copy of it when `copy`."""
        free = self._pool.setdefault((buf.nbytes, buf.dtype.str), [])
        if free:
            host = free.pop()
        else:
            import cupyx

            host = cupyx.empty_pinned(buf.size, buf.dtype)
        host = host.reshape(buf.shape)
        if copy:
            buf.get(out=host)  # synchronous: the collective starts on complete data
        return host

    def _give(self, host):
        self._pool[(host.nbytes, host.dtype.str)].append(host.reshape(-1))

    def _bring_back(self, buf, host):
        """Copy the collective's result in `host` into device array `buf`; `host` then returns to the pool."""
        buf.set(host)
        self.cupy.cuda.get_current_stream().synchronize()  # the copy has left `host` before it is reused
        self._give(host)

    def _direct(self, buf):
        """Whether `buf` can go to MPI as it is; a device array is then complete (stream synchronized)."""
        if not is_device_array(buf):
            return True
        if self.cuda_aware and buf.dtype != np.float16:
            self.cupy.cuda.get_current_stream().synchronize()
            return True
        return False

    # -- collectives on arrays -----------------------------------------------------------
    def allreduce(self, buf, label=""):
        if self.size == 1 or self._direct(buf):
            return self.comm.allreduce(buf, label)
        host = self._take(buf)
        self.comm.allreduce(host, label)
        self._bring_back(buf, host)
        return buf

    def iallreduce(self, buf, label=""):
        if self.size == 1 or self._direct(buf):
            return self.comm.iallreduce(buf, label)
        host = self._take(buf)
        return _StagedRequest(self, self.comm.iallreduce(host, label), buf, host)

    def allgatherv(self, send, recv, counts, label=""):
        """As Communicator.allgatherv; device arrays that MPI cannot take travel through host buffers."""
        return self._staged(self.comm.allgatherv, send, recv, counts, label)

    def iallgatherv(self, send, recv, counts, label=""):
        """allgatherv, completed before it returns (staged through the host where MPI cannot take the arrays):
        the request it returns is done."""
        self.allgatherv(send, recv, counts, label)
        return Completed()

    def reduce_scatterv(self, send, recv, counts, label=""):
        """As Communicator.reduce_scatterv; device arrays that MPI cannot take travel through host buffers."""
        return self._staged(self.comm.reduce_scatterv, send, recv, counts, label)

    def ireduce_scatterv(self, send, recv, counts, label=""):
        """reduce_scatterv, completed before it returns (staged through the host where MPI cannot take the
        arrays): the request it returns is done. recv None: this rank's block copied to the start of send."""
        out = self.reduce_scatterv(send, send[: counts[self.rank]].copy() if recv is None else recv, counts, label)
        if recv is None:
            send[: counts[self.rank]] = out
        return Completed()

    def _staged(self, collective, send, recv, counts, label):
        """collective(send, recv, counts, label) of the host communicator, on send and recv as they are where
        MPI takes them, else on page-locked host copies (recv's copied back); returns recv."""
        if self.size == 1 or (self._direct(send) and self._direct(recv)):
            return collective(send, recv, counts, label)
        host_send = self._take(send) if is_device_array(send) else send
        host_recv = self._take(recv, copy=False) if is_device_array(recv) else recv
        collective(host_send, host_recv, counts, label)
        if host_recv is not recv:
            self._bring_back(recv, host_recv)
        if host_send is not send:
            self._give(host_send)
        return recv

    def ireduce(self, buf, root=0, label=""):
        raise self.refuse("ireduce", HOST_ONLY)

    def alltoallv(self, send, send_counts, recv, recv_counts, label=""):
        raise self.refuse("alltoallv", "mpi or single (the oktopk reducer's exchange runs on host arrays)")

    def ibcast(self, buf, root=0, label=""):
        raise self.refuse("ibcast", HOST_ONLY)

    def bcast(self, buf, root=0):
        if self.size == 1 or self._direct(buf):
            return self.comm.bcast(buf, root)
        host = self._take(buf)
        self.comm.bcast(host, root)
        self._bring_back(buf, host)
        return buf

    # -- small objects, groups, control --------------------------------------------------
    def bcast_obj(self, obj, root=0):
        return self.comm.bcast_obj(obj, root)

    def allgather_obj(self, obj):
        return self.comm.allgather_obj(obj)

    def allreduce_sum(self, values, label="metrics"):
        return self.comm.allreduce_sum([float(v) for v in values], label)

    def split(self, color, key):
        raise self.refuse("split", "mpi or single (groups of GPU processes are split from the host communicator "
                                   "before it is wrapped)")

    def split_shared(self):
        raise self.refuse("split_shared", "mpi or single (the hierarchical reducer reduces host arrays; on a GPU "
                                          "use blocking, per_layer, bucketed or topk)")

    def progress_thread(self, interval=None):
        """The host communicator's progress thread: it tests the MPI requests behind staged ones too."""
        return self.comm.progress_thread(interval)

    def barrier(self):
        self.comm.barrier()

    def abort(self, code=1):
        self.comm.abort(code)


class _StagedRequest:
    def __init__(self, owner, req, buf, host):
        self.owner, self.req, self.buf, self.host, self.done = owner, req, buf, host, False

    def test(self):
        return self.req.test()

    def wait(self):
        if not self.done:
            self.req.wait()
            self.owner._bring_back(self.buf, self.host)  # queued on the current stream, before any later use of buf
            self.done = True


class NcclComm(Communicator):
    """Gradient allreduce over NCCL on a side stream; every other collective through `comm` (a DeviceComm),
    by name, or refused (those of the hierarchical reducer and the progress thread)."""

    name = "nccl"
    device = "nccl"

    def __init__(self, comm):
        import cupy

        try:
            from cupy.cuda import nccl
        except ImportError as e:
            raise ConfigError(f"NcclComm: CuPy was built without NCCL ({e}); pip install nvidia-nccl-cu13 "
                              "(or -cu12)") from None
        if not nccl.available:
            raise ConfigError("NcclComm: CuPy cannot load the NCCL library; pip install nvidia-nccl-cu13 (or -cu12)")
        self.cupy, self.nccl, self.comm = cupy, nccl, comm
        self.rank, self.size = comm.rank, comm.size
        shared = shared_gpu(comm.allgather_obj((socket.gethostname(), cupy.cuda.Device().pci_bus_id)))
        if shared is not None:  # NCCL refuses it too, later and less clearly (ncclInvalidUsage)
            raise ConfigError(f"--enable_nccl: ranks {shared[0]} and {shared[1]} share the GPU {shared[3]} of node "
                              f"{shared[2]}; expected one GPU per rank: start at most as many ranks per node as it "
                              f"has GPUs, or leave NCCL off (MPI then reduces through host memory)")
        wire = comm.bcast_obj(nccl_id_to_wire(nccl.get_unique_id()) if comm.rank == 0 else None, root=0)
        self.nccl_comm = nccl.NcclCommunicator(comm.size, nccl_id_from_wire(wire), comm.rank)
        self._pending = []  # (event recorded after a reduction, its label, when it was queued)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._types = {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64}

    # the host communicator's watch settings and collective count
    stall_timeout = property(lambda self: self.comm.stall_timeout)
    debug = property(lambda self: self.comm.debug)
    seq = property(lambda self: self.comm.seq)

    def iallreduce(self, buf, label=""):
        if not is_device_array(buf):
            return self.comm.iallreduce(buf, label)
        if not buf.flags.c_contiguous:
            raise ValueError(f"NCCL allreduce of {label or 'a buffer'}: expected a contiguous array")
        produced = self.cupy.cuda.Event(disable_timing=True)
        produced.record(self.cupy.cuda.get_current_stream())
        self.stream.wait_event(produced)  # after the kernels that wrote buf
        self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype], self.nccl.NCCL_SUM,
                                 self.stream.ptr)
        done = self.cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        self.check_errors()
        while self._pending and self._pending[0][0].done:  # one stream: they complete in order
            self._pending.pop(0)
        self._pending.append((done, label, time.monotonic()))
        return _NcclRequest(done)

    def check_errors(self):
        """Raise NCCL's asynchronous error of this communicator, if any (a failed peer, a network error)."""
        self.nccl_comm.check_async_error()

    def settle(self):
        """Wait, from the host, until every reduction queued so far has completed, checking NCCL's errors.
        With stall_timeout set, a reduction still running that long after it was queued is reported
        (one line, like MPIComm's stalls) and the job aborted, instead of the host blocking forever in the
        next read of a device value. The trainer calls it before it reads the loss."""
        stall = self.comm.stall_timeout
        pause = 0.0
        while self._pending:
            done, label, queued = self._pending[0]
            if done.done:
                self._pending.pop(0)
                continue
            self.check_errors()
            waited = time.monotonic() - queued
            if stall and waited > stall:
                print(f"pydtnn: error: rank {self.rank}: stalled {waited:.1f} s in NCCL allreduce"
                      f"{f' ({label})' if label else ''}; aborting (stall_timeout={stall:g} s)",
                      file=sys.stderr, flush=True)
                with contextlib.suppress(Exception):
                    self.nccl_comm.abort()
                self.abort(1)
                return
            time.sleep(pause)
            pause = min(pause + 1e-5, 1e-3)
        self.check_errors()

    def allreduce(self, buf, label=""):
        self.iallreduce(buf, label).wait()
        return buf

    def allgatherv(self, send, recv, counts, label=""):
        return self.comm.allgatherv(send, recv, counts, label)

    def iallgatherv(self, send, recv, counts, label=""):
        return self.comm.iallgatherv(send, recv, counts, label)

    def reduce_scatterv(self, send, recv, counts, label=""):
        return self.comm.reduce_scatterv(send, recv, counts, label)

    def ireduce_scatterv(self, send, recv, counts, label=""):
        return self.comm.ireduce_scatterv(send, recv, counts, label)

    def ireduce(self, buf, root=0, label=""):
        raise self.refuse("ireduce", HOST_ONLY)

    def alltoallv(self, send, send_counts, recv, recv_counts, label=""):
        raise self.refuse("alltoallv", "mpi or single (the oktopk reducer's exchange runs on host arrays)")

    def ibcast(self, buf, root=0, label=""):
        raise self.refuse("ibcast", HOST_ONLY)

    def bcast(self, buf, root=0):
        return self.comm.bcast(buf, root)

    def bcast_obj(self, obj, root=0):
        return self.comm.bcast_obj(obj, root)

    def allgather_obj(self, obj):
        return self.comm.allgather_obj(obj)

    def allreduce_sum(self, values, label="metrics"):
        return self.comm.allreduce_sum(values, label)

    def split(self, color, key):
        raise self.refuse("split", "mpi or single (an NCCL communicator is made for one group of processes)")

    def split_shared(self):
        raise self.refuse("split_shared", "mpi or single (the hierarchical reducer reduces host arrays; with NCCL "
                                          "use blocking, per_layer, bucketed or topk)")

    def progress_thread(self, interval=None):
        raise self.refuse("progress thread", "mpi (the thread tests MPI's requests; NCCL's reductions progress on "
                                             "their own stream: use progress test)")

    def barrier(self):
        self.comm.barrier()

    def abort(self, code=1):
        self.comm.abort(code)


def shared_gpu(places):
    """(rank a, rank b, host, bus id) of the first two ranks on one GPU, from every rank's (host, PCI bus id)
    in rank order; None when each rank has a GPU of its own."""
    first = {}
    for rank, (host, bus) in enumerate(places):
        key = (host, str(bus).lower())
        if key in first:
            return first[key][0], rank, host, first[key][1]
        first[key] = rank, bus
    return None


def nccl_id_to_wire(uid):
    """An NCCL unique id as a list of 128 byte values 0..255, for bcast_obj. CuPy 14 gives bytes; CuPy 13
    gives a tuple of signed chars (-128..127)."""
    values = [int(b) & 0xFF for b in uid]
    if len(values) != 128:
        raise ValueError(f"NCCL unique id of {len(values)} bytes; expected 128")
    return ["bytes" if isinstance(uid, (bytes, bytearray)) else "signed", values]


def nccl_id_from_wire(wire):
    """The id in the form rank 0's CuPy gave it (the same CuPy on every rank takes it back): bytes for
    CuPy 14, a tuple of signed ints for CuPy 13."""
    kind, values = wire
    if kind == "bytes":
        return bytes(values)
    return tuple(v - 256 if v > 127 else v for v in values)


class _NcclRequest:
    def __init__(self, done):
        self.done_event = done

    def test(self):
        return self.done_event.done

    def wait(self):
        import cupy

        cupy.cuda.get_current_stream().wait_event(self.done_event)  # ordering on the device, no host block
