"""The Communicator contract: every collective pydtnn uses, written once (ChainerMN's communicator_base).

    comm.allreduce(grads)              # in place, over every rank
    req = comm.iallreduce(bucket)      # started; req.test() lets it move, req.wait() completes it
    node = comm.split_shared()         # the ranks of this node, a Communicator of the same kind

Arrays are NumPy arrays, or CuPy arrays where `device` says the communicator takes them; buffers are
contiguous, and "in place" means the result is written into the caller's array. Every rank of the
communicator must call a collective, in the same order, with matching dtypes and counts.

Four communicators subclass it: comm.SingleProcess (a world of one), comm.MPIComm (mpi4py, with a stall
watch), gpu_comm.DeviceComm (CuPy arrays over MPI, staged through host memory unless MPI is CUDA-aware)
and gpu_comm.NcclComm (gradient allreduces over NCCL). Each defines every method of COLLECTIVES itself:
it implements it, delegates it by name to a communicator it holds, or refuses it with refuse(), one line
that names the communicator, the collective and what would take it. The methods of GENERIC have a
generic body here that a subclass may keep. Nothing is forwarded implicitly (no __getattr__).
"""

import numpy as np

from pydtnn.errors import ConfigError

# methods every concrete communicator defines itself (implemented, delegated, or refused)
COLLECTIVES = ("allreduce", "iallreduce", "allgatherv", "iallgatherv", "reduce_scatterv", "ireduce_scatterv", "ireduce",
               "alltoallv",
               "ibcast", "bcast", "bcast_obj", "allgather_obj", "split", "split_shared", "progress_thread", "barrier", "abort")
# methods with a generic body here, which a subclass may keep
GENERIC = ("allreduce_sum", "settle", "check_errors", "refuse")
DEVICES = ("cpu", "gpu", "nccl")  # the arrays a communicator's collectives take; see Communicator.device


class Completed:
    """The request of a non-blocking collective that completed before it returned."""

    def test(self):
        return True

    def wait(self):
        pass


class CollectiveUnsupported(ConfigError):
    """A collective that this run's communicator does not take (a reducer or layout it cannot serve)."""


class Communicator:
    """A group of `size` processes, this one being `rank` (0 .. size - 1), and its collectives.

    rank, size: set by every subclass (class or instance attributes).

    name: how messages call it ("single", "mpi", "mpi+host-staged", "nccl").
    device: the arrays its collectives take: "cpu" (NumPy), "gpu" (CuPy too, over MPI), "nccl" (CuPy,
    gradient allreduces over NCCL). The reducer registry checks a reducer against it.
    stall_timeout: seconds a collective may wait before the job is reported and aborted (None: off).
    debug: whether every collective is first compared across the ranks (--debug_collectives).
    seq: how many collectives this communicator has numbered (0 where it numbers none).
    """

    name = "communicator"
    device = "cpu"
    stall_timeout = None
    debug = False
    seq = 0

    def refuse(self, op, expected):
        """The error for collective `op` that this communicator does not take: one line naming it, this
        communicator and `expected`, what would take it. Raised by the caller: `raise self.refuse(...)`."""
        return CollectiveUnsupported(f"{op}: this run's communicator is {self.name}; expected {expected}")

    def _missing(self, op):
        return self.refuse(op, f"a communicator that implements it ({type(self).__name__} does not override "
                               f"Communicator.{op})")

    # -- collectives on arrays ---------------------------------------------------------------
    def allreduce(self, buf, label=""):
        """Sum `buf` (any shape) over the ranks, in place; returns buf. label names it in reports."""
        raise self._missing("allreduce")

    def iallreduce(self, buf, label=""):
        """Start allreduce(buf); returns a request: test() -> bool lets it progress and says whether it
        completed, wait() completes it. buf must not be touched until then."""
        raise self._missing("iallreduce")

    def allgatherv(self, send, recv, counts, label=""):
        """recv (flat, sum(counts) elements) = every rank's `send` in rank order; rank r sends counts[r]
        elements. Returns recv."""
        raise self._missing("allgatherv")

    def iallgatherv(self, send, recv, counts, label=""):
        """Start allgatherv(send, recv, counts); returns a request (test(), wait()). A count may be 0. Neither
        buffer may be touched until it completes."""
        raise self._missing("iallgatherv")

    def reduce_scatterv(self, send, recv, counts, label=""):
        """recv (counts[rank] elements) = this rank's block, in rank order of blocks of counts[r] elements, of
        the sum over the ranks of `send` (flat, sum(counts) elements). Returns recv."""
        raise self._missing("reduce_scatterv")

    def ireduce_scatterv(self, send, recv, counts, label=""):
        """Start reduce_scatterv(send, recv, counts); returns a request (test(), wait()). A count may be 0.
        recv None: in place, this rank's block written at the start of `send`. Neither buffer may be touched
        until it completes."""
        raise self._missing("ireduce_scatterv")

    def alltoallv(self, send, send_counts, recv, recv_counts, label=""):
        """Personalised exchange: this rank's `send` (flat) holds, in rank order, send_counts[r] elements for rank r;
        `recv` (flat, sum(recv_counts) elements) gets, in rank order, recv_counts[r] elements from rank r (what rank
        r's send_counts gave this rank). Counts may be 0. Returns recv."""
        raise self._missing("alltoallv")

    def ireduce(self, buf, root=0, label=""):
        """Start a sum of `buf` over the ranks into root's `buf` (in place there; unchanged elsewhere);
        returns a request (test(), wait())."""
        raise self._missing("ireduce")

    def ibcast(self, buf, root=0, label=""):
        """Start a broadcast of root's `buf` into every rank's; returns a request (test(), wait())."""
        raise self._missing("ibcast")

    def bcast(self, buf, root=0):
        """Root's `buf` into every rank's, in place; returns buf."""
        raise self._missing("bcast")

    # -- small objects -----------------------------------------------------------------------
    def bcast_obj(self, obj, root=0):
        """Root's `obj`, a small JSON-serialisable object, on every rank (nothing is unpickled)."""
        raise self._missing("bcast_obj")

    def allgather_obj(self, obj):
        """[rank 0's obj, rank 1's, ...] of a small JSON-serialisable object."""
        raise self._missing("allgather_obj")

    def allreduce_sum(self, values, label="metrics"):
        """The sum over the ranks of a short vector of floats, as a new float64 array of its length."""
        return self.allreduce(np.array(values, dtype=np.float64), label)

    # -- groups, progress, control -----------------------------------------------------------
    def split(self, color, key):
        """The communicator of the ranks that give the same `color`, ranked by `key`, with this one's
        settings (a collective over this communicator)."""
        raise self._missing("split")

    def split_shared(self):
        """The communicator of the ranks that share this one's memory (one node), with this one's settings."""
        raise self._missing("split_shared")

    def progress_thread(self, interval=None):
        """A helper thread that tests the requests handed to its watch() every `interval` seconds (None: its
        default), so that non-blocking collectives move while the caller computes; release() takes them back."""
        raise self._missing("progress_thread")

    def barrier(self):
        """Return once every rank has entered it."""
        raise self._missing("barrier")

    def abort(self, code=1):
        """End every process of the job with exit code `code` (one process: raise SystemExit(code))."""
        raise self._missing("abort")

    def settle(self):
        """Wait from the host until the reductions queued so far have completed (where they run on a device
        stream); watched by stall_timeout. Nothing to wait for here."""

    def check_errors(self):
        """Raise an error that a collective reported asynchronously (a failed peer), if any. None here."""
