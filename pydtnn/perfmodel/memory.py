"""Per-process memory of a training step, predicted from the real model: what one process holds at its peak.

    m = predict_memory(model, batch_size=64, optimizer=("sgd", {"momentum": 0.9}), micro_batches=4)
    m.total, m.parts       # bytes: {"parameters", "gradients", "optimizer", "activations", "workspace", "buffers",
                           #         "reducer"}

The parts, for the process that holds the most (in a pipeline, the stage with the largest total):
  parameters   the parameters this process holds (a pipeline stage: its own layers'; at ZeRO stage 3 its shard
               and the two slots that layers are gathered into)
  gradients    the flat gradient buffer, one gradient per parameter
  optimizer    the optimizer's state and its update's scratch, measured on the real optimizer built over them
  activations  what the layers keep from forward for backward, for every micro-batch in flight (and what the
               step before left in them, until it is replaced): one without micro-batches; in a pipeline,
               M under GPipe and min(S - s, M) under 1F1B on stage s, each one after the first adding what
               a forward adds while the one before is put aside
  workspace    what the step adds above that at its peak: backward's gradients of activations, im2col and
               temporaries, or the update's temporaries
  buffers      micro-batches' gradient sum (one more gradient per parameter; a pipeline's stage always keeps
               one) and, in a pipeline, the receive buffers of every micro-batch's activation and gradient,
               posted when the step starts
  reducer      what the gradient reducer keeps across steps (data parallelism over replicas), measured on the
               real reducer built over a copy's gradients, its collectives run locally: error-feedback residuals
               (topk, oktopk, powersgd), powersgd's P, Q and warm-start Qs, the stale reducer's two wire buffers,
               fp16's wire buffers, local SGD's average buffers (parameters and the optimizer's float state); the
               lossless reducers' bookkeeping, about 1% of the parameters. At ZeRO's stages 2 and 3: none (their
               reduce-scatters' buffers are the optimizer part). Per-step scratch (a sparse reducer's selected
               entries, powersgd's temporaries) is not in it

Activations and workspace are measured, not derived: a copy of the model (or of each stage) runs a training
forward and backward under tracemalloc (NumPy reports its arrays to it) at two batch sizes, and both are
taken to grow linearly with the batch between and beyond them. So they follow what the code keeps, with
--recompute too (a Recompute keeps only its segments' inputs and holds one segment's activations at a time).
The interpreter, the libraries and the dataset are not counted: this is the training state above them.
"""

import copy
import math
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

from pydtnn import optim
from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError
from pydtnn.perfmodel import split

PARTS = ("parameters", "gradients", "optimizer", "activations", "workspace", "buffers", "reducer")
# pydtnn-perfmodel's --optimizer choices (predict.UPDATE_PASSES) as optim.create takes them
OPTIMIZERS = {"sgd": ("sgd", {}), "sgd_momentum": ("sgd", {"momentum": 0.9}), "adam": ("adam", {})}
PROBES = (4, 8)  # batch sizes the activations and workspace are measured at


@dataclass
class Memory:
    """Predicted bytes per process at the step's peak, by part (PARTS); stages: a pipeline's, each a dict."""

    parts: dict
    batch_size: int
    micro_batches: int = 1
    recompute: str = "none"
    pipeline_stages: int = 1
    schedule: str | None = None
    stages: list = field(default_factory=list)
    model_parallel_size: int = 1
    zero: int = 0

    @property
    def total(self):
        return sum(self.parts.values())

    def to_dict(self):
        return {"total": self.total, **self.parts, "batch_size": self.batch_size, "micro_batches": self.micro_batches,
                "recompute": self.recompute, "pipeline_stages": self.pipeline_stages, "schedule": self.schedule,
                "stages": self.stages, "model_parallel_size": self.model_parallel_size, "zero": self.zero}


