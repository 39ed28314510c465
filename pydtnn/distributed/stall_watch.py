"""The stall watch of an MPI communicator: numbered collectives, waits that report a stall or a departed
rank instead of hanging, and (--debug_collectives) a comparison of every collective across the ranks.

MPIComm holds one StallWatch and calls it around each collective:

    what = watch.enter("allreduce", buf, label)      # numbers it; notes the arrival; compares (debug)
    watch.wait(comm.Iallreduce(...), what)            # polls; past stall_timeout: report and abort

and a pipeline's stages around their point-to-point messages (what they carry, in words):

    status = watch.wait_message(comm.Irecv(buf, source=0, tag=4), "the activation of micro-batch 2 from stage 0", 0)

Two safety nets use the numbers:
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
import os
import sys
import time

import numpy as np

from pydtnn.errors import PydtnnError

# A wait spins (yielding the core) this long before it starts to sleep between polls: a sleep lasts
# 60 us or more, about twenty times a small collective's own time. Not where a node's ranks outnumber
# its cores: there the spinning rank would hold a core that the rank it waits for needs.
SPIN_S = 2e-3
_ARRIVE, _LEFT = 7707, 7708  # tags of arrival notes and of rank 0's departure note
_SIG_BYTES = 64  # a collective's signature for --debug_collectives


class CollectiveMismatch(PydtnnError):
    """Ranks issued different collectives (found by --debug_collectives)."""


class StallWatch:
    """Numbers the collectives of the mpi4py communicator `comm` and watches their waits (module docstring).

    MPI: the mpi4py.MPI module; stall_timeout: seconds (None: waits block, nothing is noted); debug: compare
    every collective across the ranks; abort(code): ends the job after a report. Its notes travel on a
    duplicate of comm, made whatever the flags, so that ranks started with different ones still reach the
    start-up comparison that names the difference.
    """

    def __init__(self, comm, MPI, stall_timeout=None, debug=False, abort=None):
        self.comm, self.abort, self._MPI = comm, abort, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stall_timeout, self.debug = stall_timeout, debug
        self.seq = 0  # collectives entered so far
        self.current = None  # (op, number, label, buffer) of the collective being entered
        self.side = comm.Dup()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
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
            atexit.register(self.close)

    def enter(self, op, buf, label="", compare=True):
        """Number the collective `op` of `buf` (None for none) and note it; returns its record, for wait()."""
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
        return self.current

    def run(self, nonblocking, *args):
        """A non-blocking collective of the current one, waited for (watched for stalls when stall_timeout
        is set). Always non-blocking: a blocking and a non-blocking collective do not match in MPI, and these
        run before the ranks have checked that they agree on stall_timeout."""
        self.wait(nonblocking(*args), self.current)

    def _compare_signatures(self, op, buf):
        """--debug_collectives: every rank's (operation, dtype, element count, number), as fixed-size text."""
        sig = f"{op} {'-' if buf is None else buf.dtype.name} x {0 if buf is None else int(buf.size)} (#{self.seq})"
        mine = np.frombuffer(sig.encode().ljust(_SIG_BYTES)[:_SIG_BYTES], np.uint8)
        every = np.empty((self.size, _SIG_BYTES), np.uint8)
        self.run(self.comm.Iallgather, mine, every)
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
        """'allreduce #12 (bucket 0) [float32 x 1024]' for a collective recorded by enter()."""
        op, seq, label, buf = what
        return f"{op} #{seq}" + (f" ({label})" if label else "") + (
            f" [{buf.dtype.name} x {buf.size}]" if buf is not None else "")

    def wait(self, req, what):
        """Wait for the mpi4py request req of collective `what`, polling; past stall_timeout report and abort."""
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

    def wait_message(self, req, what, peer):
        """Wait for the point-to-point request req (`what`, in words: "the activation of micro-batch 3 from
        stage 0") from or to rank `peer`; returns its mpi4py Status. Polls as wait() does where stall_timeout
        is set: past it, reports what this rank waits for and aborts; a peer known to have left ends the wait
        at once. Messages are not numbered: the stall names the message, not the ranks that have not arrived."""
        status = self._MPI.Status()
        if not self.stall_timeout:
            req.Wait(status)
            return status
        start, pause = time.monotonic(), 0.0
        while not req.Test(status):
            waited = time.monotonic() - start
            if waited < self.spin_s:
                os.sched_yield()
                continue
            self._drain()
            if peer in self.left:
                print(f"pydtnn: error: rank {self.rank}: rank {peer} left the job without finishing it while rank "
                      f"{self.rank} waits for {what}; aborting", file=sys.stderr, flush=True)
                self.abort(1)
            if waited > self.stall_timeout:
                print(f"pydtnn: error: rank {self.rank}: stalled {waited:.1f} s waiting for {what}; aborting "
                      f"(stall_timeout={self.stall_timeout:g} s)", file=sys.stderr, flush=True)
                self.abort(1)
            time.sleep(pause)
            pause = min(pause + 1e-5, 1e-3)
        return status

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

    def close(self):
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
