"""Communicators over MPI or within one process: the Communicator contract (communicator.py) for CPU arrays.

Arrays are reduced in place. Non-blocking reductions return a request with test() and wait();
MPI makes no progress in the background here, so whoever starts one should call test() now and then,
or hand it to a ProgressThread, which does so from a helper thread.

MPIComm numbers every collective and watches its waits through a StallWatch (stall_watch.py):
past stall_timeout a wait reports the collective and the ranks that have not arrived, a rank that left
the job is named at once, and --debug_collectives compares every collective across the ranks first.
"""

import atexit
import json
import os
import sys
import threading
import time
import weakref

import numpy as np

from pydtnn.distributed.communicator import Communicator, Completed
from pydtnn.distributed.stall_watch import StallWatch
from pydtnn.errors import ConfigError


class SingleProcess(Communicator):
    """World of one: every collective is the identity (non-blocking ones complete at once)."""

    rank, size = 0, 1
    name = "single"
    device = "cpu"

    def allreduce(self, buf, label=""):
        return buf

    def iallreduce(self, buf, label=""):
        return Completed()

    def allgatherv(self, send, recv, counts, label=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def iallgatherv(self, send, recv, counts, label=""):
        recv[...] = send.reshape(recv.shape)
        return Completed()

    def reduce_scatterv(self, send, recv, counts, label=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def ireduce_scatterv(self, send, recv, counts, label=""):
        if recv is not None:  # in place (None), the sum of one rank is where it is
            recv[...] = send.reshape(recv.shape)
        return Completed()

    def ireduce(self, buf, root=0, label=""):
        return Completed()

    def alltoallv(self, send, send_counts, recv, recv_counts, label=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def ibcast(self, buf, root=0, label=""):
        return Completed()

    def bcast(self, buf, root=0):
        return buf

    def bcast_obj(self, obj, root=0):
        return obj

    def allgather_obj(self, obj):
        return [obj]

    def allreduce_sum(self, values, label="metrics"):
        """Sum of a small float vector over ranks (a new array); label names it in reports."""
        return np.array(values, dtype=np.float64)

    def split(self, color, key):
        return SingleProcess()

    def split_shared(self):
        return SingleProcess()

    def progress_thread(self, interval=None):
        raise self.refuse("progress thread", "mpi (the thread tests MPI's requests)")

    def barrier(self):
        pass

    def abort(self, code=1):
        raise SystemExit(code)


def _displacements(counts):
    """Each block's offset in a flat buffer of blocks of these counts, in order."""
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def abort_job(comm, code):
    """End every process of `comm`'s job with exit code `code` (MPI_Abort), after the messages are out.

    The MPI library's own abort line (MPICH: "Abort(2) on node 1 (rank 1 in comm 0): ...") would
    follow the one pydtnn printed and say less: this process's stderr is closed before the call.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)  # let the launcher forward the message before it kills every process
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    except OSError:  # keep the library's line rather than fail to abort
        pass
    comm.Abort(code)


class ProgressThread:
    """Enters MPI from a helper thread, every `interval` seconds while requests are outstanding, so that
    non-blocking collectives advance while the caller computes.

    MPI here moves a message only while some thread is inside an MPI call. The thread tests the
    requests handed to it with watch() (one Test each per round: MPICH's progress engine then advances
    every outstanding operation) and sleeps `interval` (None: INTERVAL) seconds between rounds, leaving the
    core to the caller.
    release() takes requests back before the caller waits on them itself, so that no request is ever
    tested by two threads at once. Needs MPI_THREAD_MULTIPLE (MPIComm.progress_thread checks).
    """

    INTERVAL = 2e-4  # seconds between rounds (docs/benchmarks.md, Background progress, measures this value)
    _live = weakref.WeakSet()  # stopped at exit, before MPI's own finalization (registered earlier)

    def __init__(self, interval=None):
        self.interval = self.INTERVAL if interval is None else interval
        self.rounds = 0  # rounds that tested at least one request
        self.error = None  # an exception raised by a Test, re-raised by release()
        self._cond = threading.Condition()
        self._reqs, self._stop = [], False
        self._thread = threading.Thread(target=self._run, name="pydtnn-mpi-progress", daemon=True)
        self._thread.start()
        if not ProgressThread._live:
            atexit.register(ProgressThread._close_all)
        ProgressThread._live.add(self)

    @staticmethod
    def _close_all():
        for t in list(ProgressThread._live):
            t.close()

    def watch(self, reqs):
        """Test these requests (objects with test()) from now on, until they complete or are released."""
        with self._cond:
            self._reqs.extend(reqs)
            self._cond.notify()

    def release(self, reqs):
        """Stop testing these requests; on return the thread is not inside a Test of any of them."""
        with self._cond:
            gone = {id(r) for r in reqs}
            self._reqs = [r for r in self._reqs if id(r) not in gone]
            if self.error is not None:
                raise self.error

    def close(self):
        """End the thread (a closed one tests nothing more)."""
        with self._cond:
            self._stop, self._reqs = True, []
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self):
        while True:
            with self._cond:
                while not self._reqs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                try:
                    self._reqs = [r for r in self._reqs if not r.test()]
                except Exception as e:  # the caller's own wait will meet the failure too; keep the first
                    self.error, self._reqs = e, []
                self.rounds += 1
            time.sleep(self.interval)


class MPIComm(Communicator):
    """mpi4py's COMM_WORLD (or a given communicator), with numbered and watched collectives (StallWatch)."""

    name = "mpi"
    device = "cpu"

    def __init__(self, comm=None, stall_timeout=None, debug=False):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.watch = StallWatch(self.comm, MPI, stall_timeout, debug, self.abort)
        self._fp16_sum = None  # MPI's operator summing float16, made when first needed

    @property
    def seq(self):
        """Collectives entered so far."""
        return self.watch.seq

    # the watch's settings, held by the watch alone
    stall_timeout = property(lambda self: self.watch.stall_timeout)
    debug = property(lambda self: self.watch.debug)

    # -- collectives ---------------------------------------------------------------------
    def allreduce(self, buf, label=""):
        what = self.watch.enter("allreduce", buf, label)
        msg, op = self._sum_of(buf)
        if not self.stall_timeout:
            self.comm.Allreduce(self.MPI.IN_PLACE, msg, op=op)
            return buf
        self.watch.wait(self.comm.Iallreduce(self.MPI.IN_PLACE, msg, op=op), what)
        return buf

    def iallreduce(self, buf, label=""):
        what = self.watch.enter("allreduce", buf, label)
        msg, op = self._sum_of(buf)
        return _MPIRequest(self.watch, self.comm.Iallreduce(self.MPI.IN_PLACE, msg, op=op), what)

    def allgatherv(self, send, recv, counts, label=""):
        """recv (flat, contiguous) = every rank's `send` in rank order; rank r sends counts[r] elements."""
        what = self.watch.enter("allgatherv", recv, label)
        counts = [int(c) for c in counts]
        if not self.stall_timeout:
            self.comm.Allgatherv(send, [recv, counts])
        else:
            self.watch.wait(self.comm.Iallgatherv(send, [recv, counts]), what)
        return recv

    def iallgatherv(self, send, recv, counts, label=""):
        """Start allgatherv; a request whose waits the stall watch watches."""
        what = self.watch.enter("allgatherv", recv, label)
        counts = [int(c) for c in counts]
        return _MPIRequest(self.watch, self.comm.Iallgatherv(send, [recv, counts]), what)

    def reduce_scatterv(self, send, recv, counts, label=""):
        """recv = rank r's block (counts[r] elements, rank order) of the sum over ranks of `send`."""
        what = self.watch.enter("reduce_scatterv", send, label)
        counts = [int(c) for c in counts]
        if not self.stall_timeout:
            self.comm.Reduce_scatter(send, recv, counts, op=self.MPI.SUM)
        else:
            self.watch.wait(self.comm.Ireduce_scatter(send, recv, counts, op=self.MPI.SUM), what)
        return recv

    def ireduce_scatterv(self, send, recv, counts, label=""):
        """Start reduce_scatterv; a request whose waits the stall watch watches."""
        what = self.watch.enter("reduce_scatterv", send, label)
        counts = [int(c) for c in counts]
        if recv is None:  # in place: this rank's block at the start of send
            req = self.comm.Ireduce_scatter(self.MPI.IN_PLACE, send, counts, op=self.MPI.SUM)
        else:
            req = self.comm.Ireduce_scatter(send, recv, counts, op=self.MPI.SUM)
        return _MPIRequest(self.watch, req, what)

    def alltoallv(self, send, send_counts, recv, recv_counts, label=""):
        """MPI_Alltoallv of flat contiguous arrays (MPICH posts its sends to rotating destinations: rank r to r + 1,
        r + 2, ...); compared across the ranks with --debug_collectives by its name alone (the counts differ)."""
        what = self.watch.enter("alltoallv", None, label)
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        spec = ([send, (sc, _displacements(sc))], [recv, (rc, _displacements(rc))])
        if not self.stall_timeout:
            self.comm.Alltoallv(*spec)
        else:
            self.watch.wait(self.comm.Ialltoallv(*spec), what)
        return recv

    def ireduce(self, buf, root=0, label=""):
        """Start a sum of `buf` over the ranks into root's `buf` (in place there; unchanged elsewhere)."""
        what = self.watch.enter("reduce", buf, label)
        msg, op = self._sum_of(buf)
        if self.rank == root:
            req = self.comm.Ireduce(self.MPI.IN_PLACE, msg, op=op, root=root)
        else:
            req = self.comm.Ireduce(msg, None, op=op, root=root)
        return _MPIRequest(self.watch, req, what)

    def ibcast(self, buf, root=0, label=""):
        """Start a broadcast of root's `buf` into every rank's."""
        what = self.watch.enter("bcast", buf, label)
        return _MPIRequest(self.watch, self.comm.Ibcast(buf, root=root), what)

    def bcast(self, buf, root=0):
        what = self.watch.enter("bcast", buf)
        if not self.stall_timeout:
            self.comm.Bcast(buf, root=root)
        else:
            self.watch.wait(self.comm.Ibcast(buf, root=root), what)
        return buf

    def _sum_of(self, buf):
        """(message, op) summing `buf`; float16, which MPI cannot add, travels as 16-bit words."""
        if buf.dtype != np.float16:
            return buf, self.MPI.SUM
        if self._fp16_sum is None:
            def add(inbuf, inoutbuf, datatype):
                out = np.frombuffer(inoutbuf, np.float16)
                out += np.frombuffer(inbuf, np.float16)

            self._fp16_sum = self.MPI.Op.Create(add, commute=True)
        return [buf.view(np.uint16), self.MPI.UINT16_T], self._fp16_sum

    # -- small objects -------------------------------------------------------------------
    def bcast_obj(self, obj, root=0):
        """A small JSON-serialisable object from root (sent as JSON text: nothing is unpickled)."""
        self.watch.enter("bcast_obj", None)
        if root == self.rank:
            data = np.frombuffer(json.dumps(obj).encode(), np.uint8).copy()
            size = np.array([data.size], np.int64)
        else:
            size = np.zeros(1, np.int64)
        self.bcast(size, root)
        if root != self.rank:
            data = np.empty(int(size[0]), np.uint8)
        self.bcast(data, root)
        return json.loads(data.tobytes().decode())

    def allgather_obj(self, obj):
        """[rank 0's obj, rank 1's, ...] of a small JSON-serialisable object (sent as JSON text)."""
        self.watch.enter("allgather_obj", None, compare=False)  # matches on every rank, --debug_collectives or not
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self.watch.run(self.comm.Iallgather, np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        self.watch.run(self.comm.Iallgatherv, data, [out, sizes])
        return [json.loads(part.tobytes().decode()) for part in np.split(out, np.cumsum(sizes)[:-1])]

    # -- groups, progress, control -------------------------------------------------------
    def split(self, color, key):
        """The communicator of the ranks that give the same `color`, ranked by `key`, with this one's
        stall_timeout and debug settings (a collective over this communicator)."""
        self.watch.enter("split", None)
        return MPIComm(self.comm.Split(int(color), int(key)), self.stall_timeout, self.debug)

    def split_shared(self):
        """The communicator of the ranks that share this one's memory (one node), with this one's settings."""
        self.watch.enter("split", None)
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        return MPIComm(node, self.stall_timeout, self.debug)

    def progress_thread(self, interval=None):
        """A ProgressThread for this communicator's requests; needs MPI_THREAD_MULTIPLE."""
        if self.MPI.Query_thread() != self.MPI.THREAD_MULTIPLE:
            levels = {getattr(self.MPI, f"THREAD_{n}"): n.lower() for n in ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")}
            raise ConfigError(f"progress thread: MPI was started with thread level "
                              f"{levels.get(self.MPI.Query_thread(), self.MPI.Query_thread())}; expected multiple "
                              "(mpi4py's default, mpi4py.rc.thread_level = 'multiple')")
        return ProgressThread(interval)

    def barrier(self):
        self.watch.enter("barrier", None)
        self.comm.Barrier()

    def abort(self, code=1):
        abort_job(self.comm, code)


class _MPIRequest:
    """A started MPI collective: test() lets it progress, wait() completes it (watched for stalls)."""

    def __init__(self, watch, req, what):
        self.watch, self.req, self.what, self.done = watch, req, what, False

    def test(self):
        if not self.done:
            self.done = self.req.Test()
        return self.done

    def wait(self):
        if not self.done:
            self.watch.wait(self.req, self.what)
            self.done = True
