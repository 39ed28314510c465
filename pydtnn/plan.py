"""The run plan: what a run computes with, resolved once from the flags (or from Python) and frozen.

    plan = RunPlan.from_args(args, world_size=comm.size)      # pydtnn-train; --simulate with --np
    plan.layout.replicas, plan.layout.model_parallel_size     # 4 replicas of 2 processes each
    plan.batch_size                                           # samples per replica and step (None: the recipe's)
    plan.reduction.name, plan.reduction.options               # "bucketed", {"bucket_mb": 25.0, ...}

pydtnn-train splits its processes, sizes its batch and builds its reducer from the plan; `--simulate`
and pydtnn-perfmodel predict the same plan, so a prediction and a run cannot disagree about what runs.
The rules live here once: which layouts exist and what they need (`layout`), which reducer a run takes
and with which options (`Reduction`, over the reducers' registry: pydtnn.distributed.reducers). Messages
name flags (`--model_parallel_size`) for the command line and parameters (`model_parallel_size=`) for
Python callers; optimizer_options gives the optimizer's keyword arguments from the flags.
"""

from dataclasses import dataclass, field

from pydtnn.distributed import reducers
from pydtnn.errors import ConfigError
from pydtnn.optim import schedules as sch

PARALLEL = ("sequential", "data", "model", "hybrid", "pipeline")
# the flags that set the reducers' options (reducers.defaults(name) names each strategy's); an option no flag
# sets keeps its default (first_bucket_mb), or is the run's to decide (topk's momentum: --momentum_correction)
OPTION_FLAGS = {"bucket_mb": "bucket_size_mb", "ranks_per_node": "ranks_per_node", "density": "density",
                "warmup_epochs": "density_warmup_epochs", "selection": "topk_selection", "rank": "rank",
                "start_step": "powersgd_start_step", "every": "local_sgd", "average": "average",
                "post_local": "post_local_sgd", "threshold_every": "oktopk_threshold_every",
                "repartition_every": "oktopk_repartition_every", "staleness": "reduction_staleness",
                "hierarchical": "powersgd_hierarchical"}


def local_sgd_reduction(args):
    """"local_sgd" where --local_sgd H is given (H >= 1), None where it is not; a ConfigError where --reduction
    names another reducer beside it, or names local_sgd without it."""
    if args.local_sgd and args.reduction not in (None, "local_sgd"):
        raise ConfigError(f"--local_sgd {args.local_sgd} replaces the gradient reduction: each process steps on its "
                          f"own gradients; leave --reduction {args.reduction} out")
    if args.reduction == "local_sgd" and not args.local_sgd:
        raise ConfigError("--reduction local_sgd needs --local_sgd H, the steps between averages (H >= 1)")
    return "local_sgd" if args.local_sgd else None


def _named(name, value, flags):
    """'--name value' on the command line, 'name=value' in Python."""
    return f"--{name} {value}" if flags else f"{name}={value!r}"


@dataclass(frozen=True)
class Layout:
    """How a job's processes are arranged: `parallel` (sequential, data, model, hybrid, pipeline, as it runs:
    one process is sequential, a group of one process is data parallelism), `world_size` processes, each model
    replica split over `model_parallel_size` (M) consecutive ranks or cut into `pipeline_stages` (S), one
    per rank; `replicas` = world_size / (M x S) share the data."""

    parallel: str
    world_size: int
    model_parallel_size: int = 1
    pipeline_stages: int = 1

    @property
    def replicas(self):
        return self.world_size // (self.model_parallel_size * self.pipeline_stages)

    @property
    def pipelined(self):
        """The model is cut into stages (--parallel pipeline, or hybrid with --pipeline_stages)."""
        return self.parallel == "pipeline" or self.pipeline_stages > 1


