"""The planner: every layout pydtnn-train can run a model in on P processes, each one predicted (the step by
predict_plan, the busiest process's memory by plan_memory, as `pydtnn-train --simulate` predicts them), what does
not fit in memory dropped, the rest ranked by predicted step time.

    choices, refused, common = planner.plan("resnet20_cifar10", 4, machine, global_batch_size=128, memory_bytes=2e9)
    choices[0].flags          # ("--parallel", "hybrid", "--pipeline_stages", "2", ...), as pydtnn-train takes them
    common                    # ("--model", "resnet20_cifar10", "--optimizer", "sgd", "--global_batch_size", "128")

The layouts (`candidates`): data parallelism with each lossless reducer (blocking, per_layer, bucketed at each of
BUCKET_MB, hierarchical where the node size is given), each with ZeRO stage 1, and ZeRO stages 2 (by bucket
size: it reduce-scatters bucket by bucket, whatever the reducer) and 3 (one: it works layer by layer); layers
split over all processes (model) and over groups of each divisor (hybrid), with each ZeRO stage where there
are replicas; pipelines of
every stage count that divides P, their stages split over groups or not, replicated (with each ZeRO stage) or
not, at MICRO_PER_STAGE micro-batches per stage, under each schedule.
With lossy=True (`pydtnn-perfmodel plan --lossy`) the reductions that change the algorithm are weighed too (LOSSY:
fp16 on the wire, topk and oktopk at density 0.01, powersgd at rank 4, local SGD every 4 steps, one step stale
with a progress thread), each marked lossy; `--parallel auto` never takes one.
Each is parsed by pydtnn-train's own parser and checked by its RunPlan, so a layout the trainer refuses is not
listed (`refused` says why). Recomputation only adds time, so a layout is tried with `--recompute segments`,
then `all`, only where it does not fit without; with no memory limit it is never tried.

The ranking keeps `--parallel data` (DEFAULT: the bucketed reducer at 25 MB, no ZeRO) first wherever it fits and
no layout is predicted faster than it by more than `margin` (MARGIN, 5%: about the model's error on a step), so a
layout the model cannot tell apart from the default does not replace it.
"""

import dataclasses
import itertools
import math

from pydtnn.errors import ConfigError, PydtnnError

LOSSLESS = ("blocking", "per_layer", "bucketed")  # and hierarchical, given the processes per node
BUCKET_MB = (1.0, 4.0, 25.0, 100.0)
MICRO_PER_STAGE = (1, 2, 4)  # a pipeline's micro-batches per stage
REDUCTION_FLAGS = ("--reduction", "--bucket_size_mb", "--ranks_per_node")  # a lossless reducer's: ~1% of the memory
# the data-parallel reductions that change the algorithm (lossy=True), at the settings the benchmarks measure
LOSSY = (("--reduction", "bucketed", "--bucket_size_mb", "25", "--gradient_compression", "fp16"),
         ("--reduction", "topk", "--density", "0.01"), ("--reduction", "oktopk", "--density", "0.01"),
         ("--reduction", "powersgd", "--rank", "4"), ("--local_sgd", "4"),
         ("--reduction_staleness", "1", "--reduction_progress", "thread"))
LOSSY_FLAGS = ("gradient_compression", "density", "rank", "local_sgd", "reduction_staleness", "reduction_progress")
DEFAULT = ("--parallel", "data", "--reduction", "bucketed", "--bucket_size_mb", "25")  # what --parallel data runs
MARGIN = 0.05  # a layout replaces the default only where predicted faster by more than this share


@dataclasses.dataclass(frozen=True)
class Choice:
    """One layout, predicted: `flags` (pydtnn-train's), the step's seconds and samples per second over the
    whole job, the busiest process's bytes at its peak (`memory`: its parts), and whether they fit."""

    flags: tuple
    step_s: float
    samples_per_second: float
    memory_bytes: int
    memory: dict
    batch_per_replica: int
    fits: bool = True

    @property
    def lossy(self):
        """Whether its reduction changes the algorithm (is_lossy)."""
        return is_lossy(self.flags)

    def to_dict(self, common=()):
        return {"flags": list(self.flags), "command": " ".join(("pydtnn-train", *common, *self.flags)),
                "lossy": self.lossy, "step_s": self.step_s,
                "samples_per_second": self.samples_per_second, "memory_bytes": self.memory_bytes,
                "memory": self.memory, "batch_per_replica": self.batch_per_replica, "fits": self.fits}