def probe(model, optimizer, recompute="none", sizes=PROBES, zero=0, replicas=1):
    """(optimizer state bytes, activations(b), workspace(b), in_flight(b)) of a fresh copy of `model` (on a new
    backend, so no buffer of an earlier run is reused) taking two training steps under tracemalloc: the state
    its optimizer holds, what is held after the second forward (the layers' saved arrays, and what the first
    step left), what the second step adds above that at its peak (backward's temporaries, the update's),
    and what one more forward adds while the state of the one before is put aside, as a pipeline stage keeps
    its micro-batches in flight (the scratch that forwards share counted once), each a line through its
    values at the batch sizes `sizes`. A first copy's untraced steps make what a process makes once
    (compiled kernels, plans). zero: ZeRO's stage over `replicas`: the optimizer is the first replica's
    ShardedOptimizer (its shard's state, its allgather's buffers), its collectives run locally
    (split.LocalRank0)."""
    from pydtnn.recompute import passes

    name, hyper = optimizer
    state, kept, extra, more = 0, [], [], []
    for i, n in enumerate((sizes[0],) + tuple(sizes)):
        clone = _fresh_copy(model)
        run = passes(clone, recompute)
        rng = np.random.default_rng(0)
        x = clone.random_input(n, rng)
        dy = rng.standard_normal((n, *clone.output_shape)).astype(clone.backend.dtype)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            opt = _optimizer(clone, name, hyper, zero, replicas)  # its state and scratch
            base = tracemalloc.get_traced_memory()[0]
            made = base - before
            if zero == 3:  # the parameters' shard and gathering slots are the parameters part (sharded_parameters)
                made -= opt.shards.flat.nbytes
            for _ in range(2):  # the second step's peak: it starts with what the first left in the layers
                tracemalloc.reset_peak()
                out = run.forward(x, training=True)
                held = tracemalloc.get_traced_memory()[0] - base
                run.backward(dy)
                del out
                opt.step()
                peak = tracemalloc.get_traced_memory()[1] - base
            layers = [layer for _, layer in clone.layers()] + ([run] if run is not clone else [])
            out = run.forward(x, training=True)  # a micro-batch in flight, its state put aside as a pipeline does
            first = tracemalloc.get_traced_memory()[0]
            saved = [dict(layer.__dict__) for layer in layers]
            out2 = run.forward(x, training=True)
            second = tracemalloc.get_traced_memory()[0] - first
            del out, out2, saved
        finally:
            tracemalloc.stop()
        own = getattr(opt, "inner", opt)  # a sharded one's own shard, not the whole state it gathers
        lazy = sum(int(a.nbytes) for a in own.state_dict()["arrays"].values()) - made  # state made by the steps
        state = max(state, made + max(lazy, 0))
        if i:
            kept.append(max(held, 0))
            extra.append(max(peak - held, 0))
            more.append(max(second, 0))

    def line(values):
        (b1, b2), (v1, v2) = sizes, values
        slope = (v2 - v1) / (b2 - b1)
        return lambda b: max(0.0, v1 + slope * (b - b1))

    return state, line(kept), line(extra), line(more)


def _fresh_copy(model):
    """A copy of `model` on a new backend, so no buffer an earlier run made is reused."""
    fresh = CPUBackend(model.backend.dtype, seed=0)
    clone = copy.deepcopy(model, {id(model.backend): fresh})
    clone.reindex()  # its index of layers by identity, made again for the copies
    return clone


def reducer_state(model, reduction, replicas, optimizer=("sgd", {})):
    """Bytes the gradient reducer of `reduction` (a plan.Reduction; None, or its name None: no reducer) over
    `replicas` processes keeps across steps for `model`'s gradients: the real reducer built over a fresh copy
    under tracemalloc, its collectives run locally (split.LocalRank0), with as many updates reported to it as
    local SGD takes to make its first average's buffers (over an optimizer that has stepped, so its state
    exists). A progress thread holds nothing worth counting: the reducer is built without one."""
    if reduction is None or reduction.name is None or replicas < 2:
        return 0
    from pydtnn.distributed import reducers

    clone = _fresh_copy(model)
    name, hyper = optimizer
    opt = optim.create(name, clone.parameters(), backend=clone.backend, **hyper)
    opt.step()  # the state an optimizer makes at its first step (the copy's gradients are zeros)
    # the hierarchical reducer holds bucketed's buckets, powersgd in two levels its one level's arrays: their node and
    # leader groups hold none (and need communicators to split)
    name = "bucketed" if reduction.name == "hierarchical" else reduction.name
    own = reducers.defaults(name)  # a plan may carry options of other reducers, or None for defaults
    options = {k: v for k, v in reduction.options.items()
               if k in own and v is not None and k not in ("hierarchical", "ranks_per_node")}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reducer = reducers.create(name, split.LocalRank0(replicas), compression=reduction.compression,
                                  **options).attach(clone)
        taken = {**own, **options}
        for _ in range(taken.get("post_local", 0) + taken.get("every", 1)):
            reducer.after_update(opt)  # local SGD averages after `every` local steps; the others do nothing
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return max(int(held), 0)


