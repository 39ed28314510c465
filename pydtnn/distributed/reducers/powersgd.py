"""Low-rank reduction with error feedback: PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), as
PyTorch's DDP communication hook powerSGD_hook runs it.

A gradient of two or more dimensions is the matrix M of its first dimension by the rest (n x m: a
convolution's Cout x Cin*kh*kw, a Dense weight as it is stored) and is compressed at rank r = min(rank, n, m)
where that makes it more than min_compression_rate times smaller (layout.powersgd_matrices); the others
(biases, normalizations' vectors, small matrices) are sent as they are. Each step, on every rank, M is its
weighted gradient (its share of the global batch) plus its residual, and

    P = M Q                      Q: the previous step's (warm start); at first one standard normal draw,
                                 the same on every rank
    allreduce [every P | the gradients sent as they are]         one message
    P = the orthonormal columns of P (reduced QR: a zero P gives no NaN; every rank factors the same summed P
                                 with the same LAPACK, so the replicas stay equal, as they do on one machine)
    Q = M^T P;  allreduce [every Q]                              the second message
    gradient = P Q^T;  residual = M - w P Q^T                    w: this rank's share of the batch

P Q^T approximates the sum of the ranks' M (the global average gradient); the residuals add up to what it
missed, and join the next step (error feedback: the paper's e = Delta - decompress(C(Delta)), in the units
of a sum over ranks). At r = min(n, m) the approximation is the sum itself: P P^T sum(M) = sum(M).

The first start_step steps send every gradient whole (one allreduce, PyTorch's start_powerSGD_iter), the
residuals staying zero. A compressed gradient sends r (n + m) entries instead of n m.

State: each rank's residual, and every Q (the same on every rank), which state_dict() lays out like the
gradients: each compressed gradient's Q (m x r, at most its n m entries) at the start of its span, zeros
after. The step count, which decides the start, is the optimizer's (resume_at).

hierarchical=True runs each of those allreduces in two levels, as the hierarchical reducer runs its buckets: summed
into each node's leader, allreduced among the leaders, broadcast back in the node (nodes: the ranks that share
memory, or blocks of ranks_per_node consecutive ranks), so only one rank per node sends the small P and Q over the
network.
"""

import itertools
import time

import numpy as np

from pydtnn.backends import array_module
from pydtnn.distributed.reducers.base import Reducer, flat_buffer
from pydtnn.distributed.reducers.hierarchical import node_comms
from pydtnn.distributed.reducers.layout import powersgd_counts, powersgd_matrices
from pydtnn.errors import ConfigError

SEED = 20190529  # the first Q's draw: fixed, so every rank and every run starts alike


