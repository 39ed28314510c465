"""Pipeline parallelism: a model's layer sequence cut into S consecutive stages, one per process, and a step
that runs M micro-batches through them.

    cut = pipeline.Cut.of(model, S)                    # or Cut.of(model, S, ["layer2", "layer3"]) by hand
    stage = cut.stage(comm.rank)                       # this process's layers; the rest let go
    step = pipeline.PipelineStep(stage, loss, optimizer, comm, cut, micro_batches=M, schedule="1f1b")
    trainer = Trainer(stage, loss, optimizer, step=step)
    loss, outputs = step.run(x, y, streams=streams)    # the Step contract (pydtnn/step.py)

pipeline.units(model) lists the pieces a cut may fall between: the model's layers with every Sequential opened up: blocks (residual additions,
concatenations) stay whole, so a cut never falls inside one. A stage is a Model of its units under
their own paths ("layer1.0", "fc"), so its state dict names, and each Dropout's random stream (keyed
by path), are the whole model's.

A step equals one process with `accumulation_steps=M` (pydtnn.step.Step): micro-batch i is rows
[n*i/M, n*(i+1)/M) of the batch, with those rows' sample streams; BatchNorm normalizes each micro-batch
by its own statistics; gradients are summed weighted by each micro-batch's share in the order
0, 1, ..., M-1 under either schedule, so GPipe and 1F1B give the same bits.

Schedules, for stage s of S:
- gpipe: the M forwards, then the M backwards (all M micro-batches' activations live at once);
- 1f1b: min(S-1-s, M) forwards to fill the pipe, then one forward and one backward in turn, then the
  backwards left (at most S-s micro-batches' activations live on stage s).

Activations go forward and their gradients backward between neighbouring stages as non-blocking MPI
point-to-point messages, every receive posted when the step starts, so a message arrives while the
stage computes. Each forward's saved state (what its layers keep for backward) is set aside per
micro-batch and put back for that micro-batch's backward. The last stage computes the loss; its
loss and outputs are broadcast to every stage, so the loop above the step (metrics, progress, the
finite-loss check) runs the same on every process.
"""

from collections import Counter
from contextlib import nullcontext

import numpy as np

from pydtnn.errors import ConfigError, PydtnnError, TrainingDiverged
from pydtnn.layers.base import Layer, _join
from pydtnn.layers.blocks import Sequential
from pydtnn.recompute import passes as recompute_passes
from pydtnn.step import micro_bounds, reduce_and_update, span

SCHEDULES = ("gpipe", "1f1b")


# -- cutting the model ---------------------------------------------------------------------------
def units(model):
    """[(name, layer)]: the model's layers in order, each Sequential opened up, blocks and leaves whole
    (Model.units), each named by its path, or, where that path is not its own (a child with an empty name,
    as in torchvision's DenseNets), by the longest path the paths of all its layers with state begin with
    ("features.denseblock1.denselayer2"); "#k" is added to a name still taken."""
    found = model.units()
    counts = Counter(path for path, _, _ in found)
    out, taken = [], set()
    for path, layer, _ in found:
        inner = [p for p, sub in layer.named_layers(path) if sub.params or sub.buffers]
        name = _common(inner) or path if counts[path] > 1 or not path else path
        if name in taken or not name:
            name = f"{name}#{len(out)}"
        taken.add(name)
        out.append((name, layer))
    return out


def _common(paths):
    """The longest dotted prefix every path has ("" for none)."""
    if not paths:
        return ""
    parts = [p.split(".") for p in paths]
    n = 0
    while all(len(p) > n and p[n] == parts[0][n] for p in parts):
        n += 1
    return ".".join(parts[0][:n])


def balanced_cuts(costs, stages):
    """Bounds [0, b1, ..., len(costs)] of `stages` consecutive non-empty runs of `costs` whose largest sum is
    the least possible (the slowest stage sets a pipeline's pace); among equal ones, the earliest cuts."""
    n = len(costs)
    check_stages(stages, n)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    # best[k][j]: the least largest sum cutting the first j units into k runs; cut[k][j]: where run k starts
    best = np.full((stages + 1, n + 1), np.inf)
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-12 * max(1.0, abs(value)):
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(int(cut[k][bounds[-1]]))
    return bounds[::-1]