def is_lossy(flags):
    """Whether pydtnn-train `flags` name a reduction that changes the algorithm: a flag of LOSSY_FLAGS, or a
    registered reducer other than the lossless ones (LOSSLESS and hierarchical)."""
    from pydtnn.distributed import reducers

    flags = tuple(flags)
    named = flags[flags.index("--reduction") + 1] if "--reduction" in flags[:-1] else None
    lossless = (*LOSSLESS, "hierarchical")
    return (named in reducers.NAMES and named not in lossless) or any(f"--{attr}" in flags for attr in LOSSY_FLAGS)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(np_, ranks_per_node=None, lossy=False):
    """[flags] of every layout of np_ processes the planner weighs (not yet checked against a model); lossy: with
    data parallelism under each reduction of LOSSY."""
    from pydtnn.distributed.pipeline import SCHEDULES
    from pydtnn.distributed.zero import check_stage

    if np_ == 1:
        return [()]
    reductions = [("--reduction", "blocking"), ("--reduction", "per_layer")]
    reductions += [("--reduction", "bucketed", "--bucket_size_mb", f"{mb:g}") for mb in BUCKET_MB]
    if ranks_per_node is not None:
        if not 1 < ranks_per_node < np_ or np_ % ranks_per_node:
            raise ConfigError(f"--ranks_per_node {ranks_per_node}: the hierarchical reducer needs nodes of more than "
                              f"one and fewer than {np_} processes; expected a divisor of {np_} between 2 and "
                              f"{np_ // 2}")
        reductions.append(("--reduction", "hierarchical", "--ranks_per_node", str(ranks_per_node)))
    zero = [("--zero", str(z)) for z in (1, 2, 3)]
    out = []
    for r, z in itertools.product(reductions, [(), *zero[:2]]):
        try:
            check_stage(int(z[1]) if z else 0, r[1])
        except ConfigError:
            continue  # a stage that cannot take this reducer
        if z != ("--zero", "2") or r[1] == "bucketed":  # stage 2 reduce-scatters by buckets whatever the reducer
            out.append(("--parallel", "data", *r, *z))
    out.append(("--parallel", "data", *zero[2]))  # stage 3 gathers and reduce-scatters layer by layer
    out += [("--parallel", "data", *r) for r in LOSSY] if lossy else []
    out.append(("--parallel", "model"))
    for m in divisors(np_)[1:-1]:
        group = ("--parallel", "hybrid", "--model_parallel_size", str(m))
        out += [group] + [group + z for z in zero]
    for s in divisors(np_)[1:]:
        for m in divisors(np_ // s):
            if s == np_:
                base = ("--parallel", "pipeline", "--pipeline_stages", str(s))
            else:
                base = ("--parallel", "hybrid", "--pipeline_stages", str(s))
                base += ("--model_parallel_size", str(m)) if m > 1 else ()
            sharded = [()] + (zero if s * m < np_ else [])  # ZeRO over the pipelines' replicas
            out += [base + ("--micro_batches", str(k * s), "--pipeline_schedule", schedule) + z
                    for z in sharded for k in MICRO_PER_STAGE for schedule in SCHEDULES]
    return out


def _memory_key(flags):
    """The flags that decide the memory model's answer: a lossless reduction's are left out (its reducer holds
    bookkeeping, about 1% of the parameters: the first one predicted is kept), a lossy one's are not (error
    feedback, wire buffers: reducer_state measures each)."""
    if is_lossy(flags):
        return tuple(flags)
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in REDUCTION_FLAGS:
            skip = True
        else:
            out.append(f)
    return tuple(out)


# the flags a layout sets (parsed from its flags onto the run's others); --parallel auto decides every one
LAYOUT_FLAGS = ("parallel", "model_parallel_size", "pipeline_stages", "stage_boundaries", "accumulation_steps",
                "pipeline_schedule", "zero", "reduction", "bucket_size_mb", "ranks_per_node", "recompute")


def plan(model, np_, machine, global_batch_size=None, memory_bytes=None, optimizer="sgd", ranks_per_node=None,
         on_layout=None, base=None, built=None, with_memory=True, margin=MARGIN, lossy=False):
    """([Choice] ranked by step time, fitting ones first, the default first where keep_default keeps it; [(flags,
    reason)] the trainer refuses; the flags every
    layout's run takes besides its own: model, optimizer, global batch) of `model` (a registered name) on np_
    processes of `machine`. global_batch_size: samples per step over the job (default:
    the model's recipe batch per process x np_), which each layout divides over its replicas; memory_bytes:
    the most a process may hold (None: no limit). on_layout(): called after each layout is predicted.
    base: pydtnn-train's parsed flags of the run, whose others (threads, dtype, optimizer options, ...) each
    layout keeps (default: the defaults); built: (name, Model) where the run has built it already;
    with_memory=False (no memory_bytes only): the memory model is not run, each Choice's memory is 0 bytes;
    margin: see keep_default; lossy: the reductions that change the algorithm weighed too (candidates)."""
    import copy

    from pydtnn.flags import build_parser
    from pydtnn.models.families import recipe
    from pydtnn.perfmodel.simulate import build_model, predict_run

    name, built = built or build_model(model)
    batch = global_batch_size or recipe(name, optimizer)["batch_size"] * np_
    parser, memory_of, choices, refused = build_parser(), {}, [], []
    common = ("--model", name, "--optimizer", optimizer, "--global_batch_size", str(batch))
    base = base if base is not None else parser.parse_args(common)

    def flags_of(flags):
        args = apply(copy.copy(base), flags, common, parser)
        args.np = np_
        return args

    def predict(flags):
        try:
            p, m = predict_run(flags_of(flags), np_, machine, name, built, memory_of.get(_memory_key(flags)),
                               with_memory or memory_bytes is not None)
        except PydtnnError as e:
            refused.append((tuple(flags), " ".join(str(e).split())))
            return None
        memory_of[_memory_key(flags)] = m
        total, parts = (m.total, dict(m.parts)) if m is not None else (0, {})
        return Choice(tuple(flags), p.step_s, p.samples_per_second, total, parts, p.batch_size,
                      memory_bytes is None or total <= memory_bytes)

    for flags in candidates(np_, ranks_per_node, lossy):
        choice = predict(flags)
        if on_layout is not None:
            on_layout()
        if choice is None:
            continue
        choices.append(choice)
        for mode in ("segments", "all") if not choice.fits else ():
            choice = predict(flags + ("--recompute", mode))
            if choice is not None:
                choices.append(choice)
                if choice.fits:
                    break
    choices.sort(key=lambda c: (not c.fits, c.step_s))
    return keep_default(choices, margin), refused, common


def keep_default(choices, margin=MARGIN):
    """`choices` (ranked) with the default layout (DEFAULT) moved first where it fits and the first is not predicted
    faster than it by more than `margin` (a share of the default's step)."""
    default = next((c for c in choices if c.flags == DEFAULT), None)
    if default is None or not default.fits or not choices[0].fits or choices[0] is default:
        return choices
    if choices[0].step_s < default.step_s * (1.0 - margin):
        return choices
    return [default, *(c for c in choices if c is not default)]


def apply(args, flags, common, parser=None):
    """Set run args' layout flags (LAYOUT_FLAGS) and global batch to those of a Choice's `flags` (parsed with
    pydtnn-train's `parser`, built here where not given); a lossy layout's (is_lossy) LOSSY_FLAGS too, those it does
    not name to their defaults (a lossless one leaves the run's own: --parallel auto keeps them)."""
    from pydtnn.flags import build_parser

    given = (parser or build_parser()).parse_args([*common, *flags])
    for attr in (*LAYOUT_FLAGS, "global_batch_size", *(LOSSY_FLAGS if is_lossy(flags) else ())):
        setattr(args, attr, getattr(given, attr))
    return args


def check_fits(choices, refused, memory_bytes, model, np_):
    """ConfigError where no layout runs (the first reason given), or a memory limit leaves none: one line naming
    the smallest memory that would fit."""
    if not choices:
        flags, why = refused[0] if refused else ((), "no layout to weigh")
        raise ConfigError(f"no layout of {model} on {np_} processes runs: {' '.join(flags)}: {why}")
    if memory_bytes is None or any(c.fits for c in choices):
        return
    least = min(choices, key=lambda c: c.memory_bytes)
    need = math.ceil(least.memory_bytes / 1e5) / 1e4  # GB, rounded up: a limit of this fits
    raise ConfigError(f"--memory_per_process {memory_bytes / 1e9:g}: no layout of {model} on {np_} processes fits; "
                      f"expected at least {need:g} GB ({' '.join(least.flags) or 'one process'})")


def table(choices, top=10):
    """The best `top` choices as text: rank, predicted step, samples per second, memory and the flags."""
    rows = [("#", "step ms", "samples/s", "memory GB", "fits", "pydtnn-train flags")]
    for i, c in enumerate(choices[:top], 1):
        rows.append((str(i), f"{1e3 * c.step_s:.1f}", f"{c.samples_per_second:.1f}", f"{c.memory_bytes / 1e9:.3f}",
                     "yes" if c.fits else "no",
                     " ".join(c.flags) + ("  (lossy)" if c.lossy else "") or "(one process)"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(v.rjust(w) for v, w in zip(r[:-1], widths)), r[-1]]) for r in rows)
