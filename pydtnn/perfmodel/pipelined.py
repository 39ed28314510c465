"""Predicted training step of a pipeline (--parallel pipeline, or hybrid with --pipeline_stages), as
pydtnn/distributed/pipeline.py runs it: the model cut as pydtnn-train cuts it (stage_cut), each stage's ops
costed as predict.py costs layers (split over a model-parallel group where it has one, perfmodel/split.py),
laid out by the stages' schedule (schedule.py), the stages' reductions and updates after them.

    p = predict(model, batch_size=32, np=4, machine=m, parallel="pipeline", micro_batches=8)  # predict.py calls
    p.bubble_s, p.p2p_s, p.stages                                                            # predict_pipeline
"""

from math import prod as math_prod

from pydtnn.distributed.model_parallel import plan
from pydtnn.errors import ConfigError
from pydtnn.perfmodel import collectives, split
from pydtnn.perfmodel.costs import layer_costs, parameter_bytes
from pydtnn.perfmodel.schedule import timeline
from pydtnn.perfmodel.step_parts import (
    UPDATE_PASSES,
    Prediction,
    accumulation_s,
    gather_phases,
    gradient_messages,
    layer_times,
    micro_sizes,
    phase_seconds,
    profile_scales,
    recomputed,
    reducer_work_s,
    state_arrays_of,
    thread_speedup,
    zero_costs,
)


def message_seconds(nbytes, machine, level):
    """One point-to-point message of nbytes on link `level`: latency + bytes / bandwidth."""
    link = machine.link(level)
    return link.latency_s + nbytes * link.beta if nbytes else 0.0


