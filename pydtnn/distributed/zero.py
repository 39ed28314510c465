"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020): each replica keeps and updates only its shard.

    optimizer = zero.ShardedOptimizer(lambda params: optim.create("adam", params, backend=b), model, replicas, 1)
    reducer = zero.ShardedReducer(replicas, optimizer).attach(model) if stage 2 or 3 else any dense reducer
    optimizer.shards.attach()   # stage 3, once the replicas agree on the parameters: each keeps its shard only

The shards follow the model's flat gradient buffer (Model.grad_buffer, reverse parameter order), cut into the
bucketed reducer's buckets (buckets(): whole parameters each, the first small): replica r of P owns the r-th of P
near-equal parts of every bucket (sampler.shard_bounds of its length), parts that may begin or end inside a
parameter, so uneven sizes work, and every bucket is reduce-scattered evenly over the replicas. shard_map() is
that map, a pure function of the buffer's layout, the buckets and P, which the optimizer, the reducer and the
performance model all take.

- Stage 1: the gradients are reduced as in data parallelism (every replica holds their average); each replica's
  optimizer holds the state of its shard only (the pieces of parameters it owns, as flat views) and updates
  them; the updated shards are then allgathered into every replica's parameters.
- Stage 2: the gradients are reduce-scattered instead (ShardedReducer), bucket by bucket during backward: a
  bucket's non-blocking reduce-scatter starts as soon as its gradients are ready, progressed between layers as
  the bucketed reducer's allreduces are; it runs in place, each replica's part of the average landing at the
  bucket's start, where its optimizer reads it. No replica holds the whole reduced gradient. Backward still
  writes each replica's own gradients into the whole buffer.
- Stage 3: the spans are the leaf layers' parameters instead of buckets (layer_spans()), so a layer's gradients
  are reduce-scattered as soon as it is done, and the parameters are sharded too (zero_params.ParamShards): the
  optimizer updates the replica's shard of them, and each layer's are gathered just before it runs.

Every optimizer of pydtnn.optim updates element by element, so a shard's update is the whole update's, to the
bit. state_dict() and load_state_dict() speak the whole optimizer's state (every parameter's slots, gathered:
a collective), so checkpoints hold what one process's hold and resume at any process count or layout.
"""

import bisect
import time

import numpy as np

from pydtnn.distributed.reducers.base import PIECE_BYTES, Reducer
from pydtnn.distributed.reducers.layout import bucket_layout
from pydtnn.distributed.sampler import shard_bounds
from pydtnn.errors import ConfigError

STAGES = (0, 1, 2, 3)  # --zero: 0 is plain data parallelism
CHUNK_BYTES = PIECE_BYTES  # an allgather of shards, about: its buffers are all a replica adds
BUCKET_MB, FIRST_BUCKET_MB = 25.0, 1.0  # the bucketed reducer's defaults: the buckets the shards are cut from


def buckets(offsets, itemsize, bucket_mb=BUCKET_MB, first_bucket_mb=FIRST_BUCKET_MB):
    """[(names, lo, hi)]: the flat gradient buffer (offsets: name -> (start, stop) in it) cut into the bucketed
    reducer's buckets (layout.bucket_layout of the gradients' bytes in buffer order): whole parameters each,
    the buffer's elements [lo, hi)."""
    order = sorted(offsets, key=lambda n: offsets[n])
    spans = bucket_layout([(offsets[n][1] - offsets[n][0]) * itemsize for n in order], bucket_mb * 2**20,
                          first_bucket_mb * 2**20)
    return [(order[a:b], offsets[order[a]][0], offsets[order[b - 1]][1]) for a, b in spans]


def layer_spans(model):
    """[(names, lo, hi)]: the flat gradient buffer cut into its leaf layers' parameters (stage 3's spans: what one
    gather gives a layer), in buffer order."""
    offsets, out = model.grad_offsets, []
    for names in model._param_names.values():
        out.append((sorted(names, key=lambda n: offsets[n]), min(offsets[n][0] for n in names),
                    max(offsets[n][1] for n in names)))
    return sorted(out, key=lambda t: t[1])


