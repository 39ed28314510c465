"""The parts a predicted step is made of, shared by predict.py (one replica's step) and pipelined.py (a
pipeline's): the Prediction and LayerTime records, a layer's phases on a machine (a roofline per phase, threads,
crowded cores), micro-batches and recomputation, and the reducer's messages with their seconds. predict.py's
docstring says how each is modelled."""

import math
import statistics
from dataclasses import asdict, dataclass, field

from pydtnn import recompute as recompute_module
from pydtnn.distributed import reducers
from pydtnn.distributed.reducers.layout import powersgd_matrices, topk_counts
from pydtnn.perfmodel import collectives

UPDATE_PASSES = {"sgd": 3, "sgd_momentum": 5, "adam": 7}
STATE_ARRAYS = {"sgd": 0, "sgd_momentum": 1, "adam": 2}  # the optimizer's arrays per parameter (local SGD's average)


def state_arrays_of(optimizer, given=None):
    """`given` (the optimizer's state arrays per parameter), else STATE_ARRAYS's of `optimizer` (an UPDATE_PASSES
    name)."""
    return STATE_ARRAYS[optimizer] if given is None else given


@dataclass(frozen=True)
class LayerTime:
    """One layer's predicted seconds per phase and what bounds each (compute or memory)."""

    name: str
    kind: str
    algorithm: str | None
    forward_s: float
    backward_data_s: float
    backward_weights_s: float
    bound: str
    grad_bytes: int

    @property
    def total_s(self):
        return self.forward_s + self.backward_data_s + self.backward_weights_s


