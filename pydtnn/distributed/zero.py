"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020): each replica keeps and updates only its shard.

    optimizer = zero.ShardedOptimizer(lambda params: optim.create("adam", params, backend=b), model, replicas, 1)
    reducer = zero.ShardedReducer(replicas, optimizer).attach(model) if stage 2 else any dense reducer

The shards follow the model's flat gradient buffer (Model.grad_buffer, reverse parameter order): replica r of
P owns its elements [o_r, o_r+1) (sampler.shard_bounds of the buffer's length), which may begin or end inside a
parameter, so uneven sizes work. shard_map() is that map, a pure function of the buffer's layout and P, which
the optimizer, the reducer and the performance model all take.

- Stage 1: the gradients are reduced as in data parallelism (every replica holds their average); each replica's
  optimizer holds the state of its shard only (the pieces of parameters it owns, as flat views) and updates
  them; the updated shards are then allgathered into every replica's parameters.
- Stage 2: the gradients are reduce-scattered instead (ShardedReducer, after backward): each replica receives
  the average of its shard only, into a buffer of the shard's size, which its optimizer reads. Backward still
  writes each replica's own gradients into the whole buffer.

Every optimizer of pydtnn.optim updates element by element, so a shard's update is the whole update's, to the
bit. state_dict() and load_state_dict() speak the whole optimizer's state (every parameter's slots, gathered:
a collective), so checkpoints hold what one process's hold and resume at any process count or layout.
"""

import time

import numpy as np

from pydtnn.distributed.reducers.base import PIECE_BYTES, Reducer
from pydtnn.distributed.sampler import shard_bounds
from pydtnn.errors import ConfigError

STAGES = (0, 1, 2)  # --zero: 0 is plain data parallelism
CHUNK_BYTES = PIECE_BYTES  # an allgather of shards, about: its buffers are all a replica adds


def shard_map(offsets, size):
    """(bounds, pieces): bounds[r]:bounds[r + 1] the elements of the flat gradient buffer replica r owns, and
    pieces[r] = [(name, lo, hi, at)]: of parameter `name` (offsets[name] = (start, stop) in the buffer) the flat
    elements [lo, hi) are r's, at [at, at + hi - lo) of its shard, in buffer order."""
    total = max((b for _, b in offsets.values()), default=0)
    bounds = shard_bounds(total, size)
    pieces = [[] for _ in range(size)]
    for name, (a, b) in sorted(offsets.items(), key=lambda kv: kv[1]):
        for r in range(size):
            lo, hi = max(a, bounds[r]), min(b, bounds[r + 1])
            if hi > lo:
                pieces[r].append((name, lo - a, hi - a, lo - bounds[r]))
    return bounds, pieces


def check_stage(stage, reduction=None, compression="none", progress="test", nccl=False):
    """ConfigError where --zero is not 0, 1 or 2, or its stage cannot take the run's reduction: topk at any
    stage; at stage 2, which reduce-scatters through MPI after backward itself, another --reduction than
    bucketed or blocking, a compressed wire format, a progress thread or NCCL."""
    if stage not in STAGES:
        raise ConfigError(f"--zero {stage!r}: expected one of {', '.join(map(str, STAGES))} (stage 3, the "
                          f"parameters sharded too, is not available yet)")
    if stage and reduction == "topk":
        raise ConfigError(f"--zero {stage} with --reduction topk: topk leaves each replica its own residual, not "
                          f"an average to shard; expected a dense --reduction (bucketed, blocking, per_layer, "
                          f"hierarchical) or --zero 0")
    if stage != 2:
        return
    for given, what, want in ((reduction not in (None, "bucketed", "blocking"), f"--reduction {reduction}",
                               "bucketed (the default) or blocking"),
                              (compression != "none", f"--gradient_compression {compression}", "none"),
                              (progress != "test", f"--reduction_progress {progress}", "test"),
                              (nccl, "--enable_nccl", "MPI (no --enable_nccl)")):
        if given:
            raise ConfigError(f"--zero 2 reduce-scatters the gradients itself, through MPI after backward: {what} "
                              f"does not apply; expected {want}, or --zero 1")