def sharded_parameters(model, replicas):
    """Bytes of parameters a replica holds at ZeRO stage 3 (zero_params.ParamShards): the largest replica's shard
    of every layer's parameters, and the two layers' parameters gathered whole at a time, the one that runs and
    the next: at most the largest pair of neighbours (layers with parameters, in order)."""
    from pydtnn.distributed import zero

    spans = zero.layer_spans(model)
    if not spans:
        return 0
    parts = zero.span_parts([(lo, hi) for _, lo, hi in spans], replicas)
    shard = max(sum(cut[r][1] - cut[r][0] for cut in parts) for r in range(replicas))
    sizes = [hi - lo for _, lo, hi in spans]
    pair = max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0])
    return (shard + pair) * model.grad_buffer.dtype.itemsize


def _optimizer(model, name, hyper, zero, replicas):
    """The optimizer a process builds over `model`: optim.create's, or ZeRO's first replica's sharded one."""
    if not zero:
        return optim.create(name, model.parameters(), backend=model.backend, **hyper)
    from pydtnn.distributed.zero import ShardedOptimizer

    return ShardedOptimizer(lambda params: optim.create(name, params, backend=model.backend, **hyper), model,
                            split.LocalRank0(replicas), zero)


def predict_memory(model, batch_size, optimizer=("sgd", {"momentum": 0.9}), micro_batches=1, recompute="none",
                   pipeline_stages=1, schedule="1f1b", stage_starts=None, machine=None, threads=1,
                   model_parallel_size=1, zero=0, replicas=1, reduction=None):
    """The Memory of one process training `model` (built on a CPU backend) on batch_size samples per replica
    (per process in data parallelism, per pipeline in a pipeline), in micro_batches micro-batches; with
    pipeline_stages > 1, each stage's, cut as pydtnn-train cuts it (on `machine`), the busiest reported;
    with model_parallel_size M > 1, the layers (of each stage) split over M processes as rank 0 of them holds
    them (perfmodel/split.py: the most loaded), its gathers' and sums' buffers measured with the rest; zero:
    ZeRO's stage over `replicas` model replicas (the optimizer state of the first replica's shard);
    reduction: the plan.Reduction of the gradients over the `replicas` (None: no reducer), whose state is the
    reducer part (reducer_state; none at ZeRO's stages 2 and 3)."""
    if pipeline_stages > 1:
        return _pipeline_memory(model, batch_size, optimizer, micro_batches, recompute, pipeline_stages, schedule,
                                stage_starts, machine, threads, model_parallel_size, zero, replicas, reduction)
    micro = math.ceil(batch_size / micro_batches)
    held = split.split_model(model, model_parallel_size) if model_parallel_size > 1 else model
    parts = _held(held, optimizer, micro_batches, recompute, micro, in_flight=1, zero=(zero, replicas),
                  reduction=reduction)
    return Memory(parts, batch_size, micro_batches, recompute, model_parallel_size=model_parallel_size, zero=zero)