@dataclass
class Prediction:
    """A predicted training step. step_s = compute_s + memory_s + overhead_s + exposed_comm_s (the update is in
    memory_s; the layers' fixed costs, the per-parameter and the per-step ones in overhead_s)."""

    model: str
    batch_size: int
    np: int
    threads: int
    parallel: str
    reduction: str
    algorithm: str
    progress: str
    machine: str
    step_s: float
    compute_s: float
    memory_s: float
    update_s: float
    comm_s: float
    exposed_comm_s: float
    messages: int
    overhead_s: float = 0.0
    layers: list = field(default_factory=list)
    model_parallel_size: int = 1
    group_comm_s: float = 0.0
    sync_s: float = 0.0  # waits at the collectives for ranks off oversubscribed cores (in exposed_comm_s)
    micro_batches: int = 1
    recompute: str = "none"
    pipeline_stages: int = 1
    schedule: str | None = None  # a pipeline's
    bubble_s: float = 0.0  # a pipeline's busiest stage waiting: the fill and drain, and for messages
    p2p_s: float = 0.0  # a pipeline's point-to-point messages of a step, all of them (they overlap computing)
    stages: list = field(default_factory=list)  # a pipeline's per stage: {"first", "last", "forward_s", ...}
    zero: int = 0  # ZeRO's stage over the replicas

    @property
    def global_batch(self):
        """Samples per step over all processes: batch_size per model replica times the replicas."""
        return self.batch_size * (self.np // (self.model_parallel_size * self.pipeline_stages))

    @property
    def samples_per_second(self):
        """Training throughput: the global batch over the step's seconds."""
        return self.global_batch / self.step_s if self.step_s > 0 else math.inf

    def to_dict(self):
        d = asdict(self)
        d["layers"] = [{**asdict(t), "total_s": t.total_s} for t in self.layers]
        d["global_batch"], d["samples_per_second"] = self.global_batch, self.samples_per_second
        return d


def thread_speedup(machine, threads, kernel_class=None):
    """The machine's speed-up at `threads` threads over one (of `kernel_class` where it has its own);
    see Machine.thread_speedup."""
    return machine.thread_speedup(threads, kernel_class)


def phase_seconds(phase, kernel_class, machine, threads=1, crowding=1.0):
    """(seconds, bound) of one phase: the longer of its FLOPs at its class's rate and its bytes at the
    memory bandwidth on one thread, at `threads` threads by Machine.threaded_seconds (the class's
    speed-up beyond the machine's serial part of a call), times `crowding` (oversubscribed cores)."""
    if phase.flops == 0 and phase.bytes == 0:
        return 0.0, "compute"
    compute = phase.flops / machine.rates[kernel_class]
    memory = phase.bytes / machine.memory_bandwidth
    one, bound = (compute, "compute") if compute >= memory else (memory, "memory")
    return machine.threaded_seconds(one, threads, kernel_class) * crowding, bound


def allreduce_seconds(nbytes, p, machine, algorithm, level=None):
    if p <= 1 or nbytes == 0:
        return 0.0
    if algorithm == "best":
        return collectives.best("allreduce", nbytes, p, machine, level=level)[1]
    if algorithm == collectives.HIERARCHICAL:
        level = None
    return collectives.seconds("allreduce", algorithm, nbytes, p, machine, level=level)


def micro_sizes(batch_size, micro_batches):
    """Samples of each micro-batch of a step, as the steps cut a batch (step.micro_bounds); the empty ones
    (more micro-batches than samples) left out, as the steps skip them."""
    from pydtnn.step import micro_bounds

    return [b - a for a, b in micro_bounds(batch_size, micro_batches) if b > a]


def recomputed(model, mode, unit_slice=slice(None)):
    """{path: its segment} of the layers whose forward runs again in backward under recompute `mode`
    (pydtnn.recompute): those of every segment of the units but the last; unit_slice: the units of a pipeline
    stage. A mapping: `name in recomputed(...)` asks whether a layer runs again."""
    if mode == "none":
        return {}
    units = [(path, layer) for path, layer, _ in model.units()][unit_slice]
    bounds = recompute_module.segments(len(units), mode)
    return {p: k for k, (a, b) in enumerate(zip(bounds[:-2], bounds[1:-1])) for path, unit in units[a:b]
            for p, _ in unit.named_layers(path)}


def layer_times(costs, grads, machine, threads, crowding, again=frozenset(), scales=None):
    """([LayerTime], compute_s, memory_s, calls_s) of one forward and backward of `costs` (costs.layer_costs);
    the layers named in `again` run their forward twice, the second time in backward (recomputation). Where
    the machine's layer profile has a layer's measured times, its forward (call and phase) and its backward
    (call and both phases) are scaled, each as a whole, to them (times crowding); a layer it lacks whose kind and
    algorithm `scales` has (profile_scales: a split layer) is scaled by that ratio of measured to roofline."""
    fixed = machine.overheads
    profile = machine.layer_profile
    times, compute_s, memory_s, calls_s = [], 0.0, 0.0, 0.0
    for c in costs:
        call_fwd, call_bwd = (s * crowding for s in fixed.call_s(c.kind))
        parts = [phase_seconds(ph, c.kernel_class, machine, threads, crowding)
                 for ph in (c.forward, c.backward_data, c.backward_weights)]
        measured = profile.seconds(c, threads) if profile is not None else None
        ratio = (scales or {}).get((c.kind, c.algorithm)) if measured is None else None
        if ratio is not None:
            measured = (ratio[0] * (call_fwd + parts[0][0]) / crowding,
                        ratio[1] * (call_bwd + parts[1][0] + parts[2][0]) / crowding)
        if measured is not None:
            (call_fwd, call_bwd), parts = _to_measured(call_fwd, call_bwd, parts, measured, crowding)
        repeat = parts[0][0] if c.name in again else 0.0
        if c.name in again:
            parts.append(parts[0])
            call_bwd += call_fwd
        calls_s += call_fwd + call_bwd
        for s, bound in parts:
            compute_s += s if bound == "compute" else 0.0
            memory_s += s if bound == "memory" else 0.0
        heavier = max(parts[:3], key=lambda t: t[0])[1]
        (fwd, _), (bwd_data, _), (bwd_weights, _) = parts[:3]
        times.append(LayerTime(c.name, c.kind, c.algorithm, fwd + call_fwd, bwd_data + repeat + call_bwd, bwd_weights,
                               heavier, grads.get(c.name, 0)))
    return times, compute_s, memory_s, calls_s


def profile_scales(model, batch, machine, threads):
    """{(kind, algorithm): (forward, backward) ratio of measured to roofline time}, the median over the layers of
    the whole `model` at `batch` samples that the machine's layer profile has, for the layers it lacks (the
    model's layers split over a group); {} without a profile (nothing costed)."""
    from pydtnn.perfmodel.costs import layer_costs

    profile, ratios = machine.layer_profile, {}
    for c in layer_costs(model, batch) if profile is not None else ():
        measured = profile.seconds(c, threads)
        if measured is None:
            continue
        call_fwd, call_bwd = machine.overheads.call_s(c.kind)
        parts = [phase_seconds(ph, c.kernel_class, machine, threads)[0]
                 for ph in (c.forward, c.backward_data, c.backward_weights)]
        roof = (call_fwd + parts[0], call_bwd + parts[1] + parts[2])
        if roof[0] > 0 and roof[1] > 0:
            ratios.setdefault((c.kind, c.algorithm), []).append((measured[0] / roof[0], measured[1] / roof[1]))
    return {k: tuple(statistics.median(r[i] for r in v) for i in (0, 1)) for k, v in ratios.items()}


def _to_measured(call_fwd, call_bwd, parts, measured, crowding):
    """((forward call, backward call), phase parts) scaled so that forward (its call and phase) and backward (its
    call and two phases) take the measured (forward_s, backward_s) times crowding; a side the roofline gives no
    time takes it all in its call."""
    out, calls = list(parts), []
    for call, idx, seconds in ((call_fwd, (0,), measured[0]), (call_bwd, (1, 2), measured[1])):
        total = call + sum(parts[i][0] for i in idx)
        scale = seconds * crowding / total if total > 0 else 0.0
        for i in idx:
            out[i] = (parts[i][0] * scale, parts[i][1])
        calls.append(call * scale if total > 0 else seconds * crowding)
    return tuple(calls), out


def accumulation_s(param_bytes, micro_batches, machine, threads, crowding):
    """Seconds summing micro-batches' gradients (Step._accumulated): the first written into the sum (2
    passes over the gradients' bytes), each later one scaled and added (4), the sum copied back (2)."""
    if micro_batches <= 1:
        return 0.0
    passes = 2 + 4 * (micro_batches - 1) + 2
    return passes * param_bytes / (machine.memory_bandwidth * thread_speedup(machine, threads) / crowding)


TOPK_PASSES = 9.5  # TopKReducer.finish's passes over the gradients' bytes (topk_selection_s)
LINE_BYTES = 64  # a cache line: what one scattered read or write of an entry moves


def topk_selection_s(reduction, param_bytes, itemsize, density, replicas, machine, threads, crowding):
    """Seconds of the topk reducer's own work after backward (TopKReducer.finish), 0.0 for the other reducers
    or one replica: TOPK_PASSES over the gradients' bytes (this rank's weight applied 2, the residual added 3,
    the magnitudes 2, the threshold compared 1.25 and its mask read 0.25, the sum's buffer cleared 1) and
    (2 + replicas) scattered cache lines per sent entry (its value read, its residual cleared, and the replicas'
    sums added), all at the memory bandwidth. That is the reducer over the model's own gradient buffer, as the
    trainer runs it; over packed copies (a Python API without the buffer) it also copies them in and out.
    density: the reducer's (None: its default); the selection "global". The oktopk reducer is priced alike, its
    threshold's pass over the magnitudes standing for topk's, with 5 scattered lines per entry whatever replicas."""
    if reduction not in ("topk", "oktopk") or replicas <= 1:
        return 0.0
    n = param_bytes // itemsize
    k = topk_counts([n], reducers.defaults(reduction)["density"] if density is None else density, "global")[0]
    sums = replicas if reduction == "topk" else 3  # oktopk: its region's sum added, the sum read, the result written
    moved = TOPK_PASSES * param_bytes + (2 + sums) * k * LINE_BYTES
    return moved / (machine.memory_bandwidth * thread_speedup(machine, threads) / crowding)


POWERSGD_PASSES = 13  # PowerSGDReducer.finish's passes over the gradients' bytes (powersgd_s)


def powersgd_s(reduction, shapes, itemsize, rank, replicas, machine, threads, crowding):
    """Seconds of the powersgd reducer's own work after backward (PowerSGDReducer.finish), 0.0 for the other
    reducers or one replica: per compressed n x m matrix at rank r (layout.powersgd_matrices, PyTorch's rule) the
    products M Q, M^T P and P Q^T (6 n m r flops) and P's QR (4 n r^2) at the machine's GEMM rate, and
    POWERSGD_PASSES over the gradients' bytes at the memory bandwidth (packed with this rank's weight 2, the
    residual added 3, M read by two products 2, the approximation written 1, the residual updated 3, unpacked
    2). rank: the reducer's (None: its default); shapes: the gradients' shapes."""
    if reduction != "powersgd" or replicas <= 1:
        return 0.0
    own = reducers.defaults("powersgd")
    mats = powersgd_matrices(shapes, own["rank"] if rank is None else rank, own["min_compression_rate"])
    flops = sum(6 * n * m * r + 4 * n * r * r for n, m, r in (mat for mat in mats if mat))
    nbytes = sum(math.prod(s) for s in shapes) * itemsize
    speedup = thread_speedup(machine, threads)
    return (flops / (machine.rates["gemm"] * speedup) + POWERSGD_PASSES * nbytes / (machine.memory_bandwidth * speedup)
            ) * crowding


def reducer_work_s(reduction, shapes, itemsize, density, rank, replicas, machine, threads, crowding):
    """Seconds of a reducer's own work after backward over gradients of these shapes: topk's selection
    (topk_selection_s), powersgd's products and passes (powersgd_s); 0.0 for the dense reducers."""
    nbytes = sum(math.prod(s) for s in shapes) * itemsize
    return (topk_selection_s(reduction, nbytes, itemsize, density, replicas, machine, threads, crowding)
            + powersgd_s(reduction, shapes, itemsize, rank, replicas, machine, threads, crowding))


def reduction_seconds(collective, nbytes, p, machine, algorithm, level):
    """Seconds of one reducer message of nbytes per replica over p replicas: an allreduce, an allgather (topk) of
    every replica's nbytes, or an alltoall (oktopk) of nbytes each replica scatters over all, priced as the
    allgather of nbytes / p from each (a pairwise exchange sends what a ring allgather does)."""
    if collective == "allreduce":
        return allreduce_seconds(nbytes, p, machine, algorithm, level)
    if p <= 1:
        return 0.0
    if collective == "alltoall":
        nbytes = nbytes / p
    if algorithm in ("best", collectives.HIERARCHICAL):
        return collectives.best("allgather", p * nbytes, p, machine, level=level)[1]
    return collectives.seconds("allgather", algorithm if algorithm in collectives.algorithms("allgather") else "ring",
                               p * nbytes, p, machine, level=level)


def reducer_messages(params, times, forward_s, reduction, itemsize, compression="none", after=False, **options):
    """[(seconds into the step when the message can start, collective, bytes per replica)] in the order the
    reducer starts them (reducers.messages); params: [(parameter name, gradient bytes)] in state-dict order;
    options: the reducer's own that shape its messages (those it does not take are left out). after: every
    gradient is reported at the end of backward (micro-batches: the reducer replays them after the last); options
    "shapes": the gradients' shapes, where the reducer's messages follow them (powersgd); "replicas": the ranks
    they are exchanged over, where they follow it (oktopk); "state_arrays": the optimizer's arrays per parameter
    (local SGD averages them with the parameters)."""
    when = ready_times(params, times, forward_s, after)
    own = reducers.defaults(reduction)
    sent = reducers.messages(reduction, [n // itemsize for _, n in params], itemsize, compression,
                             shapes=options.get("shapes"), replicas=options.get("replicas"),
                             state_arrays=options.get("state_arrays"),
                             **{k: v for k, v in options.items() if k in own})
    end = forward_s + sum(lt.backward_data_s + lt.backward_weights_s for lt in times)  # of backward
    starts = [end if m.params is None else max(when[i] for i in m.params) for m in sent]
    return sorted(((s, m.collective, m.nbytes) for s, m in zip(starts, sent)), key=lambda x: x[0])


def ready_times(params, times, forward_s, after=False):
    """[seconds into the step when each gradient of `params` ([(name, bytes)], state-dict order) is ready]: its
    layer's backward done (times: the layers' LayerTimes in forward order, backward starting at forward_s), or
    all at the end of backward (after: micro-batches, whose gradients are reported after the last)."""
    ready, t = {}, forward_s
    for lt in reversed(times):  # backward runs the layers in reverse order
        t += lt.backward_data_s + lt.backward_weights_s
        ready[lt.name] = t
    return [t if after else ready.get(name.rsplit(".", 1)[0], t) for name, _ in params]


def zero_messages(params, times, forward_s, itemsize, after=False, bucket_mb=None, first_bucket_mb=None, stage=2):
    """[(seconds into the step when it can start, "reduce_scatter", bytes per replica)] of ZeRO stage 2's
    reduction: one reduce-scatter per bucket (zero.buckets: the bucketed reducer's buckets), started once its
    gradients are ready (ready_times), in the order they start; at stage 3 one per layer (zero.layer_spans)."""
    from pydtnn.distributed import zero

    when = dict(zip((n for n, _ in params), ready_times(params, times, forward_s, after)))
    offsets, at = {}, 0
    for name, nbytes in reversed(params):  # the gradient buffer: reverse parameter order
        offsets[name], at = (at, at + nbytes // itemsize), at + nbytes // itemsize
    if stage == 3:  # a layer's parameters: its path, the names' part before the last dot
        layers = {}
        for name in offsets:
            layers.setdefault(name.rsplit(".", 1)[0], []).append(name)
        cut = [(names, min(offsets[n][0] for n in names), max(offsets[n][1] for n in names))
               for names in layers.values()]
    else:
        cut = zero.buckets(offsets, itemsize, bucket_mb or zero.BUCKET_MB, first_bucket_mb or zero.FIRST_BUCKET_MB)
    return sorted(((max(when[n] for n in names), "reduce_scatter", (hi - lo) * itemsize) for names, lo, hi in cut),
                  key=lambda x: x[0])


def scatter_seconds(nbytes, replicas, machine, algorithm, level):
    """Seconds of one reduce-scatter of nbytes per replica over `replicas` (none with one)."""
    return _collective("reduce_scatter", nbytes, replicas, machine, algorithm, level) if replicas > 1 else 0.0


def gradient_messages(params, times, forward_s, reduction, itemsize, compression, shaping, after, zero, replicas,
                      machine, algorithm, level):
    """([(ready, collective, bytes)], [seconds]) of the gradients' reduction across `replicas`: the reducer's
    messages (reducer_messages), or at ZeRO stage 2 a reduce-scatter per bucket, each started once its gradients
    are ready (a reduce-scatter per layer at stage 3)."""
    if zero >= 2:
        messages = zero_messages(params, times, forward_s, itemsize, after=after, bucket_mb=shaping["bucket_mb"],
                                 first_bucket_mb=shaping["first_bucket_mb"], stage=zero)
        return messages, [scatter_seconds(n, replicas, machine, algorithm, level) for *_, n in messages]
    messages = reducer_messages(params, times, forward_s, reduction, itemsize, compression, after=after, **shaping)
    return messages, [reduction_seconds(c, n, replicas, machine, algorithm, level) for _, c, n in messages]


def zero_costs(stage, nbytes, itemsize, replicas, machine, threads, crowding, algorithm, level, times=None,
               passes=1, again=frozenset()):
    """(share, memory-pass seconds, allgather seconds in flight, exposed, allgathers) of ZeRO stage `stage`
    (pydtnn.distributed.zero) on a replica holding nbytes of parameters: the largest shard's share of them (its
    update's share), packing its shard and copying the gathered whole back (2 x share + 2 passes), and the
    allgathers of the updated shards (zero.CHUNK_BYTES at a time), exposed whole. Stage 2's reduce-scatters,
    which replace the reducer's messages, are zero_messages'. Stage 3 updates its shard in place and gathers
    nothing after it: its gathers come before the layers run (layer_gathers of `times` over `passes`, the layers
    of `again` recomputed; none without times: a pipeline's stage has them in its ops)."""
    from pydtnn.distributed import zero
    from pydtnn.distributed.sampler import shard_bounds

    if not stage:
        return 1.0, 0.0, 0.0, 0.0, 0
    elements = nbytes // itemsize
    bounds = shard_bounds(elements, replicas)
    share = max(b - a for a, b in zip(bounds[:-1], bounds[1:])) / elements if elements else 0.0
    if stage == 3:
        return (share, 0.0, *(layer_gathers(times, passes, replicas, machine, algorithm, level, again) if times
                              else (0.0, 0.0, 0)))
    passes_s = (2 * share + 2) * nbytes / (machine.memory_bandwidth * thread_speedup(machine, threads) / crowding)
    if replicas <= 1:
        return share, passes_s, 0.0, 0.0, 0
    chunks = max(1, -(-nbytes // zero.CHUNK_BYTES))
    gather = chunks * _collective("allgather", nbytes / chunks, replicas, machine, algorithm, level)
    return share, passes_s, gather, gather, chunks


def layer_gathers(times, passes, replicas, machine, algorithm, level, again=frozenset()):
    """(seconds in flight, seconds exposed, gathers) of ZeRO stage 3's gathers of the layers' parameters over
    `replicas` (pydtnn.distributed.zero_params) in a step of `passes` forwards and backwards (micro-batches;
    times: LayerTimes summed over them, in forward order). Each pass gathers every layer with parameters before
    its forward and before its backward, but where the two layers gathered last are still held: the last two
    layers' backwards, and in every pass after the first the first two layers' forwards (the backward before
    left them); a layer whose forward runs again in backward (recomputation) is gathered once more then,
    where backward reaches its segment (`again`: recomputed's {path: segment}; a set: a segment each): the
    segment's forward runs again, gathering its layers (a one-layer segment still held: none), and its backward
    finds its last two held. Each gather
    starts when the layer with parameters before it starts, so it is exposed only where it takes longer than
    the layers computed between the two; the first forward's whole."""
    first, later, back = gather_phases(times, passes, replicas, machine, algorithm, level, again)
    return tuple(first[k] + (passes - 1) * later[k] + passes * back[k] for k in range(3))


def gather_phases(times, passes, replicas, machine, algorithm, level, again=frozenset(), held=(0, 2, 2)):
    """[(seconds in flight, seconds exposed, gathers)] of one forward as the first pass runs it, as a later pass
    does, and of one backward (layer_gathers' for one pass of `passes`); held: how many layers with parameters
    each finds gathered already (a pipeline's stage, whose micro-batches interleave: none)."""
    if replicas <= 1 or not times:
        return [(0.0, 0.0, 0)] * 3

    def backward(t):
        return t.backward_data_s + t.backward_weights_s

    def gather(t):
        return _collective("allgather", t.grad_bytes, replicas, machine, algorithm, level)

    def segment(t):
        return again[t.name] if isinstance(again, dict) else t.name

    segments = {}  # a recomputed segment -> its layers with parameters, in forward order
    for t in times:
        if t.grad_bytes and t.name in again:
            segments.setdefault(segment(t), []).append(t)
    out = []
    for order, cost, kept in ((times, lambda t: t.forward_s, held[0]), (times, lambda t: t.forward_s, held[1]),
                              (times[::-1], backward, held[2])):
        window, flight, exposed, count = None, 0.0, 0.0, 0  # window: seconds computed since the last gather began
        todo = dict(segments)
        for t in order:
            seg = todo.pop(segment(t), None) if cost is backward and t.name in again else None
            if seg and not (len(seg) == 1 and kept):  # a recomputed segment: its forward again, its layers gathered
                for i, u in enumerate(seg):
                    g = gather(u)
                    hidden = seg[i - 1].forward_s / passes if i else 0.0
                    flight, count, exposed = flight + g, count + 1, exposed + max(0.0, g - hidden)
                kept, window = min(2, len(seg)), 0.0  # its last two, still held for their backward
            elif seg:  # one layer, still held (the second of the pair): its forward again with it as it is
                kept = max(kept, 1)
            if t.grad_bytes and kept:  # still held from the pass's other half, or the pass before
                kept, window = kept - 1, 0.0
            elif t.grad_bytes:
                g = gather(t)
                flight, count = flight + g, count + 1
                exposed += g if window is None else max(0.0, g - window)
                window = 0.0
            if window is not None:
                window += cost(t) / passes
        out.append((flight, exposed, count))
    return out


def _collective(op, nbytes, p, machine, algorithm, level):
    """Seconds of collective `op` of nbytes in all over p processes: `algorithm` where op has it, else the best."""
    if algorithm in collectives.algorithms(op):
        return collectives.seconds(op, algorithm, nbytes, p, machine, level=level)
    return collectives.best(op, nbytes, p, machine, level=level)[1]
