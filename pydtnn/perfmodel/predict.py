"""Predicted time of one training step: the layers' costs (costs.py) on a machine (machine.py), plus the
gradient reduction the trainer really runs (collectives.py), step by step as the trainer takes it.

    p = predict(model, batch_size=64, np=4, machine=machine.load("vm.yaml"), reduction="bucketed")
    p.step_s, p.compute_s, p.memory_s, p.comm_s, p.exposed_comm_s; p.layers (per-layer times)

Compute. Each phase of each layer (forward, backward-data, backward-weights) takes the longer of its
FLOPs at the rate of its kernel class and its bytes at the memory bandwidth on one thread (a roofline
per phase); at more threads its first machine.thread_serial_s seconds run as on one thread and the rest
at the thread speed-up of the layer's kernel class (Machine.threaded_seconds: small calls gain little
from threads); the phase counts as compute- or memory-bound by which was longer. The optimizer
update is memory-bound: SGD with momentum reads p, g and its buffer and writes p and the buffer (5
passes over the parameters' bytes), Adam 7, SGD without momentum 3. When the processes of a node ask
for more threads than it has cores, compute slows by that ratio.

Fixed costs (machine.overheads), which threads do not speed up (oversubscribed cores slow them like the
rest): every layer's forward call adds layer_forward_s (counted in its forward_s) and its backward call
layer_backward_s (counted in its backward_data_s, since the call happens even where backward-data is
skipped), or its kind's own pair where overheads.layer_calls has one; every parameter tensor adds parameter_s (the optimizer's loop), and every step step_s (data,
loss, the trainer's bookkeeping). Their sum is overhead_s.

Oversubscribed cores. Where a node's processes x threads exceed its cores, each collective is a point
where every rank must run at once, and the ranks off the cores are waited for while the waiting ones
poll: every collective of the step (the reducer's messages and the model-parallel groups') adds
overheads.oversubscribed_collective_s x (crowding - 1) / (MEASURED_CROWDING - 1), crowding being
processes x threads over cores (calibrate measures it at MEASURED_CROWDING = 2: twice as many ranks as
cores). It is a wait, so it counts as exposed communication (sync_s), whatever the progress model.

Communication (data parallelism). Every gradient is summed over the np processes by allreduce, with
the named algorithm (or the cheapest, "best") on the link the processes share: intra-node while they
fit on one node, inter-node otherwise, or both with "hierarchical". The messages are the reducer's own,
from the same pure function the reducer lays them out with (pydtnn.distributed.reducers.messages), each
cut into pieces of at most reducers/base.py's PIECE_BYTES as the reducer cuts it:
- blocking: after the whole backward, the gradient buffer;
- per_layer: one allreduce per gradient, started when its layer's backward ends;
- bucketed: gradients packed in reverse parameter order into buckets (the first one small), each
  started when its last gradient is ready; hierarchical: the same buckets, each reduced in two levels;
- topk: after backward, two allgathers of each replica's k indices (int64) and k values, after the
  selection's own passes over the gradients (step_parts.topk_selection_s).
- oktopk: after backward, the split's counts and its two alltoalls of each replica's k indices and values
  (priced as allgathers of k / P from each), the balanced gather of about k / P from each, and the estimates'
  small messages at their share of a step (layout.oktopk_messages); its selection priced as topk's.
- stale (--reduction_staleness 1): one allreduce of every gradient after backward, hidden behind the next step's
  forward and backward (all of it exposed where it would not progress during them: _unprogressed).
- powersgd: after backward, two allreduces, of every compressed matrix's P with the gradients sent whole and
  of every Q, after the products and passes of step_parts.powersgd_s.
An MPI library progresses a non-blocking collective only inside MPI calls, and the reducers call
test() between layers only: with progress="test" (the default, what MPICH does here) a collective's
transfer does not advance during a layer's computation, so the reduction is as exposed as a blocking
one and the strategies differ by their messages' count and sizes. progress="thread" models the
reducers' progress thread (--reduction_progress thread), or a library or network that progresses on
its own: collectives run one after another from the moment each is started, overlapping the rest of
backward; exposed communication is what remains after it. A link that moves posted bytes on its own
(Link.background: sockets, RDMA) progresses "test" collectives so too: each step's transfer goes on during the
layers, and the reducers' test() between layers starts the next. The progress modes are the reducers'
(reducers.PROGRESS), and so are the reductions (reducers.NAMES).
"""