def layout(parallel, world_size, model_parallel_size=None, flags=False, pipeline_stages=None):
    """The Layout of `world_size` processes for `parallel` (None: data), `model_parallel_size` (M) and
    `pipeline_stages` (S), or a ConfigError naming the flag (flags=True) or parameter at fault. The one rule:
    data and sequential take no M (or 1); model takes all processes (M = world_size); hybrid needs an M that
    divides world_size; pipeline takes S stages, one per process (S = world_size), and no M; hybrid with S
    takes R = world_size / (S x M) data-parallel replicas of an S-stage pipeline whose stages are each split
    over M processes (M = 1: one process a stage)."""
    if parallel not in (None,) + PARALLEL:
        raise ConfigError(f"{_named('parallel', parallel, flags)}: expected one of {', '.join(PARALLEL)}")
    s = pipeline_stages
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
        raise ConfigError(f"{_named('pipeline_stages', s, flags)}; expected a positive integer")
    if parallel == "pipeline" or s is not None:
        return _pipeline_layout(parallel, world_size, model_parallel_size, s, flags)
    if parallel == "hybrid" and model_parallel_size is None:
        raise ConfigError(f"{_named('parallel', 'hybrid', flags)} needs {'--' if flags else ''}model_parallel_size "
                          f"M (processes per model replica) or {'--' if flags else ''}pipeline_stages S (stages per "
                          f"pipeline replica)")
    m = model_parallel_size
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ConfigError(f"{_named('model_parallel_size', m, flags)}; expected a positive integer")
    if parallel == "sequential" and world_size > 1:
        raise ConfigError(f"{_named('parallel', 'sequential', flags)}, but {world_size} processes were launched; use "
                          f"{'--parallel' if flags else 'parallel='} data, model or hybrid, or one process")
    if parallel not in ("model", "hybrid"):
        if m not in (None, 1):
            raise ConfigError(f"{_named('model_parallel_size', m, flags)} needs {_named('parallel', 'hybrid', flags)} "
                              f"(or model); got {_named('parallel', parallel or 'data', flags)}")
        m = 1
    elif parallel == "model":
        if m not in (None, world_size):
            raise ConfigError(f"{_named('parallel', 'model', flags)} splits every layer over all {world_size} "
                              f"processes, but {_named('model_parallel_size', m, flags)} was given; use "
                              f"{_named('parallel', 'hybrid', flags)} for groups of {m}")
        m = world_size
    if world_size % m:
        where = f"the {world_size} processes" if flags else f"np={world_size} (the processes)"
        raise ConfigError(f"{_named('model_parallel_size', m, flags)} does not divide {where}; "
                          f"expected a divisor of {world_size}")
    if m == 1:
        return Layout("data" if world_size > 1 else "sequential", world_size, 1)
    return Layout(parallel, world_size, m)  # hybrid with one group stays hybrid, as asked: replicas says 1


def _pipeline_layout(parallel, world_size, m, s, flags):
    if parallel not in ("pipeline", "hybrid"):
        raise ConfigError(f"{_named('pipeline_stages', s, flags)} needs {_named('parallel', 'pipeline', flags)} (or "
                          f"hybrid); got {_named('parallel', parallel or 'data', flags)}")
    if s is None:
        raise ConfigError(f"{_named('parallel', 'pipeline', flags)} needs {'--' if flags else ''}pipeline_stages S "
                          f"(the stages the model is cut into, one per process)")
    if s < 2:
        raise ConfigError(f"{_named('pipeline_stages', s, flags)} is the whole model on each process; expected 2 or "
                          f"more stages, or no {'--' if flags else ''}pipeline_stages")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ConfigError(f"{_named('model_parallel_size', m, flags)}; expected a positive integer")
    m = m or 1
    if m > 1 and parallel != "hybrid":
        raise ConfigError(f"{_named('model_parallel_size', m, flags)} with {_named('parallel', 'pipeline', flags)}: "
                          f"stages split over model-parallel groups take {_named('parallel', 'hybrid', flags)}")
    where = f"{world_size} processes were launched" if flags else f"np={world_size}"
    if parallel == "pipeline" and s != world_size:
        raise ConfigError(f"{_named('pipeline_stages', s, flags)} runs one stage per process, but {where}; launch "
                          f"{s} processes, or use {_named('parallel', 'hybrid', flags)} for data-parallel replicas of "
                          f"the pipeline")
    if world_size % (s * m):
        per = f"{s} stages x {m} processes each" if m > 1 else f"{s} stages, one per process"
        raise ConfigError(f"{_named('pipeline_stages', s, flags)} does not divide the processes ({where}) into "
                          f"pipelines of {per}; expected a multiple of {s * m} processes")
    return Layout(parallel, world_size, m, s)


