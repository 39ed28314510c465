"""Communicators: the few collectives data parallelism needs, over MPI or within one process.

Arrays are reduced in place. Non-blocking reductions return a request with test() and wait();
MPI makes no progress in the background here, so whoever starts one should call test() now and then.
"""

import numpy as np


class SingleProcess:
    """World of one: every collective is the identity."""

    rank, size = 0, 1
    name = "single"

    def allreduce(self, buf):
        return buf

    def iallreduce(self, buf):
        return _Done()

    def bcast(self, buf, root=0):
        return buf

    def bcast_obj(self, obj, root=0):
        return obj

    def allreduce_sum(self, values):
        """Sum of a small float vector over ranks (a new array)."""
        return np.array(values, dtype=np.float64)

    def allgather_obj(self, obj):
        return [obj]

    def barrier(self):
        pass

    def abort(self, code=1):
        raise SystemExit(code)


class _Done:
    def test(self):
        return True

    def wait(self):
        pass


class MPIComm:
    """mpi4py's COMM_WORLD (or a given communicator)."""

    name = "mpi"

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def allreduce(self, buf):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def iallreduce(self, buf):
        return _MPIRequest(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM))

    def bcast(self, buf, root=0):
        self.comm.Bcast(buf, root=root)
        return buf

    def bcast_obj(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def allreduce_sum(self, values):
        buf = np.array(values, dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def allgather_obj(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()

    def abort(self, code=1):
        self.comm.Abort(code)


class _MPIRequest:
    def __init__(self, req):
        self.req, self.done = req, False

    def test(self):
        if not self.done:
            self.done = self.req.Test()
        return self.done

    def wait(self):
        if not self.done:
            self.req.Wait()
            self.done = True