from pydtnn import plan as plan_module
from pydtnn import recompute as recompute_module
from pydtnn.distributed import reducers
from pydtnn.distributed.model_parallel import plan
from pydtnn.errors import ConfigError
from pydtnn.perfmodel import collectives, split
from pydtnn.perfmodel.costs import layer_costs, parameter_bytes
from pydtnn.perfmodel.step_parts import (  # noqa: F401
    STATE_ARRAYS,
    UPDATE_PASSES,
    LayerTime,
    Prediction,
    accumulation_s,
    allreduce_seconds,
    gradient_messages,
    layer_times,
    micro_sizes,
    phase_seconds,
    profile_scales,
    recomputed,
    reducer_messages,
    reducer_work_s,
    reduction_seconds,
    state_arrays_of,
    thread_speedup,
    topk_selection_s,
    zero_costs,
)

# one process of "data" is sequential
PARALLEL = tuple(p for p in plan_module.PARALLEL if p != "sequential")
REDUCTIONS = reducers.NAMES
PROGRESS = reducers.PROGRESS
RECOMPUTE = recompute_module.MODES
MEASURED_CROWDING = 2.0  # ranks per core at which calibrate measures overheads.oversubscribed_collective_s


def _check_arguments(parallel, reduction, progress, optimizer, algorithm, recompute="none", zero=0, compression="none",
                     **counts):
    """ConfigError naming the first of predict's arguments that is not one of its choices, or, among counts,
    not a positive integer."""
    if parallel not in PARALLEL:
        raise ConfigError(f"parallel={parallel!r}; expected one of {', '.join(PARALLEL)}")
    for what, value, allowed in (("reduction", reduction, REDUCTIONS), ("progress", progress, PROGRESS),
                                 ("optimizer", optimizer, tuple(UPDATE_PASSES))):
        if value not in allowed:
            raise ConfigError(f"{what}={value!r}; expected one of {', '.join(allowed)}")
    if algorithm != "best" and algorithm not in collectives.algorithms("allreduce"):
        raise ConfigError(f"algorithm={algorithm!r}; expected best or one of "
                          f"{', '.join(collectives.algorithms('allreduce'))}")
    for what, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{what}={value!r}; expected a positive integer")
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={recompute!r}; expected one of {', '.join(RECOMPUTE)}")
    if zero:
        from pydtnn.distributed.zero import check_stage

        check_stage(zero, reduction, compression, progress)  # what pydtnn-train refuses, refused here too