def cuts_at(unit_list, starts):
    """Bounds of the stages that begin at the units named `starts` (dotted paths, in order), the first stage
    at the first unit: --stage_boundaries. A path that holds several units ("layer2") begins at its first."""
    paths = [p for p, _ in unit_list]
    bounds = [0]
    for name in (s.strip() for s in starts):
        at = next((i for i, p in enumerate(paths) if p == name or p.startswith(name + ".")), None)
        if at is None or not name:
            shown = ", ".join(paths[1:41]) + (f", ... ({len(paths) - 1} in all)" if len(paths) > 41 else "")
            raise ConfigError(f"--stage_boundaries: {name!r} is not a layer a stage can begin at; expected one of "
                              f"{shown}")
        if at <= bounds[-1]:
            raise ConfigError(f"--stage_boundaries: {name!r} does not come after the stage before it; expected layers "
                              f"in model order, each after the last (not the first layer, {paths[0]!r})")
        bounds.append(at)
    return bounds + [len(paths)]


def check_stages(stages, n_units):
    if int(stages) != stages or stages < 1:
        raise ConfigError(f"--pipeline_stages must be a positive integer, got {stages!r}")
    if stages > n_units:
        raise ConfigError(f"--pipeline_stages {stages} is more than the model's {n_units} layers a stage can hold "
                          f"(blocks count as one); expected at most {n_units}")


def unit_costs(unit_list):
    """Each unit's forward floating-point operations per sample, at least 1 (a layer without arithmetic still
    takes a stage's time to pass its data on)."""
    return [max(float(layer.flops()), 1.0) for _, layer in unit_list]


def stage_model(model, unit_list, bounds, stage):
    """The Model of stage `stage`: units [bounds[stage], bounds[stage + 1]) in a copy of the whole model's
    nesting of Sequentials, under the same names (empty ones too), so every path and state name is the
    whole model's; it holds the whole model's arrays (nothing is built again)."""
    from pydtnn.model import Model

    lo, hi = bounds[stage], bounds[stage + 1]
    chosen = {id(layer) for _, layer in unit_list[lo:hi]}

    def copy(seq):
        kept = []
        for name, child in seq.children:
            if isinstance(child, Sequential):
                inner = copy(child)
                if inner is not None:
                    kept.append((name, inner))
            elif id(child) in chosen:
                kept.append((name, child))
        if not kept:
            return None
        new = Sequential(kept)
        Layer.build(new, kept[0][1].input_shape, model.backend.dtype, model.backend)
        new.output_shape = kept[-1][1].output_shape
        return new

    return Model.of_built(copy(model.root), model.backend, name=f"{model.name} stage {stage}", need_dx=stage > 0)


class Cut:
    """A model cut into stages: the stages' bounds among its units, which stage holds each array, and the
    whole model's input and output shapes. stage(s) builds a stage and lets go of the whole model."""

    def __init__(self, model, unit_list, bounds, costs=None, cost_name="FLOPs"):
        self.model, self.units, self.bounds = model, unit_list, list(bounds)
        self.layout = state_layout(model, unit_list, bounds)
        self.param_names = [name for name, _, _ in model.parameters()]
        self.input_shape, self.output_shape = tuple(model.input_shape), tuple(model.output_shape)
        self.name = model.name
        self.unit_names = [p for p, _ in unit_list]
        self.costs = list(costs) if costs is not None else unit_costs(unit_list)
        self.cost_name = cost_name if costs is not None else "FLOPs"

    @classmethod
    def of(cls, model, stages, starts=None, costs=None, cost_name="predicted time"):
        """The cut of `model` into `stages` stages: at the units named `starts` (--stage_boundaries, which must
        name stages - 1 of them), else balanced by `costs` (one per unit of units(model): the performance
        model's predicted seconds, pydtnn.perfmodel.pipelined.unit_seconds, as pydtnn-train cuts), else by the
        units' forward FLOPs."""
        unit_list = units(model)
        check_stages(stages, len(unit_list))
        if costs is not None and len(costs) != len(unit_list):
            raise ValueError(f"{len(costs)} unit costs for the {len(unit_list)} units of {model.name}; expected one each")
        if starts:
            if len(starts) != stages - 1:
                raise ConfigError(f"--stage_boundaries names {len(starts)} layers, but {stages} stages begin at "
                                  f"{stages - 1}; expected {stages - 1} comma-separated layer paths")
            return cls(model, unit_list, cuts_at(unit_list, starts), costs, cost_name)
        weights = costs if costs is not None else unit_costs(unit_list)
        return cls(model, unit_list, balanced_cuts(weights, stages), costs, cost_name)

    def stage(self, s):
        """Stage s's Model; the Cut then holds no layer of the whole model (a process keeps its stage only)."""
        built = stage_model(self.model, self.units, self.bounds, s)
        self.model = self.units = None
        return built

    def describe(self):
        """One phrase per stage: its first and last layers and its share of the costs the cut weighed."""
        costs = self.costs
        total = sum(costs)
        parts = []
        for s, (a, b) in enumerate(zip(self.bounds[:-1], self.bounds[1:])):
            first, last = self.unit_names[a], self.unit_names[b - 1]
            span = first if a == b - 1 else f"{first}..{last}"
            parts.append(f"stage {s} {span} ({100 * sum(costs[a:b]) / total:.0f}% of the {self.cost_name})")
        return "; ".join(parts)