def stale_reduction(args):
    """"stale" where --reduction_staleness 1 is given, None where it is 0; a ConfigError where --reduction names
    another reducer beside it (or --local_sgd is given), or names stale without it."""
    if args.reduction_staleness and (args.reduction not in (None, "stale") or args.local_sgd):
        other = f"--reduction {args.reduction}" if args.reduction not in (None, "stale") else "--local_sgd"
        raise ConfigError(f"--reduction_staleness 1 reduces every gradient in one allreduce applied a step late; it "
                          f"replaces the gradient reduction, and {other} was given: leave {other} out, or give "
                          f"--reduction_staleness 0")
    if args.reduction_staleness and args.parallel not in (None, "data", "sequential"):
        raise ConfigError(f"--reduction_staleness 1 runs with data parallelism alone; got --parallel {args.parallel}: "
                          f"give --parallel data, or --reduction_staleness 0")
    if args.reduction == "stale" and not args.reduction_staleness:
        raise ConfigError("--reduction stale needs --reduction_staleness 1 (the update of each step applies the "
                          "gradients of the step before)")
    return "stale" if args.reduction_staleness else None


@dataclass(frozen=True)
class Reduction:
    """The gradient reduction of a run: reducer `name` (None with one replica: nothing to reduce), its
    wire `compression` ("none", "fp16"), how outstanding collectives `progress` ("test", "thread"), and
    the reducer's own options ({"bucket_mb": 25.0} for bucketed), as reducers.create takes them."""

    name: str | None
    compression: str = "none"
    progress: str = "test"
    options: dict = field(default_factory=dict, hash=False)

    @classmethod
    def from_args(cls, args, replicas):
        """The reduction the flags ask for over `replicas`: --reduction, else per_layer with --non_blocking_mpi,
        else bucketed; None with one replica."""
        if replicas == 1:
            return cls(None, args.gradient_compression, args.reduction_progress)
        name = (local_sgd_reduction(args) or stale_reduction(args) or args.reduction
                or ("per_layer" if args.non_blocking_mpi else "bucketed"))
        device = "nccl" if args.enable_nccl else "gpu" if args.enable_gpu else "cpu"
        reducers.validate(name, args.gradient_compression, args.reduction_progress, device)
        options = {key: getattr(args, OPTION_FLAGS[key]) for key in reducers.defaults(name) if key in OPTION_FLAGS}
        return cls(name, args.gradient_compression, args.reduction_progress, options)

    def create_options(self, **extra):
        """Keyword arguments of reducers.create(self.name, comm, ...): compression, progress, the options,
        and `extra` (the topk reducer's momentum, which the optimizer's options decide)."""
        return {"compression": self.compression, "progress": self.progress, **self.options, **extra}


@dataclass(frozen=True)
class RunPlan:
    """One run: its `layout`, `batch_size` per replica and step (None: the model family's recipe decides,
    once the model is known), `global_batch_size` as given, `accumulation_steps` micro-batches per step,
    its `reduction`, `optimizer` name, `threads` per process, `dtype`, `device` ("cpu", "gpu") and `zero`, the
    ZeRO stage of its data parallelism (0: none)."""

    layout: Layout
    batch_size: int | None
    global_batch_size: int | None
    reduction: Reduction
    optimizer: str = "sgd"
    accumulation_steps: int = 1
    threads: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    zero: int = 0  # ZeRO's stage over the replicas (pydtnn.distributed.zero)

    @classmethod
    def from_args(cls, args, world_size):
        """The plan of pydtnn-train's parsed flags over `world_size` processes (the launched job's, or
        --simulate's --np): the layout checked, --global_batch_size divided over the replicas."""
        lay = layout(args.parallel, world_size, args.model_parallel_size, flags=True,
                     pipeline_stages=args.pipeline_stages)
        if args.enable_gpu and lay.pipeline_stages > 1:
            raise ConfigError("--parallel pipeline runs its stages on the CPU backend; with --enable_gpu use "
                              "--parallel data")
        if args.enable_gpu and lay.model_parallel_size > 1:
            raise ConfigError(f"--parallel {lay.parallel} splits layers over CPU processes; with --enable_gpu use "
                              f"--parallel data (model parallelism runs on the CPU backend)")
        zero, reduction = getattr(args, "zero", 0), Reduction.from_args(args, lay.replicas)
        if zero:
            from pydtnn.distributed.zero import check_stage

            check_stage(zero, reduction.name if lay.replicas > 1 else args.reduction, args.gradient_compression,
                        args.reduction_progress, args.enable_nccl)
        return cls(lay, batch_per_replica(args.batch_size, args.global_batch_size, lay), args.global_batch_size,
                   reduction, args.optimizer, args.accumulation_steps,
                   args.threads_per_process, args.dtype, "gpu" if args.enable_gpu else "cpu", zero)