def predict(model, batch_size, np, machine, reduction="bucketed", threads=1, algorithm="ring", progress="test",
            optimizer="sgd_momentum", bucket_mb=None, first_bucket_mb=None, parallel="data", name=None,
            model_parallel_size=None, density=None, compression="none", update_passes=None, micro_batches=1,
            recompute="none", pipeline_stages=None, schedule="1f1b", stage_starts=None, zero=0, rank=None,
            every=None, state_arrays=None):
    """The Prediction of one training step of `model` (built on a CPU backend) at batch_size samples per model
    replica (per process with data parallelism) over np processes, each with `threads` threads, on `machine`.
    parallel "model" splits every layer over the np processes, "hybrid" over groups of model_parallel_size
    (perfmodel/split.py). compression: the gradients' wire format ("none", "fp16": half the bytes, and a small
    allreduce of scales before each message; reducers.messages). update_passes: the update's passes over the
    parameters' bytes (update_passes()), else UPDATE_PASSES's of `optimizer`. bucket_mb, first_bucket_mb, density,
    rank, every: the reducer's options where it takes them; None (not given) is the reducer's own default
    (reducers.defaults); state_arrays: the optimizer's arrays per parameter that local SGD averages with them (None:
    STATE_ARRAYS's of `optimizer`). micro_batches: the batch cut into that many, their gradients summed, reduced once
    (--micro_batches); recompute: "none", "segments" or "all" (the layers whose forward runs again in backward are
    costed twice). parallel "pipeline" (pipeline_stages = np), or "hybrid" with pipeline_stages S (np / S pipelines):
    see predict_pipeline. zero: ZeRO's stage over the replicas (step_parts.zero_costs): the update of the largest
    shard, the allgather of the updated shards after it, and at stage 2 a reduce-scatter per bucket in place of the
    reducer's messages (step_parts.zero_messages); stage 3 reduce-scatters per layer and gathers each layer's
    parameters before it runs (layer_gathers), exposed as the bucketed reducer's are."""
    _check_arguments(parallel, reduction, progress, optimizer, algorithm, recompute, zero, compression,
                     batch_size=batch_size, np=np, threads=threads, micro_batches=micro_batches)
    if parallel == "pipeline" or (pipeline_stages or 1) > 1:
        from pydtnn.perfmodel.pipelined import predict_pipeline

        return predict_pipeline(model, batch_size, np, machine, pipeline_stages or np, micro_batches, schedule,
                                stage_starts, reduction=reduction, threads=threads, algorithm=algorithm,
                                progress=progress, optimizer=optimizer, bucket_mb=bucket_mb,
                                first_bucket_mb=first_bucket_mb, name=name, model_parallel_size=model_parallel_size,
                                density=density, compression=compression, update_passes=update_passes,
                                recompute=recompute, zero=zero, rank=rank, every=every, state_arrays=state_arrays)
    m = 1 if parallel == "data" else split.group_size(parallel, np, model_parallel_size)
    replicas, fixed, steps = np // m, machine.overheads, plan(model, m) if m > 1 else []
    held = split.split_model(model, m) if m > 1 else model  # what one process holds and computes
    grads = parameter_bytes(held)
    crowding = max(1.0, min(np, machine.processes_per_node) * threads / machine.cores)  # shared cores' slowdown
    sizes = micro_sizes(batch_size, micro_batches)
    again = recomputed(held, recompute)
    times, compute_s, memory_s, calls_s = step_layers(held, sizes, grads, machine, threads, crowding, again, model)
    forward_s = sum(t.forward_s for t in times)
    backward_s = sum(t.backward_data_s + t.backward_weights_s for t in times)
    param_bytes, itemsize = sum(grads.values()), model.backend.dtype.itemsize
    update_s = (update_passes or UPDATE_PASSES[optimizer]) * param_bytes / (machine.memory_bandwidth * thread_speedup(machine, threads)
                                                         / crowding)
    shapes = [g.shape for _, _, g in held.parameters()]
    memory_s += (accumulation_s(param_bytes, len(sizes), machine, threads, crowding)
                 + reducer_work_s(reduction, shapes, itemsize, density, rank, replicas, machine, threads, crowding))
    level = None if m == 1 else collectives.default_level(np, machine)  # replicas span the job's nodes
    share, zero_passes_s, flight_s, gather_s, gathers = zero_costs(zero, param_bytes, itemsize, replicas, machine,
                                                                   threads, crowding, algorithm, level, times,
                                                                   len(sizes), again)
    update_s, memory_s = update_s * share, memory_s + zero_passes_s
    group = [g for b in sizes for g in split.group_messages(steps, b, itemsize, m, machine, algorithm)]
    group_s = sum(seconds for *_, seconds in group)  # blocking, on the critical path
    overhead_s = calls_s + (len(model.parameters()) * fixed.parameter_s + fixed.step_s) * crowding
    forward_s += sum(seconds for phase, *_, seconds in group if phase == "forward")
    params = [(n, g.nbytes) for n, _, g in held.parameters()]
    shaping = dict(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, density=density, rank=rank, every=every,
                   shapes=shapes, replicas=replicas, state_arrays=state_arrays_of(optimizer, state_arrays))
    if reduction == "hierarchical":  # the bucketed layout, each bucket reduced in a node, across, and back
        algorithm, level = collectives.HIERARCHICAL, None
    messages, durations = gradient_messages(params, times, forward_s, reduction, itemsize, compression, shaping,
                                            len(sizes) > 1, zero, replicas, machine, algorithm, level)
    comm_s = sum(durations)
    collectives_per_step = (len(messages) + gathers if replicas > 1 else 0) + len(group)
    sync_s = collectives_per_step * oversubscribed_wait(machine, crowding)
    end_of_backward = forward_s + backward_s + sum(seconds for phase, *_, seconds in group if phase == "backward")
    exposed = _exposed(messages, durations, end_of_backward,
                       _unprogressed(machine, np, reduction, progress, messages if m == 1 and zero < 2 else None),
                       reduction == "stale")
    comm_s, exposed = comm_s + flight_s, exposed + gather_s  # ZeRO's allgathers: of the shards, or stage 3's
    return Prediction(
        model=name or model.name, batch_size=batch_size, np=np, threads=threads, parallel=parallel,
        reduction=reduction, algorithm=algorithm, progress=progress, machine=machine.name,
        step_s=compute_s + memory_s + update_s + overhead_s + exposed + group_s + sync_s, compute_s=compute_s,
        memory_s=memory_s + update_s, update_s=update_s, comm_s=comm_s + group_s + sync_s,
        exposed_comm_s=exposed + group_s + sync_s, messages=collectives_per_step, overhead_s=overhead_s,
        layers=times, model_parallel_size=m, group_comm_s=group_s, sync_s=sync_s, micro_batches=micro_batches,
        recompute=recompute, zero=zero,
    )