def _held(stage, optimizer, micro_batches, recompute, micro, in_flight, messages=0, zero=(0, 1), reduction=None):
    """The PARTS of a process that holds `stage` (a Model) with `in_flight` micro-batches of `micro` samples;
    zero: (ZeRO's stage, replicas); reduction: the plan.Reduction over the replicas."""
    nbytes = sum(int(p.nbytes) for _, p, _ in stage.parameters())
    state, activations, workspace, more = probe(stage, optimizer, recompute, zero=zero[0], replicas=zero[1])
    held = sharded_parameters(stage, zero[1]) if zero[0] == 3 else nbytes
    return {"parameters": held, "gradients": nbytes, "optimizer": state,
            "activations": int(activations(micro) + (in_flight - 1) * more(micro)), "workspace": int(workspace(micro)),
            "buffers": (nbytes if micro_batches > 1 else 0) + int(messages),
            "reducer": 0 if zero[0] >= 2 else reducer_state(stage, reduction, zero[1], optimizer)}


def _pipeline_memory(model, batch_size, optimizer, micro_batches, recompute, stages, schedule, starts, machine,
                     threads=1, m=1, zero=0, replicas=1, reduction=None):
    from pydtnn.distributed import pipeline
    from pydtnn.perfmodel import machine as machines
    from pydtnn.perfmodel.pipelined import stage_cut, stage_models

    if schedule not in pipeline.SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}; expected one of {', '.join(pipeline.SCHEDULES)}")
    machine = machine or machines.DEFAULT
    micro = math.ceil(batch_size / micro_batches)  # the largest micro-batch's samples
    cut = stage_cut(model, stages, batch_size, micro_batches, machine, threads, starts)
    itemsize = model.backend.dtype.itemsize
    rows = []
    for s, (held, _) in enumerate(stage_models(model, cut, m)):
        in_flight = micro_batches if schedule == "gpipe" else min(stages - s, micro_batches)
        received = 0  # every receive of the step is posted when it starts: the activations in, the gradients back
        if s > 0:
            received += batch_size * math.prod(held.input_shape) * itemsize
        if s < stages - 1:
            received += batch_size * math.prod(held.output_shape) * itemsize
        parts = _held(held, optimizer, max(micro_batches, 2), recompute, micro, in_flight, received,  # it sums always
                      (zero, replicas), reduction)
        rows.append({"stage": s, "in_flight": in_flight, "total": sum(parts.values()), **parts})
    busiest = max(rows, key=lambda r: r["total"])
    return Memory({k: busiest[k] for k in PARTS}, batch_size, micro_batches, recompute, stages, schedule, rows, m,
                  zero)


def plan_memory(model, plan, optimizer, recompute="none", schedule="1f1b", stage_starts=None, machine=None):
    """The Memory of run plan `plan` (pydtnn.plan.RunPlan), any layout: data parallelism (each process holds a
    whole replica), model-parallel groups, pipelines, their hybrids, and ZeRO's sharding over the replicas."""
    lay = plan.layout
    return predict_memory(model, plan.batch_size, optimizer, plan.accumulation_steps, recompute, lay.pipeline_stages,
                          schedule, stage_starts, machine, plan.threads or 1, lay.model_parallel_size, plan.zero,
                          lay.replicas, plan.reduction)


def mib(nbytes):
    return f"{nbytes / 2**20:,.1f} MiB"


def memory_table(m, name="model"):
    """The Memory as text: the parts of the busiest process, and a pipeline's stages."""
    how = (f"batch {m.batch_size}" + (f" in {m.micro_batches} micro-batches" if m.micro_batches > 1 else "")
           + (f", recompute {m.recompute}" if m.recompute != "none" else "")
           + (f", {m.pipeline_stages} stages ({m.schedule})" if m.pipeline_stages > 1 else "")
           + (f", layers split over {m.model_parallel_size} processes" if m.model_parallel_size > 1 else "")
           + (f", ZeRO {m.zero}" if m.zero else ""))
    lines = [f"{name}: memory of one process at a step's peak ({how})"]
    lines += [f"  {part:<12} {mib(m.parts[part]):>14}" for part in PARTS]
    lines.append(f"  {'total':<12} {mib(m.total):>14}")
    if m.stages:
        lines += ["", f"  {'stage':<6} {'in flight':>9} {'activations':>14} {'total':>14}"]
        lines += [f"  {r['stage']:<6} {r['in_flight']:>9} {mib(r['activations']):>14} {mib(r['total']):>14}"
                  for r in m.stages]
    lines.append("  (the training state above the interpreter, its libraries and the data)")
    return "\n".join(lines)