class ShardedOptimizer:
    """An optimizer (make(params) builds it) over this replica's shard of `model`'s parameters, whose step()
    then allgathers the updated shards over `comm`; the Optimizer contract otherwise (lr, t, kind,
    state_dict of the whole state, load_state_dict of a whole state). stage 2: the gradients it reads are
    `shard_grad` (the reduced shard ShardedReducer writes), else the model's own gradient buffer."""

    def __init__(self, make, model, comm, stage=1):
        check_stage(stage)
        if model.grad_buffer is None:
            raise ConfigError(f"--zero {stage}: the model's gradients are not in one buffer (parameters of "
                              f"several dtypes); expected one dtype")
        self.model, self.comm, self.stage, self.tracer = model, comm, stage, None
        self.params = {name: p for name, p, _ in model.parameters()}
        for name, p in self.params.items():
            if not p.flags.c_contiguous:
                raise ConfigError(f"--zero {stage}: parameter {name} is not contiguous; expected contiguous arrays")
        self.bounds, pieces = shard_map(model.grad_offsets, comm.size)
        self.pieces = pieces[comm.rank]
        self.counts = [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        xp, dtype = model.backend.xp, model.grad_buffer.dtype
        # one replica: its shard is the whole buffer, and no reducer runs to fill another
        self.shard_grad = xp.zeros(self.counts[comm.rank], dtype) if stage == 2 and comm.size > 1 else None
        own = []
        for name, lo, hi, at in self.pieces:
            if self.shard_grad is not None:
                g = self.shard_grad[at : at + hi - lo]
            else:
                a = model.grad_offsets[name][0]
                g = model.grad_buffer[a + lo : a + hi]
            own.append((name, self.params[name].reshape(-1)[lo:hi], g))
        self.inner = make(own)
        self.own = {name: (lo, hi) for name, lo, hi, _ in self.pieces}
        # the allgathers: in each, every replica sends the next 1/K of its shard (never nothing: MPICH's
        # non-blocking Allgatherv, which the stall watch polls, takes hundreds of times longer when one sends 0)
        chunks = -(-sum(self.counts) * np.dtype(dtype).itemsize // CHUNK_BYTES) or 1
        self.steps = [-(-c // chunks) for c in self.counts]
        self.chunks = max((-(-c // s) for c, s in zip(self.counts, self.steps) if s), default=1)  # none empty
        self._send, self._recv = xp.empty(self.steps[comm.rank], dtype), xp.empty(sum(self.steps), dtype)
        self._spans = sorted(model.grad_offsets.items(), key=lambda kv: kv[1])

    # -- the Optimizer contract ------------------------------------------------------------
    @property
    def kind(self):
        return self.inner.kind

    @property
    def lr(self):
        return self.inner.lr

    @lr.setter
    def lr(self, value):
        self.inner.lr = value

    @property
    def t(self):
        return self.inner.t

    sharded = True  # state_dict() is a collective; broadcast_state shares the scalars only

    def hyperparameters(self):
        return self.inner.hyperparameters()

    def scalars(self):
        """The step count, scalar state and hyperparameters (every replica's alike)."""
        return self.inner.state_dict()["scalars"]

    def load_scalars(self, scalars):
        """Take `scalars` (another replica's scalars()), this replica's shard of the slots unchanged."""
        self.inner.load_state_dict({"arrays": self.inner.state_dict()["arrays"], "scalars": scalars})

    def state_dtypes(self):
        """{"<param>.<slot>": dtype} of the whole state's arrays, as state_dict() names them (nothing gathered)."""
        return {f"{name}.{s}": p.dtype for name, p in self.params.items() for s in self.inner.active_slots()}

    def step(self):
        """Update this replica's shard, then every replica's parameters from every shard (an allgather)."""
        self.inner.step()
        self._gather(lambda name, lo, hi: self.params[name].reshape(-1)[lo:hi],
                     lambda name, lo, hi, flat: self.params[name].reshape(-1).__setitem__(slice(lo, hi), flat),
                     "zero parameters")

    def state_dict(self):
        """The whole optimizer's state dict, every parameter's slots gathered from their shards (a collective:
        every replica calls it)."""
        arrays, to_numpy = {}, self.model.backend.to_numpy
        for slot in self.inner.active_slots():
            whole = {name: np.empty(p.shape, p.dtype) for name, p in self.params.items()}
            self._gather(lambda name, lo, hi, s=slot: self.inner.state[name][s][lo - self.own[name][0]:
                                                                                 hi - self.own[name][0]],
                         lambda name, lo, hi, flat, w=whole: w[name].reshape(-1).__setitem__(slice(lo, hi),
                                                                                              to_numpy(flat)),
                         f"zero {slot}")
            arrays.update({f"{name}.{slot}": w for name, w in whole.items()})
        return {"arrays": arrays, "scalars": self.inner.state_dict()["scalars"]}

    def load_state_dict(self, d):
        """Take this replica's shard of a whole optimizer state dict (as state_dict() gives, or one process's)."""
        if not isinstance(d, dict) or set(d) != {"arrays", "scalars"}:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ConfigError(f"{self.kind}: optimizer state dict has keys {got}; expected ['arrays', 'scalars']")
        want = {f"{name}.{s}": p.shape for name, p in self.params.items() for s in self.inner.active_slots()}
        extra, missing = sorted(set(d["arrays"]) - set(want)), sorted(set(want) - set(d["arrays"]))
        if extra or missing:
            what = "; ".join([f"unexpected {extra[:5]}"] * bool(extra) + [f"missing {missing[:5]}"] * bool(missing))
            raise ConfigError(f"{self.kind}: optimizer state arrays do not fit this optimizer: {what}")
        for k, v in d["arrays"].items():
            if tuple(v.shape) != tuple(want[k]):
                raise ConfigError(f"{self.kind}: optimizer state {k!r} has shape {tuple(v.shape)}, expected "
                                  f"{tuple(want[k])}")
        mine = {}
        for name, lo, hi, _ in self.pieces:
            for s in self.inner.active_slots():
                whole = d["arrays"][f"{name}.{s}"]
                mine[f"{name}.{s}"] = self.model.backend.to_numpy(whole).reshape(-1)[lo:hi]
        self.inner.load_state_dict({"arrays": mine, "scalars": d["scalars"]})

    # -- the allgather of shards -----------------------------------------------------------
    def _set_params(self, name, flat):
        self.params[name].reshape(-1)[...] = flat

    def _gather(self, piece, put, label):
        """Whole per-parameter arrays from every replica's shard, in `chunks` allgathers of about CHUNK_BYTES in
        all (so no whole copy is ever made): piece(name, lo, hi) gives this replica's flat
        elements [lo, hi) of parameter `name`'s array, put(name, lo, hi, flat) takes every replica's."""
        o, rank = self.bounds, self.comm.rank
        for k in range(self.chunks):
            parts = [(o[r] + min(k * s, c), o[r] + min((k + 1) * s, c)) for r, (s, c) in
                     enumerate(zip(self.steps, self.counts))]  # each replica's flat elements in this allgather
            counts = [b - a for a, b in parts]
            m0, m1 = parts[rank]
            send, recv = self._send[: m1 - m0], self._recv[: sum(counts)]
            for name, a, b in self._overlapping(m0, m1):
                send[max(a, m0) - m0 : min(b, m1) - m0] = piece(name, max(a, m0) - a, min(b, m1) - a)
            start = time.perf_counter_ns()
            self.comm.allgatherv(send, recv, counts, label)
            if self.tracer is not None:
                self.tracer.add(label, "allgather", start, time.perf_counter_ns(), tid=2, bytes=int(recv.nbytes))
            at = 0
            for p0, p1 in parts:
                for name, a, b in self._overlapping(p0, p1):
                    x0, x1 = max(a, p0), min(b, p1)
                    put(name, x0 - a, x1 - a, recv[at + x0 - p0 : at + x1 - p0])
                at += p1 - p0

    def _overlapping(self, lo, hi):
        """(name, start, stop) of the parameters whose flat buffer range meets [lo, hi)."""
        return [(name, a, b) for name, (a, b) in self._spans if a < hi and b > lo]


class ShardedReducer(Reducer):
    """ZeRO stage 2's reduction: after backward (or replay), the gradient buffer scaled by this replica's weight
    and reduce-scattered, each replica receiving the sum of its shard into optimizer.shard_grad."""

    name = "zero2"

    def __init__(self, comm, optimizer):
        super().__init__(comm)
        self.optimizer = optimizer

    def finish(self):
        self.order_done = True
        buf = self.optimizer.model.grad_buffer
        self._scale(buf)
        if self.optimizer.shard_grad is None:  # one replica: its optimizer reads the buffer itself
            return
        start = time.perf_counter_ns()
        self.comm.reduce_scatterv(buf, self.optimizer.shard_grad, self.optimizer.counts, "zero gradients")
        self.bytes_reduced += buf.nbytes
        if self.tracer is not None:
            end = time.perf_counter_ns()
            self.tracer.add("zero gradients", "reduce_scatter", start, end, tid=2, bytes=int(buf.nbytes))
            self.tracer.add("zero gradients", "blocking", start, end, tid=1)