def predict_pipeline(model, batch_size, np, machine, stages, micro_batches=1, schedule="1f1b", stage_starts=None,
                     reduction="bucketed", threads=1, algorithm="ring", progress="test", optimizer="sgd_momentum",
                     bucket_mb=None, first_bucket_mb=None, name=None, model_parallel_size=None, density=None,
                     compression="none", update_passes=None, recompute="none", zero=0, rank=None, every=None,
                     state_arrays=None):
    """The Prediction of a pipeline's step: np / (stages x M) pipelines of `stages` stages, each stage's layers
    split over M = model_parallel_size consecutive processes (default 1), the model cut as pydtnn-train cuts it
    (pipeline.Cut.of: balanced unit_seconds, or at stage_starts), batch_size samples per pipeline in
    micro_batches micro-batches run by `schedule` (gpipe or 1f1b). A split stage's ops are its layers' as rank
    0 of its group holds them (split.py), with its group's collectives on their critical path.

    Each stage's forward and backward of each micro-batch are its layers' (layer_times, recomputation
    included); each activation and its gradient cross to the neighbouring stage as one message (latency +
    bytes / bandwidth) on the intra-node link where both stages share a node (processes_per_node
    consecutive ranks), else the inter-node one, overlapping computation. The timeline (schedule.py)
    places every stage's ops as the stages run them. Oversubscribed cores slow the ops by the crowding
    of the stages that are busy, not of every process (_pipeline_parts): a waiting stage sleeps. After the last op: the last stage broadcasts the
    loss and outputs to the stages; each stage's gradients are reduced across the replicas (its share of
    the bytes, as the reducer lays it out; after the micro-batches, so exposed) and updated. The step is
    the slowest stage's end plus those; compute_s, memory_s and overhead_s are the busiest stage's,
    exposed_comm_s the broadcasts and the reduction of the stage whose reduction and update end the step,
    and bubble_s is what is left: the busiest stage's fill and drain, and its waits for messages."""
    from pydtnn.distributed import pipeline

    if schedule not in pipeline.SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}; expected one of {', '.join(pipeline.SCHEDULES)}")
    m = model_parallel_size or 1
    if np % (stages * m):
        raise ConfigError(f"pipeline_stages={stages} x model_parallel_size={m} does not divide np={np}; expected "
                          "a divisor")
    replicas = np // (stages * m)
    cut, held, sizes, crowding, fwd, bwd, busy, first_times, msg, line = _pipeline_parts(
        model, batch_size, stages, machine, micro_batches, schedule, stage_starts, threads, recompute, np, m,
        algorithm, (replicas, collectives.default_level(np, machine)) if zero == 3 else None)
    itemsize = model.backend.dtype.itemsize
    outputs = batch_size * int(math_prod(model.output_shape)) * itemsize
    bcast = sum(collectives.seconds("broadcast", "binomial_tree", n, stages, machine) for n in (outputs, 8))
    passes = update_passes or UPDATE_PASSES[optimizer]
    shaping = {"bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb, "density": density, "rank": rank,
               "every": every, "state_arrays": state_arrays_of(optimizer, state_arrays)}
    after = [_stage_after(stage, replicas, len(sizes), machine, threads, crowding, passes, reduction, algorithm,
                          compression, collectives.default_level(np, machine), shaping, zero) for stage, _ in held]
    tail = max(red + upd + fix for red, _, upd, fix in after)
    step_s = line.end + bcast + tail
    critical = max(range(stages), key=lambda s: line.busy[s] + sum(after[s][::2]) + after[s][3])  # the busiest
    red, n_sent, upd, fix = after[critical]
    compute_s, memory_s = busy[critical]["compute_s"], busy[critical]["memory_s"] + upd
    overhead_s = busy[critical]["calls_s"] + fix
    group_s = busy[critical]["group_s"]  # its group's collectives: blocking, inside its ops
    last = max(range(stages), key=lambda s: after[s][0] + after[s][2] + after[s][3])  # whose tail ends the step
    exposed = bcast + after[last][0] + group_s + busy[critical]["gather_s"]  # ZeRO 3's, inside its ops
    stage_rows = [{"stage": s, "first": cut.unit_names[a], "last": cut.unit_names[b - 1],
                   "forward_s": sum(fwd[s]), "backward_s": sum(bwd[s]), "message_s": sum(msg[s]),
                   "busy_s": line.busy[s], "idle_s": line.idle[s], "reduce_s": after[s][0], "update_s": after[s][2],
                   "group_s": busy[s]["group_s"]}
                  for s, (a, b) in enumerate(zip(cut.bounds[:-1], cut.bounds[1:]))]
    return Prediction(
        model=name or model.name, batch_size=batch_size, np=np, threads=threads,
        parallel="pipeline" if replicas == 1 else "hybrid", reduction=reduction, algorithm=algorithm,
        progress=progress, machine=machine.name, step_s=step_s, compute_s=compute_s, memory_s=memory_s,
        update_s=upd, comm_s=red + bcast + group_s + busy[critical]["flight_s"] + sum(sum(r) for r in msg),
        exposed_comm_s=exposed, messages=n_sent + 2 + busy[critical]["collectives"], overhead_s=overhead_s, model_parallel_size=m,
        group_comm_s=group_s, layers=first_times, micro_batches=micro_batches,
        recompute=recompute, pipeline_stages=stages, schedule=schedule, zero=zero,
        bubble_s=step_s - (compute_s + memory_s + overhead_s + exposed), p2p_s=sum(sum(r) for r in msg),
        stages=stage_rows,
    )


def unit_seconds(model, batch_size, machine, threads=1):
    """Predicted seconds of a training forward and backward of each unit of pipeline.units(model) (its layers'
    LayerTimes at batch_size, one process on `machine`): the costs pydtnn-train balances a pipeline's cut by."""
    from pydtnn.distributed import pipeline

    unit_list = pipeline.units(model)
    of_unit = pipeline.layer_stages(unit_list, range(len(unit_list) + 1))
    unit_of = {path: of_unit[id(layer)] for path, layer in model.root.named_layers() if id(layer) in of_unit}
    times = layer_times(layer_costs(model, batch_size), parameter_bytes(model), machine, threads, 1.0)[0]
    out = [0.0] * len(unit_list)
    for t in times:
        out[unit_of[t.name]] += t.total_s
    return out