def span_parts(spans, size):
    """[[(lo, hi, at)] of each span]: span (lo, hi) of the buffer cut into `size` near-equal parts, replica r's
    being its elements [lo, hi) (empty where the span has fewer elements than replicas), at `at` of r's shard,
    which holds its parts of every span in turn."""
    out, filled = [], [0] * size
    for a, b in spans:
        cut, parts = shard_bounds(b - a, size), []
        for r in range(size):
            parts.append((a + cut[r], a + cut[r + 1], filled[r]))
            filled[r] += cut[r + 1] - cut[r]
        out.append(parts)
    return out


def shard_map(offsets, size, spans=None):
    """(runs, pieces): runs[r] = [(lo, hi, at)], the elements [lo, hi) of the flat gradient buffer replica r owns,
    at [at, at + hi - lo) of its shard, in buffer order; pieces[r] = [(name, lo, hi, at)]: of parameter `name`
    (offsets[name] = (start, stop) in the buffer) the flat elements [lo, hi) are r's, at [at, at + hi - lo) of its
    shard. spans: [(lo, hi)] that cover the buffer in order, each cut evenly over the replicas (span_parts), made
    of whole parameters (buckets()); None: one span, the whole buffer."""
    total = max((b for _, b in offsets.values()), default=0)
    spans = [(0, total)] if spans is None else spans
    params = sorted(offsets.items(), key=lambda kv: kv[1])
    runs = [[] for _ in range(size)]
    for parts in span_parts(spans, size):
        for r, (lo, hi, at) in enumerate(parts):
            if hi > lo:
                runs[r].append((lo, hi, at))
    pieces = [[] for _ in range(size)]
    for r in range(size):
        for lo, hi, at in runs[r]:
            for name, (a, b) in params:
                x0, x1 = max(a, lo), min(b, hi)
                if x1 > x0:
                    pieces[r].append((name, x0 - a, x1 - a, at + x0 - lo))
        names = [name for name, *_ in pieces[r]]
        if len(set(names)) != len(names):
            raise ValueError(f"shard_map: a parameter crosses a span's end ({spans}); expected spans of whole "
                             f"parameters")
    return runs, pieces


def check_stage(stage, reduction=None, compression="none", progress="test", nccl=False):
    """ConfigError where --zero is not 0, 1, 2 or 3, or its stage cannot take the run's reduction: topk, oktopk, powersgd or local SGD at any
    stage (powersgd too); at stages 2 and 3, which reduce-scatter through MPI themselves, during backward, another --reduction
    than bucketed or blocking, a compressed wire format, a progress thread or NCCL."""
    if stage not in STAGES:
        raise ConfigError(f"--zero {stage!r}: expected one of {', '.join(map(str, STAGES))}")
    if stage and reduction in ("topk", "oktopk", "powersgd", "local_sgd", "stale"):
        why = ("holds each step's average a step late, outside the sharded update" if reduction == "stale" else
               "leaves each replica its own residual, not an average to shard")
        raise ConfigError(f"--zero {stage} with --reduction {reduction}: {reduction} {why}; expected a dense "
                          f"--reduction (bucketed, blocking, per_layer, hierarchical) or --zero 0")
    if stage < 2:
        return
    for given, what, want in ((reduction not in (None, "bucketed", "blocking"), f"--reduction {reduction}",
                               "bucketed (the default) or blocking"),
                              (compression != "none", f"--gradient_compression {compression}", "none"),
                              (progress != "test", f"--reduction_progress {progress}", "test"),
                              (nccl, "--enable_nccl", "MPI (no --enable_nccl)")):
        if given:
            raise ConfigError(f"--zero {stage} reduce-scatters the gradients itself, through MPI during backward: "
                              f"{what} does not apply; expected {want}, or --zero 1")