def check_memory_limit(args):
    """--memory_per_process is --parallel auto's."""
    if args.memory_per_process is not None and args.parallel != "auto":
        raise ConfigError(f"--memory_per_process {args.memory_per_process:g} bounds the layouts --parallel auto "
                          f"weighs; got --parallel {args.parallel or 'data'}: add --parallel auto, or leave it out")


def batch_per_replica(batch_size, global_batch_size, lay):
    """Samples per replica and step: global_batch_size over lay's replicas where given (it must divide),
    else batch_size (None: the recipe's, decided with the model)."""
    if global_batch_size is None:
        return batch_size
    if global_batch_size % lay.replicas:
        what = "model replicas" if lay.model_parallel_size > 1 else "processes"
        raise ConfigError(f"--global_batch_size {global_batch_size} does not divide by {lay.replicas} {what}; "
                          f"expected a multiple of {lay.replicas}")
    return global_batch_size // lay.replicas


def optimizer_options(args, model_name=None):
    """Keyword arguments of the chosen optimizer from the flags that apply to it.

    Flags left unset take the optimizer's own default (AdamW's weight decay stays 0.01), except the
    learning rate (the model family's for SGD, else DEFAULT_LR) and SGD's momentum (0.9).
    """
    from pydtnn.models.families import DEFAULT_LR, recipe

    name = args.optimizer
    default = recipe(model_name, name).get("learning_rate", DEFAULT_LR[name]) if model_name else DEFAULT_LR[name]
    opts = {"lr": args.learning_rate if args.learning_rate is not None else default}
    if args.decay is not None:
        opts["weight_decay"] = args.decay
    if name == "sgd":
        opts.update(momentum=0.9 if args.momentum is None else args.momentum, nesterov=args.nesterov)
    elif name == "rmsprop":
        opts.update(rho=args.rho, eps=args.epsilon)
        if args.momentum is not None:
            opts["momentum"] = args.momentum
    else:
        opts.update(beta1=args.beta1, beta2=args.beta2, eps=args.epsilon)
    return opts


def build_schedules(args, world):
    """The learning-rate schedules the flags choose (pydtnn.optim.schedules objects, fresh: they keep state), for
    `world` model replicas (warm-up starts at 1/world of the rate by default)."""
    chosen, out = chosen_schedulers(args), []
    if "warm_up" in chosen:
        start = args.warm_up_start_factor or (1 / world if world > 1 else 0.1)
        out.append(sch.WarmUp(args.warm_up_epochs, start))
    if "cosine" in chosen:
        out.append(sch.Cosine(args.num_epochs, args.cosine_min_factor))
    if "reduce_lr_every_nepochs" in chosen:
        out.append(sch.ReduceEveryNEpochs(args.reduce_lr_every_nepochs_factor, args.reduce_lr_every_nepochs_nepochs,
                                          args.reduce_lr_every_nepochs_min_lr))
    if "reduce_lr_on_plateau" in chosen:
        out.append(sch.ReduceOnPlateau(args.reduce_lr_on_plateau_metric, args.reduce_lr_on_plateau_factor,
                                       args.reduce_lr_on_plateau_patience, args.reduce_lr_on_plateau_min_lr))
    return out


def chosen_schedulers(args):
    """The names in --lr_schedulers (None before fill_defaults: none)."""
    return [s for s in (args.lr_schedulers or "").split(",") if s]  # None: the family's, set by fill_defaults