def stage_cut(model, stages, batch_size, micro_batches, machine, threads=1, starts=None):
    """The pipeline.Cut of `model` into `stages` as pydtnn-train, predict and the memory model all take it: at
    `starts` (--stage_boundaries), else balancing unit_seconds of a micro-batch (batch_size // micro_batches
    samples, at least 1) at `threads` threads on `machine`."""
    from pydtnn.distributed import pipeline

    costs = unit_seconds(model, max(1, batch_size // micro_batches), machine, threads)
    return pipeline.Cut.of(model, stages, starts, costs=costs)


def _pipeline_parts(model, batch_size, stages, machine, micro_batches, schedule, stage_starts, threads, recompute,
                    processes=None, m=1, algorithm="ring", gathers=None):
    """(cut, [(stage s's model as one process of it holds it, its group's collectives' plan)], micro-batch sizes,
    crowding, forward[s][i], backward[s][i], busy per stage, the first micro-batch's LayerTimes, messages[s][i], the
    Timeline) of a pipeline's micro-batches. m: processes per stage (its layers split over a model-parallel group,
    whose collectives are on the critical path of its ops); processes: the job's (default one pipeline's), which fill
    nodes in turn; where a node's processes x threads exceed its cores, each op slows by that ratio times the
    stages' busy share, the layout repeated until that share settles. gathers: (replicas, level) of ZeRO stage 3,
    whose gathers of each layer's parameters (step_parts.gather_phases) go into each op, as far as exposed."""
    cut = stage_cut(model, stages, batch_size, micro_batches, machine, threads, stage_starts)
    held = stage_models(model, cut, m)
    itemsize = model.backend.dtype.itemsize
    full = max(1.0, min(processes or stages * m, machine.processes_per_node) * threads / machine.cores)
    sizes = micro_sizes(batch_size, micro_batches)
    again = {p: (s, k) for s, (a, b) in enumerate(zip(cut.bounds[:-1], cut.bounds[1:]))  # {path: its segment}
             for p, k in recomputed(model, recompute, slice(a, b)).items()}
    ppn = machine.processes_per_node  # process j of stage s (of the first pipeline) is rank s m + j
    levels = ["intra" if all((s * m + j) // ppn == ((s + 1) * m + j) // ppn for j in range(m)) else "inter"
              for s in range(stages - 1)]  # each of a stage's processes sends the whole activation to its peer
    msg = [[message_seconds(b * int(math_prod(held[s][0].output_shape)) * itemsize, machine, levels[s]) for b in sizes]
           for s in range(stages - 1)] + [[0.0] * len(sizes)]
    costs = [{b: layer_costs(stage, b) for b in set(sizes)} for stage, _ in held]  # what crowding does not change
    group = [{b: split.group_messages(steps, b, itemsize, m, machine, algorithm) for b in set(sizes)}
             for _, steps in held]
    scales = {b: profile_scales(model, b, machine, threads) for b in set(sizes)} if m > 1 else {}
    crowding = 1.0
    for attempt in range(8):  # a waiting stage sleeps and leaves its core: the cores are crowded by the busy share
        fwd, bwd, busy, first_times = _stage_times(held, sizes, costs, group, machine, threads, crowding, again,
                                                   gathers and (*gathers, algorithm), scales)
        line = timeline(fwd, bwd, msg, msg, schedule)
        settled = max(1.0, full * sum(line.busy) / (stages * line.end)) if line.end > 0 else 1.0
        if abs(settled - crowding) <= 1e-3 * crowding or attempt == 7:
            break  # the layout is the one computed at `crowding`
        crowding = settled
    return cut, held, sizes, crowding, fwd, bwd, busy, first_times, msg, line


def stage_models(model, cut, m=1):
    """[(stage s's Model as one process of it holds it, model_parallel.plan of its split)] of `model` cut by `cut`:
    the stage's units (pipeline.stage_model), split over a model-parallel group of m as rank 0 of it holds them
    (split.split_model: the most loaded), as pydtnn-train builds a stage."""
    from pydtnn.distributed import pipeline

    out = []
    for s in range(len(cut.bounds) - 1):
        stage = pipeline.stage_model(model, cut.units, cut.bounds, s)
        out.append((split.split_model(stage, m), plan(stage, m)) if m > 1 else (stage, []))
    return out


def predict_pipeline_timeline(model, batch_size, stages, machine, micro_batches=1, schedule="1f1b", stage_starts=None,
                              threads=1, recompute="none"):
    """The schedule.Timeline of one pipeline's micro-batches as predict_pipeline lays them out (its ops per stage)."""
    return _pipeline_parts(model, batch_size, stages, machine, micro_batches, schedule, stage_starts, threads,
                           recompute)[-1]


def _stage_times(held, sizes, costs, group, machine, threads, crowding, again, gathers=None, scales=None):
    """(forward[s][i], backward[s][i] seconds, each stage's busy {"compute_s", "memory_s", "calls_s", "group_s",
    "collectives", "gather_s", "flight_s"}, the first micro-batch's LayerTimes) of the pipeline's stages (held:
    stage_models) at micro-batches of `sizes`; costs[s]: {micro-batch size: costs.layer_costs of stage s};
    group[s]: {size: its split.group_messages}; gathers: (replicas, level, algorithm) of ZeRO stage 3's gathers;
    scales: {size: step_parts.profile_scales of the whole model} for stages split over groups."""
    stages = len(held)
    fwd = [[0.0] * len(sizes) for _ in range(stages)]
    bwd = [[0.0] * len(sizes) for _ in range(stages)]
    busy = [{"compute_s": 0.0, "memory_s": 0.0, "calls_s": 0.0, "group_s": 0.0, "collectives": 0, "gather_s": 0.0,
             "flight_s": 0.0} for _ in range(stages)]
    first_times = []
    for s, (stage, _) in enumerate(held):
        grads = parameter_bytes(stage)
        per_size = {b: layer_times(costs[s][b], grads, machine, threads, crowding, again, (scales or {}).get(b))[0]
                    for b in costs[s]}
        first_times += per_size[sizes[0]]
        for i, b in enumerate(sizes):
            if gathers is not None:  # each layer's parameters gathered before it runs, as far as not hidden
                replicas, level, algorithm = gathers  # nothing counted held: an upper bound of the gathers
                (f_in, f_out, f_n), _, (b_in, b_out, b_n) = gather_phases(per_size[b], 1, replicas, machine,
                                                                          algorithm, level, again, held=(0, 0, 0))
                fwd[s][i], bwd[s][i] = fwd[s][i] + f_out, bwd[s][i] + b_out
                busy[s]["gather_s"] += f_out + b_out
                busy[s]["flight_s"] += f_in + b_in
                busy[s]["collectives"] += f_n + b_n
            for c, t in zip(costs[s][b], per_size[b]):
                fwd[s][i] += t.forward_s
                bwd[s][i] += t.backward_data_s + t.backward_weights_s
                parts = [phase_seconds(ph, c.kernel_class, machine, threads, crowding)
                         for ph in (c.forward, c.backward_data, c.backward_weights)]
                parts += [parts[0]] if t.name in again else []
                for sec, bound in parts:
                    busy[s]["compute_s" if bound == "compute" else "memory_s"] += sec
                busy[s]["calls_s"] += t.total_s - sum(sec for sec, _ in parts)
            for phase, *_, sec in group[s][b]:  # blocking collectives inside the stage's group
                (fwd if phase == "forward" else bwd)[s][i] += sec
                busy[s]["group_s"] += sec
                busy[s]["collectives"] += 1
    return fwd, bwd, busy, first_times


def _stage_after(stage, replicas, micro_batches, machine, threads, crowding, passes, reduction, algorithm,
                 compression, level, shaping, zero=0):
    """(reduction seconds, its collectives, update seconds, per-parameter and per-step costs) of a stage (its Model
    as one process holds it) after its micro-batches: its gradients reduced across the replicas (all at once),
    summed and updated; with ZeRO (step_parts.zero_costs) its shard updated, reduce-scattered bucket by bucket at
    stage 2 (step_parts.zero_messages), and the shards allgathered (counted in the reduction)."""
    itemsize = stage.backend.dtype.itemsize
    own = [(n, g.nbytes) for n, _, g in stage.parameters()]
    shapes = [g.shape for _, _, g in stage.parameters()]
    sent, durations = ([], []) if not own or replicas <= 1 else gradient_messages(
        own, [], 0.0, reduction, itemsize, compression, {**shaping, "shapes": shapes, "replicas": replicas}, True, zero, replicas, machine,
        algorithm, level)
    red = sum(durations)
    nbytes = sum(nb for _, nb in own)
    share, passes_s, _, gather_s, gathers = zero_costs(zero, nbytes, itemsize, replicas, machine, threads, crowding,
                                                       algorithm, level)  # stage 3's gathers: in the ops
    red += gather_s
    sent = sent + [None] * gathers
    upd = share * passes * nbytes / (machine.memory_bandwidth * thread_speedup(machine, threads) / crowding)
    upd += (accumulation_s(nbytes, micro_batches, machine, threads, crowding) + passes_s
            + reducer_work_s(reduction, shapes, itemsize, shaping.get("density"), shaping.get("rank"), replicas,
                             machine, threads, crowding))
    fixed = machine.overheads
    return red, len(sent), upd, (len(own) * fixed.parameter_s + fixed.step_s) * crowding