class ShardedOptimizer:
    """An optimizer (make(params) builds it) over this replica's shard of `model`'s parameters, whose step()
    then allgathers the updated shards over `comm` (at stage 3 it does not: `shards`, zero_params.ParamShards,
    holds the shard, and the layers gather their parameters as they run); the Optimizer contract otherwise (lr, t, kind,
    state_dict of the whole state, load_state_dict of a whole state). The gradients it reads are in the model's
    own gradient buffer: each parameter's own place at stage 1 (the run's reducer leaves the average there), and
    at stage 2 the start of each bucket, where ShardedReducer's in-place reduce-scatter leaves this replica's
    part of the bucket's sum (in_place())."""

    def __init__(self, make, model, comm, stage=1, bucket_mb=BUCKET_MB, first_bucket_mb=FIRST_BUCKET_MB):
        check_stage(stage)
        if model.grad_buffer is None:
            raise ConfigError(f"--zero {stage}: the model's gradients are not in one buffer (parameters of "
                              f"several dtypes); expected one dtype")
        self.model, self.comm, self.stage, self.tracer = model, comm, stage, None
        params = {name: p for name, p, _ in model.parameters()}
        for name, p in params.items():
            if not p.flags.c_contiguous:
                raise ConfigError(f"--zero {stage}: parameter {name} is not contiguous; expected contiguous arrays")
        self.shapes = {name: tuple(p.shape) for name, p in params.items()}
        xp, dtype = model.backend.xp, model.grad_buffer.dtype
        self.buckets = (layer_spans(model) if stage == 3 else
                        buckets(model.grad_offsets, np.dtype(dtype).itemsize, bucket_mb, first_bucket_mb))
        spans = [(lo, hi) for _, lo, hi in self.buckets]
        _, pieces = shard_map(model.grad_offsets, comm.size, spans)
        self.parts = span_parts(spans, comm.size)  # each bucket's parts: what its reduce-scatter gives each replica
        self.pieces, self._every = pieces[comm.rank], pieces  # every replica's, for the allgathers
        self._ends = [[at + hi - lo for _, lo, hi, at in mine] for mine in pieces]  # where each piece ends
        self.counts = [ends[-1] if ends else 0 for ends in self._ends]  # each replica's shard: its pieces end to end
        self.shards = None
        if stage == 3:  # the parameters sharded too: the optimizer updates the shard, layers gather theirs
            from pydtnn.distributed.zero_params import ParamShards

            self.shards = ParamShards(model, comm, self.buckets, self.parts)
            params = {}  # the whole arrays are the model's until ParamShards.attach() lets them go
        own = []
        for name, lo, hi, at in self.pieces:
            a = self.in_place(name, at) if stage >= 2 else model.grad_offsets[name][0] + lo
            mine = self.shards.flat[at : at + hi - lo] if stage == 3 else params[name].reshape(-1)[lo:hi]
            own.append((name, mine, model.grad_buffer[a : a + hi - lo]))
        self.params = params  # stages 1 and 2: the model's whole parameters, which step() allgathers into
        self.inner = make(own)
        self.own = {name: (lo, hi) for name, lo, hi, _ in self.pieces}
        # the allgathers: in each, every replica sends the next 1/K of its shard (never nothing: MPICH's
        # non-blocking Allgatherv, which the stall watch polls, takes hundreds of times longer when one sends 0)
        chunks = -(-sum(self.counts) * np.dtype(dtype).itemsize // CHUNK_BYTES) or 1
        self.steps = [-(-c // chunks) for c in self.counts]
        self.chunks = max((-(-c // s) for c, s in zip(self.counts, self.steps) if s), default=1)  # none empty
        self._send, self._recv = xp.empty(self.steps[comm.rank], dtype), xp.empty(sum(self.steps), dtype)

    def in_place(self, name, at):
        """Where in the gradient buffer stage 2's reduce-scatter leaves element `at` of this replica's shard, which
        lies in parameter `name`'s bucket: the bucket's start plus its place in this replica's part of the bucket
        (MPI_IN_PLACE leaves each rank's block at the start of the buffer). One replica: its own place."""
        b = next(i for i, (names, _, _) in enumerate(self.buckets) if name in names)
        return self.buckets[b][1] + at - self.parts[b][self.comm.rank][2]

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
        dtype = self.model.grad_buffer.dtype
        return {f"{name}.{s}": dtype for name in self.shapes for s in self.inner.active_slots()}

    def step(self):
        """Update this replica's shard, then every replica's parameters from every shard (an allgather); at stage
        3 the shard only, which the layers gather from as they run (a gather still in flight from it completed
        first: its send buffer is the shard)."""
        if self.shards is not None:
            self.shards.drain()
        self.inner.step()
        if self.shards is not None:
            self.shards.changed()
            return
        self._gather(lambda name, lo, hi: self.params[name].reshape(-1)[lo:hi],
                     lambda name, lo, hi, flat: self.params[name].reshape(-1).__setitem__(slice(lo, hi), flat),
                     "zero parameters")

    def state_dict(self):
        """The whole optimizer's state dict, every parameter's slots gathered from their shards (a collective:
        every replica calls it)."""
        arrays, to_numpy = {}, self.model.backend.to_numpy
        for slot in self.inner.active_slots():
            whole = {name: np.empty(shape, self.model.grad_buffer.dtype) for name, shape in self.shapes.items()}
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
        want = {f"{name}.{s}": shape for name, shape in self.shapes.items() for s in self.inner.active_slots()}
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
    def _gather(self, piece, put, label):
        """Whole per-parameter arrays from every replica's shard, in `chunks` allgathers of about CHUNK_BYTES in
        all (so no whole copy is ever made): piece(name, lo, hi) gives this replica's flat
        elements [lo, hi) of parameter `name`'s array, put(name, lo, hi, flat) takes every replica's."""
        rank = self.comm.rank
        for k in range(self.chunks):
            parts = [(min(k * s, c), min((k + 1) * s, c)) for s, c in zip(self.steps, self.counts)]  # of each shard
            counts = [b - a for a, b in parts]
            m0, m1 = parts[rank]
            send, recv = self._send[: m1 - m0], self._recv[: sum(counts)]
            for name, x0, x1, y0, y1 in self._in_shard(rank, m0, m1):
                send[x0 - m0 : x1 - m0] = piece(name, y0, y1)
            start = time.perf_counter_ns()
            self.comm.allgatherv(send, recv, counts, label)
            if self.tracer is not None:
                self.tracer.add(label, "allgather", start, time.perf_counter_ns(), tid=2, bytes=int(recv.nbytes))
            at = 0
            for r, (p0, p1) in enumerate(parts):
                for name, x0, x1, y0, y1 in self._in_shard(r, p0, p1):
                    put(name, y0, y1, recv[at + x0 - p0 : at + x1 - p0])
                at += p1 - p0

    def _in_shard(self, r, s0, s1):
        """(name, x0, x1, y0, y1) of replica r's shard elements [s0, s1): its [x0, x1) are parameter `name`'s flat
        elements [y0, y1)."""
        out = []
        pieces = self._every[r]
        for k in range(bisect.bisect_right(self._ends[r], s0), len(pieces)):  # the first piece ending after s0
            name, lo, hi, at = pieces[k]
            if at >= s1:
                break
            x0, x1 = max(at, s0), min(at + hi - lo, s1)
            out.append((name, x0, x1, lo + x0 - at, lo + x1 - at))
        return out


class ShardedReducer(Reducer):
    """ZeRO stages 2 and 3's reduction: each of the optimizer's buckets (the bucketed reducer's at stage 2, a
    layer's parameters at stage 3, in the gradient buffer) scaled by this replica's weight and reduce-scattered
    as soon as its gradients are ready, non-blocking, progressed between layers, in place: each replica's part
    of a bucket's sum lands at the bucket's start in the gradient buffer (ShardedOptimizer.in_place), where its
    optimizer reads it. finish() waits for them all."""

    name = "zero2"

    def __init__(self, comm, optimizer):
        super().__init__(comm)
        self.optimizer = optimizer

    def setup(self):
        self.bucket_of = {n: i for i, (names, _, _) in enumerate(self.optimizer.buckets) for n in names}
        self.missing = [len(names) for names, _, _ in self.optimizer.buckets]
        self.pending = []

    def grads_ready(self, names):
        for i in self._bucket_ready(names):
            self._start_bucket(i)

    def _start_bucket(self, i):
        opt = self.optimizer
        _, lo, hi = opt.buckets[i]
        buf = opt.model.grad_buffer[lo:hi]
        self._scale(buf)
        if self.comm.size == 1:  # one replica: its optimizer reads the buffer itself
            return
        label = f"zero bucket {i}"
        self.bytes_reduced += buf.nbytes
        req = self.comm.ireduce_scatterv(buf, None, [b - a for a, b, _ in opt.parts[i]], label)
        self.pending.append((i, ([req], label, time.perf_counter_ns(), int(buf.nbytes))))

    def finish(self):
        self.order_done = True
        started = len(self.missing) - sum(1 for m in self.missing if m)
        if started != len(self.missing):
            raise RuntimeError(f"zero reducer: {started} of {len(self.missing)} buckets were started; some "
                               f"gradients never reported ready")
        for _, p in self.pending:
            self._wait(p, "ireduce_scatter")  # in flight since its bucket was ready (tracer.CONCURRENT)
        self.pending = []
        self.missing = [len(names) for names, _, _ in self.optimizer.buckets]