def _unprogressed(machine, np, reduction, progress, messages=None):
    """Whether the reduction's messages wait for the end of backward: blocking, or progress "test" where a link
    they cross moves bytes only inside MPI calls (not Link.background). Both levels (each step starts when a
    test() finds the last one done) for the hierarchical reducer, and the levels a node-aware MPI's allreduce over
    the job's nodes crosses (collectives.node_aware_levels; messages: [(ready, collective, bytes)] over all np
    processes, None where they run over groups of them)."""
    composed = (collectives.node_aware_levels("allreduce", np, machine)
                if messages is not None and all(c == "allreduce" for _, c, _ in messages) else None)
    levels = (("intra", "inter") if reduction == "hierarchical"
              else composed or (collectives.default_level(np, machine),))
    background = all(machine.link(level).background for level in levels)
    return reduction == "blocking" or (progress == "test" and not background)


def _exposed(messages, durations, end_of_backward, blocking, stale=False):
    """Seconds of the reduction's messages after backward ends: all of them where they do not progress during
    backward (blocking), else what is left of them run one after another from when each is ready; stale (the
    stale reducer): what is left of them after the next step's forward and backward, which they travel during."""
    if blocking:
        return sum(durations)
    if stale:
        return max(0.0, sum(durations) - end_of_backward)
    done = 0.0
    for (ready, _, _), d in zip(messages, durations):
        done = max(done, ready) + d
    return max(0.0, done - end_of_backward)