def groups(comm, stages, model_parallel_size=1):
    """(this rank's pipeline, the replicas of its stage, its stage's model-parallel group or None). With M =
    model_parallel_size, rank r S M + s M + m is process m of stage s of pipeline replica r: a stage's M
    processes are consecutive ranks (the most frequent collectives on the fastest links), a pipeline is the
    S processes with the same m (each sends its stage's whole output to its counterpart in the next stage),
    and the ranks holding the same place in every replica reduce its gradients (data parallelism)."""
    from pydtnn.distributed.comm import SingleProcess

    m = model_parallel_size
    if comm.size == stages and m == 1:
        return comm, SingleProcess(), None
    rank, per_replica = comm.rank, stages * m
    pipe = comm.split((rank // per_replica) * m + rank % m, (rank // m) % stages)
    replicas = comm.split(rank % per_replica, rank // per_replica) if comm.size > per_replica else SingleProcess()
    group = comm.split(rank // m, rank) if m > 1 else None
    return pipe, replicas, group


# -- the step ------------------------------------------------------------------------------------
def schedule(kind, stages, stage, micro_batches):
    """[("F" or "B", micro-batch)] in the order stage `stage` runs them (module docstring)."""
    if kind not in SCHEDULES:
        raise ConfigError(f"--pipeline_schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
    m = micro_batches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - 1 - stage, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(warm, m):
        ops += [("F", i), ("B", i - warm)]
    return ops + [("B", i) for i in range(m - warm, m)]


class PipelineStep:
    """The Step contract (pydtnn/step.py) for one stage of a pipeline; see the module docstring.

    stage_model: this process's stage (Cut.stage); comm: the pipeline's communicator (pydtnn's MPIComm), rank
    s holding stage s; cut: the Cut the stage comes from (the whole model's shapes and state layout);
    reducer: the gradient reducer across the replicas of this stage (groups()), which the Trainer attaches
    to the stage (reducer.attach(stage_model) for a hand-written loop), or None: the summed micro-batches' gradients are reduced once per step, as Step's accumulation does;
    recompute: "none", "segments" or "all" (pydtnn.recompute), within the stage; batchnorm_sync: a
    step.BatchNormSync over the replicas of this stage (--sync_batchnorm), or None."""

    def __init__(self, stage_model, loss, optimizer, comm, cut, micro_batches, schedule="1f1b", reducer=None,
                 tracer=None, recompute="none", batchnorm_sync=None):
        if int(micro_batches) != micro_batches or micro_batches < 1:
            raise ConfigError(f"--micro_batches must be a positive integer, got {micro_batches!r}")
        if schedule not in SCHEDULES:
            raise ConfigError(f"--pipeline_schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
        self.model, self.loss, self.optimizer, self.comm = stage_model, loss, optimizer, comm
        self.micro_batches, self.schedule, self.tracer = int(micro_batches), schedule, tracer
        self.stage, self.stages = comm.rank, comm.size
        if len(cut.bounds) - 1 != comm.size:
            raise ConfigError(f"the cut has {len(cut.bounds) - 1} stages but the pipeline's communicator {comm.size} "
                              f"processes; expected one stage per process")
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.input_shape, self.output_shape = cut.input_shape, cut.output_shape
        self.backend, self.reducer, self.accumulation_steps = stage_model.backend, reducer, int(micro_batches)
        self._grads = [g for _, g in stage_model.gradients()]
        self.passes = recompute_passes(stage_model, recompute)
        # what a forward leaves for its backward, set aside per micro-batch: the layers' and the recomputation's
        self._layers = [layer for _, layer in stage_model.layers()] + ([self.passes] if recompute != "none" else [])
        self._acc = None
        self.cut = cut
        self.batchnorm_sync = batchnorm_sync
        if batchnorm_sync is not None:  # statistics over the replicas' micro-batch i, as Step's accumulation does
            for _, layer in stage_model.layers():
                layer.synchronize(batchnorm_sync)
        stage_model.pipeline = StageOf(cut, comm)  # its checkpoints, weights and digests are the whole model's

    # the MPI communicator under pydtnn's (point-to-point is not part of the collective contract)
    @property
    def _mpi(self):
        return self.comm.comm

    def run(self, x, y, weight=1.0, streams=None, read=True, rows=None):
        n, xp, grads = x.shape[0], self.backend.xp, self._grads
        rows = rows or micro_bounds(n, self.micro_batches)
        if self._acc is None:
            self._acc = [xp.zeros_like(g) for g in grads]
        messages = _Messages(self, rows)
        with nullcontext() if self.reducer is None else self.reducer.no_sync():  # one reduction, after the loop
            losses, outs = self._micro_batches(x, y, streams, rows, messages, weight)
        messages.finish()
        total, outputs = self._results(losses, outs, rows, n)
        if not np.isfinite(total):  # every stage knows it: the update is skipped on all of them
            raise TrainingDiverged(f"loss is {total}")
        for acc, g in zip(self._acc, grads):
            g[...] = acc
        if self.reducer is not None:
            self.reducer.begin_step(weight)
        reduce_and_update(self.optimizer, self.reducer, self.tracer, replay=True)
        return (total if read else xp.asarray(total, dtype=xp.float64)), outputs

    def _micro_batches(self, x, y, streams, rows, messages, weight=1.0):
        """The schedule's forwards and backwards on this stage, the gradients summed into self._acc in
        micro-batch order; ({i: loss}, {i: outputs}) on the last stage, empty elsewhere."""
        xp, grads, n = self.backend.xp, self._grads, x.shape[0]
        own_rows = streams is not None and len(streams) == n
        saved, dys, losses, outs = {}, {}, {}, {}
        for op, i in schedule(self.schedule, self.stages, self.stage, self.micro_batches):
            a, b = rows[i]
            if a == b:
                continue
            micro_streams = streams.rows(None, a, b) if own_rows else streams
            if op == "F":
                h = x[a:b] if self.first else messages.activation(i)
                if self.batchnorm_sync is not None:  # the micro-batch's share of the replicas' micro-batch
                    self.batchnorm_sync.weight = weight * (b - a) / n
                with self.backend.sample_streams_for(micro_streams), span(self.tracer, "forward"):
                    out = self.passes.forward(h, training=True)
                if self.last:  # the loss now: its saved state is the next micro-batch's after this
                    with span(self.tracer, "loss"):
                        losses[i] = self.loss.forward(out, y[a:b])
                        dys[i], outs[i] = self.loss.backward(), out
                else:
                    messages.send_activation(i, out)
                saved[i] = [dict(layer.__dict__) for layer in self._layers]
                continue
            for layer, state in zip(self._layers, saved.pop(i)):
                layer.__dict__.update(state)
            dy = dys.pop(i) if self.last else messages.gradient(i)
            if self.batchnorm_sync is not None:  # a recomputed forward synchronizes again
                self.batchnorm_sync.weight = weight * (b - a) / n
            with self.backend.sample_streams_for(micro_streams), span(self.tracer, "backward"):
                dx = self.passes.backward(dy)
            if not self.first:
                messages.send_gradient(i, dx)
            share = (b - a) / n
            for acc, g in zip(self._acc, grads):  # as Step._accumulated
                if a == 0:
                    xp.multiply(g, share, out=acc)
                else:
                    acc += xp.multiply(g, share, out=g)
        return losses, outs

    def predict(self, x):
        """The whole model's outputs for x in evaluation mode, on every stage: through the stages in turn."""
        mpi, n = self._mpi, x.shape[0]
        if self.first:
            h = x
        else:
            h = np.empty((n,) + self.model.input_shape, self.model.backend.dtype)
            receive(self.comm, mpi.Irecv(h, source=self.stage - 1, tag=1), h,
                    f"the activation of an evaluation batch from stage {self.stage - 1}", self.stage - 1)
        out = np.ascontiguousarray(self.model.forward(h, training=False))
        if not self.last:
            self.comm.watch.wait_message(mpi.Isend(out, dest=self.stage + 1, tag=1),
                                         f"stage {self.stage + 1} to take an evaluation batch's activation",
                                         self.stage + 1)
        outputs = out if self.last else np.empty((n,) + self.output_shape, self.model.backend.dtype)
        self.comm.bcast(outputs, root=self.stages - 1)
        return outputs

    def whole_state(self):
        """{name: NumPy array} of the whole model on rank 0, None elsewhere (every stage takes part)."""
        return self.model.whole_state_dict()

    def params_sha256(self):
        """Model.params_sha256 of the whole model, on every stage (every stage takes part)."""
        from pydtnn.model import params_digest

        state = self.whole_state()
        digest = np.zeros(64, np.uint8)
        if state is not None:
            hexdigest = params_digest(state[name] for name in self.cut.param_names)
            digest[:] = np.frombuffer(hexdigest.encode(), np.uint8)
        self.comm.bcast(digest, root=0)
        return digest.tobytes().decode()

    def _results(self, losses, outs, rows, n):
        """(the batch's loss, its outputs (n, ...)): the last stage's, sent to every stage."""
        outputs = np.empty((n,) + self.output_shape, self.model.backend.dtype)
        total = np.zeros(1, np.float64)
        if self.last:
            for i, (a, b) in enumerate(rows):
                if b > a:
                    total[0] += losses[i] * ((b - a) / n)
                    outputs[a:b] = outs[i]
        self.comm.bcast(outputs, root=self.stages - 1)
        self.comm.bcast(total, root=self.stages - 1)
        return float(total[0]), outputs


class _Messages:
    """One step's point-to-point messages of a stage: every receive posted at once (activations from the
    stage before, tag 2i; gradients from the next, tag 2i + 1), sends kept until finish()."""

    def __init__(self, step, rows):
        self.step, self.mpi, self.sends = step, step._mpi, []
        dtype, stage = step.model.backend.dtype, step.stage
        self.x = {i: np.empty((b - a,) + step.model.input_shape, dtype) for i, (a, b) in enumerate(rows)
                  if b > a and not step.first}
        self.dy = {i: np.empty((b - a,) + step.model.output_shape, dtype) for i, (a, b) in enumerate(rows)
                   if b > a and not step.last}
        self.x_requests = {i: self.mpi.Irecv(buf, source=stage - 1, tag=2 * i) for i, buf in self.x.items()}
        self.dy_requests = {i: self.mpi.Irecv(buf, source=stage + 1, tag=2 * i + 1) for i, buf in self.dy.items()}

    def activation(self, i):
        stage = self.step.stage - 1
        with self._span("receive activation", i, self.x[i]):
            receive(self.step.comm, self.x_requests.pop(i), self.x[i],
                    f"the activation of micro-batch {i} from stage {stage}", stage)
        return self.x.pop(i)

    def gradient(self, i):
        stage = self.step.stage + 1
        with self._span("receive gradient", i, self.dy[i]):
            receive(self.step.comm, self.dy_requests.pop(i), self.dy[i],
                    f"the gradient of micro-batch {i} from stage {stage}", stage)
        return self.dy.pop(i)

    def _span(self, what, i, buf):
        """The trace span of a wait (tid 2, the messages' track): what it waited for, the micro-batch, bytes."""
        tracer = self.step.tracer
        if tracer is None:
            return nullcontext()
        return tracer.span(what, "p2p", tid=2, micro_batch=i, bytes=int(buf.nbytes), stage=self.step.stage)

    def send_activation(self, i, out):
        self._send(out, self.step.stage + 1, 2 * i)

    def send_gradient(self, i, dx):
        self._send(dx, self.step.stage - 1, 2 * i + 1)

    def _send(self, a, dest, tag):
        a = np.ascontiguousarray(a, dtype=self.step.model.backend.dtype)
        # a buffer lives until its send is over, no longer: 1F1B then holds few micro-batches' messages
        self.sends = [s for s in self.sends if not s[0].Test()]
        what = f"the {'activation' if tag % 2 == 0 else 'gradient'} of micro-batch {tag // 2}"
        with self._span("send activation" if tag % 2 == 0 else "send gradient", tag // 2, a):
            self.sends.append((self.mpi.Isend(a, dest=dest, tag=tag), a, what, dest))

    def finish(self):
        for request, a, what, dest in self.sends:
            self.step.comm.watch.wait_message(request, f"stage {dest} to take {what}", dest)
        self.sends = []


def receive(comm, request, buf, what, source):
    """Wait for the receive `request` into buf (`what`, from rank `source` of comm), watched by comm's stall
    watch; MessageMismatch where it brought another number of values than buf holds."""
    from mpi4py.util.dtlib import from_numpy_dtype

    status = comm.watch.wait_message(request, what, source)
    got = status.Get_count(from_numpy_dtype(buf.dtype))
    if got != buf.size:
        raise MessageMismatch(f"stage {comm.rank} received {got} values as {what}; expected {buf.size} "
                              f"({'x'.join(map(str, buf.shape))}): the stages disagree on the shapes between them")


class MessageMismatch(PydtnnError):
    """A stage received another number of values than it expected: the stages disagree on their shapes."""


class StageOf:
    """What a stage's Model knows of the whole model it is part of (Model.pipeline): the whole state layout
    {name: (shape, dtype)} in state-dict order, the whole model's parameter names, input shape and name, and the
    pipeline's communicator, over which gather() assembles whole dicts. Checkpoints, weights and digests of a
    stage are therefore the whole model's, as those of a model split by model parallelism are."""

    def __init__(self, cut, comm):
        self.layout = {name: (tuple(shape), np.dtype(dtype)) for name, _, shape, dtype in cut.layout}
        self.param_names, self.input_shape, self.comm = list(cut.param_names), tuple(cut.input_shape), comm
        self.name = cut.name

    def gather(self, own):
        """{name: NumPy array} of every stage's `own` arrays on the pipeline's rank 0 (None elsewhere; every
        stage takes part): the state layout's names first, in its order, then the rest (optimizer slots) by stage."""
        return gather_named(self.comm, own, order=self.layout)


def gather_named(comm, own, order=()):
    """Every rank's {name: array} merged on rank 0 of `comm` (None elsewhere): names from `order` first, in its
    order, then the others rank by rank. The names, shapes and dtypes travel as JSON, the arrays as raw buffers."""
    own = {k: np.ascontiguousarray(v) for k, v in own.items()}
    listing = comm.allgather_obj([[k, list(v.shape), v.dtype.str] for k, v in own.items()])
    mpi = comm.comm if comm.size > 1 else None
    if comm.rank != 0:
        for k, _, _ in listing[comm.rank]:
            mpi.Send(own[k], dest=0, tag=0)
        return None
    got = dict(own)
    for rank in range(1, comm.size):
        for k, shape, dtype in listing[rank]:
            got[k] = np.empty(shape, np.dtype(dtype))
            mpi.Recv(got[k], source=rank, tag=0)
    first = [k for k in order if k in got]
    return {k: got[k] for k in first + [k for k in got if k not in set(first)]}


def layer_stages(unit_list, bounds):
    """{id of every layer inside a unit: the stage that holds it}."""
    stage_of = {}
    for s in range(len(bounds) - 1):
        for _, unit in unit_list[bounds[s]:bounds[s + 1]]:
            for _, layer in unit.named_layers():
                stage_of[id(layer)] = s
    return stage_of


def state_layout(model, unit_list, bounds):
    """[(name, stage, shape, dtype)] of the whole model's state dict, in its order: which stage holds each array."""
    stage_of = layer_stages(unit_list, bounds)
    out = []
    for path, layer in model.root.named_layers():
        for k, v in list(layer.params.items()) + list(layer.buffers.items()):
            out.append((_join(path, k), stage_of[id(layer)], tuple(v.shape), np.dtype(v.dtype).str))
    return out