class PowerSGDReducer(Reducer):
    name = "powersgd"
    shared_state = ("q",)  # identical on every rank: a resume at another process count gives every rank row 0

    def __init__(self, comm, rank=4, start_step=0, min_compression_rate=2.0, hierarchical=False, ranks_per_node=None,
                 compression="none", progress="test"):
        if int(rank) != rank or rank < 1:
            raise ConfigError(f"powersgd rank must be a whole number >= 1, got {rank!r}")
        if int(start_step) != start_step or start_step < 0:
            raise ConfigError(f"powersgd start_step must be a whole number >= 0, got {start_step!r}")
        if not min_compression_rate >= 0:
            raise ConfigError(f"powersgd min_compression_rate must be >= 0, got {min_compression_rate!r}")
        super().__init__(comm, compression, progress)
        self.rank, self.start_step = int(rank), int(start_step)
        self.min_compression_rate = float(min_compression_rate)
        self.step = 0
        if ranks_per_node and not hierarchical:
            raise ConfigError("powersgd: ranks_per_node applies to its reduction in two levels; give "
                              "--powersgd_hierarchical true, or leave --ranks_per_node out")
        if hierarchical and comm.device != "cpu":
            raise ConfigError(f"powersgd in two levels (--powersgd_hierarchical) reduces host arrays over MPI; this "
                              f"run's communicator is {comm.name}: leave --powersgd_hierarchical out on a GPU")
        self.hierarchical = bool(hierarchical)
        self.node, self.leaders = node_comms(comm, ranks_per_node) if hierarchical else (None, None)

    def setup(self):
        self.names = [n for n, _ in self.gradients]
        self.buf, self.views = flat_buffer([g for _, g in self.gradients])
        xp = array_module(self.buf)
        sizes = np.cumsum([0] + [g.size for _, g in self.gradients]).tolist()
        self.spans = list(itertools.pairwise(sizes))
        self.matrices = powersgd_matrices([g.shape for _, g in self.gradients], self.rank, self.min_compression_rate)
        rng = np.random.default_rng(SEED)
        self.qs = [None if mat is None else xp.asarray(rng.standard_normal((mat[1], mat[2])).astype(self.buf.dtype))
                   for mat in self.matrices]
        first, second = powersgd_counts([b - a for a, b in self.spans], self.matrices)  # the messages' layout
        self.first = xp.empty(first, self.buf.dtype)  # [every P | the gradients sent whole]
        self.second = xp.empty(second, self.buf.dtype)  # every Q
        self.residual = xp.zeros_like(self.buf)

    def _reduce(self, buf, label):
        """The allreduce of buf: flat, or with hierarchical in two levels (node, leaders, node), piece by piece."""
        if self.node is None:
            return super()._reduce(buf, label)
        self.bytes_reduced += buf.nbytes
        start = time.perf_counter_ns()
        for piece in self._pieces(buf):
            self.node.ireduce(piece, 0, label).wait()
            if self.leaders is not None:
                self.leaders.allreduce(piece, label)
            self.node.ibcast(piece, 0, label).wait()
        if self.tracer is not None:
            end = time.perf_counter_ns()
            self.tracer.add(label, "allreduce", start, end, tid=2, bytes=int(buf.nbytes))
            self.tracer.add(label, "blocking", start, end, tid=1)
        return buf

    def resume_at(self, step):
        """The run resumes after `step` updates (the optimizer's count): the start is counted from there."""
        self.step = int(step)

    def finish(self):
        self.order_done = True
        self._pack(self.views, self.names)  # this rank's weighted gradients, copied into buf
        if self.step < self.start_step:
            self._reduce(self.buf, "powersgd whole")
        else:
            self._low_rank()
        self._unpack(self.views, self.names)
        self.step += 1

    def _low_rank(self):
        xp = array_module(self.buf)
        acc = self.residual
        acc += self.buf  # M of every gradient: this step's weighted share plus what was missed before
        at, ps, ms, off = [], [], [], 0  # per gradient: its offset in first, its P and M (None: sent whole)
        for (a, b), mat, q in zip(self.spans, self.matrices, self.qs):
            at.append(off)
            if mat is None:
                self.first[off:off + b - a] = acc[a:b]
                ps.append(None)
                ms.append(None)
                off += b - a
                continue
            n, m, r = mat
            ps.append(self.first[off:off + n * r].reshape(n, r))
            ms.append(acc[a:b].reshape(n, m))
            xp.matmul(ms[-1], q, out=ps[-1])
            off += n * r
        self._reduce(self.first, "powersgd P")
        qs, off = [], 0
        for mat, p, mm in zip(self.matrices, ps, ms):
            qs.append(None if mat is None else self.second[off:off + mat[1] * mat[2]].reshape(mat[1], mat[2]))
            if mat is not None:
                p[...] = xp.linalg.qr(p)[0]
                xp.matmul(mm.T, p, out=qs[-1])
                off += mat[1] * mat[2]
        if self.second.size:
            self._reduce(self.second, "powersgd Q")
        w = acc.dtype.type(self.weight)
        for (a, b), mat, p, mm, q, i in zip(self.spans, self.matrices, ps, ms, qs, at):
            if mat is None:  # the sum as it came: nothing missed
                self.buf[a:b] = self.first[i:i + b - a]
                acc[a:b] = 0
                continue
            approx = self.buf[a:b].reshape(mat[0], mat[1])
            xp.matmul(p, q.T, out=approx)
            mm -= w * approx  # the residual: what this rank's share missed
        for mine, q in zip(self.qs, qs):
            if q is not None:
                mine[...] = q  # the next step's warm start

    def state_dict(self):
        """This rank's residual, and every Q (laid out like the gradients: see the module's docstring)."""
        xp = array_module(self.residual)
        q = xp.zeros_like(self.residual)
        for (a, _), qi in zip(self.spans, self.qs):
            if qi is not None:
                q[a:a + qi.size] = qi.reshape(-1)
        return {"q": q, "residual": self.residual}

    def param_spans(self):
        return dict(zip(self.names, self.spans))

    def load_state_dict(self, state):
        for name in ("q", "residual"):
            if tuple(state[name].shape) != tuple(self.residual.shape):
                raise ConfigError(f"powersgd {name} of shape {tuple(state[name].shape)}; this model's gradients "
                                  f"need {tuple(self.residual.shape)}")
        self.residual[...] = state["residual"]
        for (a, _), qi in zip(self.spans, self.qs):
            if qi is not None:
                qi[...] = state["q"][a:a + qi.size].reshape(qi.shape)
