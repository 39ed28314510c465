"""Communicators: the few collectives data parallelism needs, over MPI or within one process.

Arrays are reduced in place. Non-blocking reductions return a request with test() and wait();
MPI makes no progress in the background here, so whoever starts one should call test() now and then,
or hand it to a ProgressThread, which does so from a helper thread.

MPIComm numbers every collective. Two safety nets use the numbers:
- stall_timeout: waits poll instead of blocking; a wait longer than the timeout reports the
  collective and, on rank 0, which ranks have not arrived at it (every rank tells rank 0 the number
  of each collective it enters, with an 8-byte non-blocking send), then aborts the job.
  A process that ends without aborting tells rank 0 (and rank 0, ending, tells every rank) the last
  collective it entered; a rank waiting in a later one knows at once that it will never complete, says which
  rank left, and aborts the job instead of waiting for the timeout.
- debug: before every collective the ranks compare (operation, dtype, element count, number) and
  the first mismatch is raised as an error naming each rank's call, instead of hanging or corrupting.
"""

import atexit
import json
import os
import sys
import threading
import time
import weakref

import numpy as np

from pydtnn.errors import PydtnnError


# A wait spins (yielding the core) this long before it starts to sleep between polls: a sleep lasts
# 60 us or more, about twenty times a small collective's own time. Not where a node's ranks outnumber
# its cores: there the spinning rank would hold a core that the rank it waits for needs.
SPIN_S = 2e-3


class CollectiveMismatch(PydtnnError):
    """Ranks issued different collectives (found by --debug_collectives)."""