def predict_plan(model, plan, machine, batch_size=None, update_passes=None, algorithm="ring", name=None,
                 recompute="none", schedule="1f1b", stage_starts=None, state_arrays=None):
    """The Prediction of run plan `plan` (pydtnn.plan.RunPlan) for `model`: its layout (pipelines included),
    batch per replica (`batch_size` where the plan leaves it to the model's recipe), micro-batches, reduction
    with its compression, progress and options, and threads per process. update_passes: the update's
    (update_passes()), else SGD with momentum's; state_arrays: its state's arrays per parameter
    (optimizer_state_arrays()), else SGD with momentum's. recompute, schedule, stage_starts: the run's --recompute,
    --pipeline_schedule and --stage_boundaries. pydtnn-train --simulate and pydtnn-perfmodel predict both
    predict through here."""
    lay, red = plan.layout, plan.reduction
    if red.name is not None:  # a plan built in Python is checked as the flags' are: what the run would refuse
        reducers.validate(red.name, red.compression, red.progress)
    shaping = {k: v for k, v in red.options.items()
               if k in ("bucket_mb", "first_bucket_mb", "density", "rank", "every")}
    return predict(model, plan.batch_size or batch_size, lay.world_size, machine, reduction=red.name or "bucketed",
                   threads=plan.threads or 1, algorithm=algorithm, progress=red.progress, compression=red.compression,
                   update_passes=update_passes, parallel="data" if lay.parallel == "sequential" else lay.parallel,
                   model_parallel_size=lay.model_parallel_size if lay.parallel == "hybrid" else None, name=name,
                   micro_batches=plan.accumulation_steps, recompute=recompute, pipeline_stages=lay.pipeline_stages,
                   schedule=schedule, stage_starts=stage_starts, zero=plan.zero, state_arrays=state_arrays, **shaping)


def step_layers(held, sizes, grads, machine, threads, crowding, again=frozenset(), reference=None):
    """layer_times summed over micro-batches of `sizes` samples (each layer's LayerTime per step); reference: the
    whole model where `held` is a split share of it, whose profiled layers scale the split ones (profile_scales)."""
    cache, total = {}, None
    for b in sizes:
        if b not in cache:
            split_share = reference is not None and reference is not held
            scales = profile_scales(reference, b, machine, threads) if split_share else None
            cache[b] = layer_times(layer_costs(held, b), grads, machine, threads, crowding, again, scales)
        part = cache[b]
        if total is None:
            total = part
            continue
        times = [LayerTime(a.name, a.kind, a.algorithm, a.forward_s + t.forward_s, a.backward_data_s + t.backward_data_s,
                           a.backward_weights_s + t.backward_weights_s, a.bound, a.grad_bytes)
                 for a, t in zip(total[0], part[0])]
        total = (times, *(x + y for x, y in zip(total[1:], part[1:])))
    return total


def update_passes(optimizer, hyper):
    """Passes over the parameters' bytes of one update by `optimizer` (optim.NAMES) with hyperparameters
    `hyper` (optim.hyperparameters: every one it runs with), as the backend's updates make them: SGD reads p
    and g and writes p (3); momentum reads and writes its buffer (+2); weight decay forms g + decay x p in a
    temporary (+3: p read, the temporary written and read); Nesterov forms d + momentum x buffer in one (+2).
    Adam and Nadam read p, g and both moments and write p and both moments (7), their L2 decay as SGD's (+3);
    AdamW decays p in place (+2). RMSProp reads p, g and its square average and writes p and it (5)."""
    momentum, decay = hyper.get("momentum") or 0.0, hyper.get("weight_decay") or 0.0
    if optimizer == "sgd":
        return 3 + 2 * bool(momentum) + 3 * bool(decay) + 2 * bool(momentum and hyper.get("nesterov"))
    if optimizer == "rmsprop":
        return 5 + 2 * bool(momentum) + 3 * bool(decay)
    return 7 + (2 if optimizer == "adamw" else 3) * bool(decay)


def optimizer_state_arrays(optimizer, hyper):
    """Arrays of state per parameter that `optimizer` (optim.NAMES) keeps with hyperparameters `hyper`, which local
    SGD averages with the parameters: SGD's momentum buffer (1 with momentum), RMSProp's square average and its
    momentum buffer, Adam's, AdamW's and Nadam's two moments."""
    momentum = bool(hyper.get("momentum"))
    return {"sgd": int(momentum), "rmsprop": 1 + int(momentum)}.get(optimizer, 2)


def oversubscribed_wait(machine, crowding):
    """Seconds one collective waits for ranks off the cores at `crowding` ranks x threads per core (see
    the module docstring): 0 where the cores suffice, the measured cost at MEASURED_CROWDING, linear in
    the excess between."""
    if crowding <= 1.0:
        return 0.0
    return machine.overheads.oversubscribed_collective_s * (crowding - 1.0) / (MEASURED_CROWDING - 1.0)