class SingleProcess:
    """World of one: every collective is the identity."""

    rank, size = 0, 1
    name = "single"

    def allreduce(self, buf, label=""):
        return buf

    def iallreduce(self, buf, label=""):
        return _Done()

    def bcast(self, buf, root=0):
        return buf

    def bcast_obj(self, obj, root=0):
        return obj

    def allgather_obj(self, obj):
        return [obj]

    def allgatherv(self, send, recv, counts, label=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def reduce_scatterv(self, send, recv, counts, label=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def allreduce_sum(self, values, label="metrics"):
        """Sum of a small float vector over ranks (a new array); label names it in reports."""
        return np.array(values, dtype=np.float64)

    def barrier(self):
        pass

    def abort(self, code=1):
        raise SystemExit(code)


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


class _Done:
    def test(self):
        return True

    def wait(self):
        pass


class ProgressThread:
    """Enters MPI from a helper thread, every `interval` seconds while requests are outstanding, so that
    non-blocking collectives advance while the caller computes.

    MPI here moves a message only while some thread is inside an MPI call. The thread tests the
    requests handed to it with watch() (one Test each per round: MPICH's progress engine then advances
    every outstanding operation) and sleeps `interval` between rounds, leaving the core to the caller.
    release() takes requests back before the caller waits on them itself, so that no request is ever
    tested by two threads at once. Needs MPI_THREAD_MULTIPLE (MPIComm.progress_thread checks).
    """

    INTERVAL = 2e-4  # seconds between rounds (docs/benchmarks.md, Background progress, measures this value)
    _live = weakref.WeakSet()  # stopped at exit, before MPI's own finalization (registered earlier)

    def __init__(self, interval=INTERVAL):
        self.interval = interval
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


_ARRIVE, _LEFT = 7707, 7708  # tags of arrival notes and of rank 0's departure note
_SIG_BYTES = 64  # a collective's signature for --debug_collectives


class MPIComm:
    """mpi4py's COMM_WORLD (or a given communicator), with numbered collectives."""

    name = "mpi"

    def __init__(self, comm=None, stall_timeout=None, debug=False):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.stall_timeout, self.debug = stall_timeout, debug
        self.seq = 0  # collectives entered so far
        self.current = None  # (op, number, label, buffer) of the collective being entered
        # arrival notes travel apart from the collectives; made whatever the flags, so that ranks
        # started with different ones still reach the start-up comparison that names the difference
        self.side = self.comm.Dup()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.spin_s = SPIN_S if node.Get_size() <= len(os.sched_getaffinity(0)) else 0.0
        node.Free()
        if stall_timeout:
            self._sends = []
            self.left = {}  # rank -> last collective it entered, for processes that have ended
            if self.rank == 0:
                self.board = np.zeros(self.size, np.int64)  # last collective each rank entered
                self._bufs = [np.zeros(1, np.int64) for _ in range(self.size)]
                self._recvs = [self.side.Irecv(self._bufs[r], source=r, tag=_ARRIVE) if r else None
                               for r in range(self.size)]
            else:
                self._root_note = np.zeros(1, np.int64)
                self._root_left = self.side.Irecv(self._root_note, source=0, tag=_LEFT)
            atexit.register(self._close_side)

    # -- collectives ---------------------------------------------------------------------
    def allreduce(self, buf, label=""):
        self._enter("allreduce", buf, label)
        msg, op = self._sum_of(buf)
        if not self.stall_timeout:
            self.comm.Allreduce(self.MPI.IN_PLACE, msg, op=op)
            return buf
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, msg, op=op), self.current)
        return buf

    def iallreduce(self, buf, label=""):
        self._enter("allreduce", buf, label)
        msg, op = self._sum_of(buf)
        return _MPIRequest(self, self.comm.Iallreduce(self.MPI.IN_PLACE, msg, op=op), self.current)

    def allgatherv(self, send, recv, counts, label=""):
        """recv (flat, contiguous) = every rank's `send` in rank order; rank r sends counts[r] elements."""
        self._enter("allgatherv", recv, label)
        counts = [int(c) for c in counts]
        if not self.stall_timeout:
            self.comm.Allgatherv(send, [recv, counts])
        else:
            self._wait(self.comm.Iallgatherv(send, [recv, counts]), self.current)
        return recv

    def reduce_scatterv(self, send, recv, counts, label=""):
        """recv = rank r's block (counts[r] elements, rank order) of the sum over ranks of `send`."""
        self._enter("reduce_scatterv", send, label)
        counts = [int(c) for c in counts]
        if not self.stall_timeout:
            self.comm.Reduce_scatter(send, recv, counts, op=self.MPI.SUM)
        else:
            self._wait(self.comm.Ireduce_scatter(send, recv, counts, op=self.MPI.SUM), self.current)
        return recv

    def ireduce(self, buf, root=0, label=""):
        """Start a sum of `buf` over the ranks into root's `buf` (in place there; unchanged elsewhere)."""
        self._enter("reduce", buf, label)
        msg, op = self._sum_of(buf)
        if self.rank == root:
            req = self.comm.Ireduce(self.MPI.IN_PLACE, msg, op=op, root=root)
        else:
            req = self.comm.Ireduce(msg, None, op=op, root=root)
        return _MPIRequest(self, req, self.current)

    def ibcast(self, buf, root=0, label=""):
        """Start a broadcast of root's `buf` into every rank's."""
        self._enter("bcast", buf, label)
        return _MPIRequest(self, self.comm.Ibcast(buf, root=root), self.current)

    def split_shared(self):
        """The communicator of the ranks that share this one's memory (one node), with this one's settings."""
        self._enter("split", None)
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        return MPIComm(node, self.stall_timeout, self.debug)

    def progress_thread(self, interval=ProgressThread.INTERVAL):
        """A ProgressThread for this communicator's requests; needs MPI_THREAD_MULTIPLE."""
        if self.MPI.Query_thread() != self.MPI.THREAD_MULTIPLE:
            from pydtnn.errors import ConfigError

            levels = {getattr(self.MPI, f"THREAD_{n}"): n.lower() for n in ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")}
            raise ConfigError(f"progress thread: MPI was started with thread level "
                              f"{levels.get(self.MPI.Query_thread(), self.MPI.Query_thread())}; expected multiple "
                              "(mpi4py's default, mpi4py.rc.thread_level = 'multiple')")
        return ProgressThread(interval)

    def split(self, color, key):
        """The communicator of the ranks that give the same `color`, ranked by `key`, with this one's
        stall_timeout and debug settings (a collective over this communicator)."""
        self._enter("split", None)
        return MPIComm(self.comm.Split(int(color), int(key)), self.stall_timeout, self.debug)

    def _sum_of(self, buf):
        """(message, op) summing `buf`; float16, which MPI cannot add, travels as 16-bit words."""
        if buf.dtype != np.float16:
            return buf, self.MPI.SUM
        if not hasattr(self, "_fp16_sum"):
            def add(inbuf, inoutbuf, datatype):
                out = np.frombuffer(inoutbuf, np.float16)
                out += np.frombuffer(inbuf, np.float16)

            self._fp16_sum = self.MPI.Op.Create(add, commute=True)
        return [buf.view(np.uint16), self.MPI.UINT16_T], self._fp16_sum

    def bcast(self, buf, root=0):
        self._enter("bcast", buf)
        if not self.stall_timeout:
            self.comm.Bcast(buf, root=root)
        else:
            self._wait(self.comm.Ibcast(buf, root=root), self.current)
        return buf

    def bcast_obj(self, obj, root=0):
        """A small JSON-serialisable object from root (sent as JSON text: nothing is unpickled)."""
        self._enter("bcast_obj", None)
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
        self._enter("allgather_obj", None, compare=False)  # matches on every rank, --debug_collectives or not
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self._run(self.comm.Iallgather, np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        self._run(self.comm.Iallgatherv, data, [out, sizes])
        return [json.loads(part.tobytes().decode()) for part in np.split(out, np.cumsum(sizes)[:-1])]

    def _run(self, nonblocking, *args):
        """A non-blocking collective, waited for (watched for stalls when stall_timeout is set).

        Always non-blocking: a blocking and a non-blocking collective do not match in MPI, and these
        run before the ranks have checked that they agree on stall_timeout.
        """
        self._wait(nonblocking(*args), self.current)

    def allreduce_sum(self, values, label="metrics"):
        buf = np.array(values, dtype=np.float64)
        return self.allreduce(buf, label)

    def barrier(self):
        self._enter("barrier", None)
        self.comm.Barrier()

    def abort(self, code=1):
        abort_job(self.comm, code)

    # -- numbering, checks, stalls ---------------------------------------------------------
    def _enter(self, op, buf, label="", compare=True):
        self.seq += 1
        self.current = (op, self.seq, label, buf)  # described only when a report needs it
        if self.stall_timeout:  # the note first: the check below is itself watched for stalls
            if self.rank:
                note = np.array([self.seq], np.int64)
                self._sends = [(r, b) for r, b in self._sends if not r.Test()]
                self._sends.append((self.side.Isend(note, dest=0, tag=_ARRIVE), note))
            else:
                self.board[0] = self.seq
                self._drain()
        if self.debug and compare:
            self._compare_signatures(op, buf)

    def _compare_signatures(self, op, buf):
        """--debug_collectives: every rank's (operation, dtype, element count, number), as fixed-size text."""
        sig = f"{op} {'-' if buf is None else buf.dtype.name} x {0 if buf is None else int(buf.size)} (#{self.seq})"
        mine = np.frombuffer(sig.encode().ljust(_SIG_BYTES)[:_SIG_BYTES], np.uint8)
        every = np.empty((self.size, _SIG_BYTES), np.uint8)
        self._run(self.comm.Iallgather, mine, every)
        sigs = [row.tobytes().rstrip().decode(errors="replace") for row in every]
        if any(s != sigs[0] for s in sigs):
            calls = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
            raise CollectiveMismatch(f"collective #{self.seq} differs between ranks: {calls}")

    def _drain(self):
        """Take the notes that arrived; rank 0 learns who entered what, other ranks whether rank 0 left."""
        if self.rank:
            if self.left.get(0) is None and self._root_left.Test():
                self.left[0] = int(self._root_note[0])
            return
        for r in range(1, self.size):
            while r not in self.left and self._recvs[r].Test():
                note = int(self._bufs[r][0])
                if note < 0:  # a departure: -(last collective entered) - 1
                    self.board[r] = self.left[r] = -note - 1
                else:
                    self.board[r] = note
                    self._recvs[r] = self.side.Irecv(self._bufs[r], source=r, tag=_ARRIVE)

    @staticmethod
    def describe(what):
        """'allreduce #12 (bucket 0) [float32 x 1024]' for a collective recorded by _enter."""
        op, seq, label, buf = what
        return f"{op} #{seq}" + (f" ({label})" if label else "") + (
            f" [{buf.dtype.name} x {buf.size}]" if buf is not None else "")

    def _wait(self, req, what):
        """Wait for req, polling; past stall_timeout report and abort the job."""
        if not self.stall_timeout:
            req.Wait()
            return
        start, pause = time.monotonic(), 0.0
        seq = what[1]
        # rank 0 knows who has arrived, so it reports first; the others only if rank 0 does not
        limit = self.stall_timeout if self.rank == 0 else 1.5 * self.stall_timeout + 1
        while not req.Test():
            waited = time.monotonic() - start
            if waited < self.spin_s:  # most collectives end within microseconds: yield the core, do not sleep
                os.sched_yield()
                continue
            self._drain()
            gone = {r: last for r, last in self.left.items() if last < seq}
            if gone:  # it left before entering this collective: nothing will complete it
                self._report_departure(what, gone)
            if waited > limit:
                self._report_stall(what, seq, waited)
            time.sleep(pause)
            pause = min(pause + 1e-5, 1e-3)  # then back off to a millisecond

    def _report_stall(self, what, seq, waited):
        msg = f"pydtnn: error: rank {self.rank}: stalled {waited:.1f} s in {self.describe(what)}"
        if self.rank == 0:
            self._drain()
            late = [r for r in range(self.size) if self.board[r] < seq]
            msg += f"; ranks that have not arrived: {', '.join(map(str, late)) or 'none (all are inside it)'}"
            msg += f"; last collective each rank entered: {dict(enumerate(self.board.tolist()))}"
        else:
            msg += "; rank 0 did not report, so it may be the rank that stopped"
        print(msg + f"; aborting (stall_timeout={self.stall_timeout:g} s)", file=sys.stderr, flush=True)
        self.abort(1)

    def _report_departure(self, what, gone):
        ranks = ", ".join(f"rank {r} (after collective #{last})" for r, last in sorted(gone.items()))
        print(f"pydtnn: error: rank {self.rank}: {ranks} left the job without finishing it while rank "
              f"{self.rank} waits in {self.describe(what)}; aborting", file=sys.stderr, flush=True)
        self.abort(1)

    def _close_side(self):
        """At exit: tell the others the last collective this process entered, then cancel the notes."""
        try:
            if self.rank == 0:
                for r in range(1, self.size):
                    note = np.array([self.seq], np.int64)
                    self._sends.append((self.side.Isend(note, dest=r, tag=_LEFT), note))
            else:
                note = np.array([-self.seq - 1], np.int64)
                self._sends.append((self.side.Isend(note, dest=0, tag=_ARRIVE), note))
            deadline = time.monotonic() + 0.2  # 8-byte notes leave at once; do not hold the exit for long
            while not all(r.Test() for r, _ in self._sends) and time.monotonic() < deadline:
                time.sleep(0.001)
            if self.rank == 0:
                for r in self._recvs[1:]:
                    if not r.Test():
                        r.Cancel()
                        r.Wait()
            elif not self._root_left.Test():
                self._root_left.Cancel()
                self._root_left.Wait()
            for r, _ in self._sends:
                if not r.Test():
                    r.Cancel()
                    r.Wait()
        except Exception:  # finalization must not fail the job
            pass


class _MPIRequest:
    def __init__(self, comm, req, what):
        self.comm, self.req, self.what, self.done = comm, req, what, False

    def test(self):
        if not self.done:
            self.done = self.req.Test()
        return self.done

    def wait(self):
        if not self.done:
            self.comm._wait(self.req, self.what)
            self.done = True
