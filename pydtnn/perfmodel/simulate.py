"""`pydtnn-train --simulate`: the performance model's prediction of the run the other flags describe,
printed instead of training (no data is read, no MPI is started).

    pydtnn-train --simulate --machine vm.yaml --np 64 --model vgg16_imagenet --batch_size 32

A registered zoo name (vgg16_imagenet) is modelled at its own input shape; a family name (vgg16) at
the shape of --dataset, as a real run would resolve it (docs/models.md), and the variant taken is said
on stderr. The batch per model replica (per process with data parallelism; --parallel model|hybrid
--model_parallel_size as in training) is --batch_size, else --global_batch_size over the replicas, else
the model's recipe; threads per process are --threads_per_process; the reduction is --reduction
(per_layer with --non_blocking_mpi, else bucketed) with --bucket_size_mb.

build_model() is the one way the performance model turns a model name and data into a built model:
pydtnn-perfmodel predict and sweep use it too.
"""

import dataclasses
import sys
from dataclasses import dataclass

from pydtnn import optim
from pydtnn.data.datasets import SHAPES as DATASET_SHAPES
from pydtnn.data.datasets import TEXT
from pydtnn.errors import ConfigError
from pydtnn.plan import RunPlan, optimizer_options

# What --simulate does with each pydtnn-train flag but itself (tests/test_simulate_flags.py walks the parser: a new
# flag must be placed here). MODELLED flags change the prediction. REFUSED flags change what a training step
# runs in a way the model leaves out: a value other than the default is refused, naming what is not modelled.
# The rest change nothing a step computes: files and paths, epochs, values that change numbers but not work.
MODELLED = ("model", "model_file", "dataset", "batch_size", "global_batch_size", "dtype", "optimizer", "momentum",
            "nesterov", "decay", "parallel", "model_parallel_size", "non_blocking_mpi", "reduction",
            "gradient_compression", "reduction_progress", "bucket_size_mb", "density", "threads_per_process",
            "machine", "np", "accumulation_steps", "recompute", "pipeline_stages", "pipeline_schedule",
            "stage_boundaries", "zero", "memory_per_process", "context_length", "rank", "local_sgd",
            "reduction_staleness")
REFUSED = {
    "enable_gpu": "a GPU's step (the model predicts CPU processes)",
    "enable_nccl": "NCCL's reductions (the model predicts CPU processes)",
    "sync_every": "a GPU's reads of the loss (the model predicts CPU processes)",
    "sync_batchnorm": "the two allreduces per BatchNorm layer and step",
    "topk_selection": "a per-layer top-k selection (it models the global one)",
    "density_warmup_epochs": "a density that changes over the epochs (it models --density)",
    "momentum_correction": "the topk or oktopk reducer's momentum pass",
    "ranks_per_node": "a node size other than the machine's (set processes_per_node in --machine)",
    "debug_collectives": "the signature check before every collective",
    "evaluate_only": "an evaluation (it predicts a training step)",
}
# Flags whose effect the model cannot know in advance: the prediction is made without it, and says so.
NOTED = {"post_local_sgd": "the steps before --post_local_sgd are data parallel; the prediction is of the local steps "
                           "after them",
         "powersgd_hierarchical": "powersgd's allreduces are priced flat, not in two levels",
         "powersgd_start_step": "the steps before --powersgd_start_step send every gradient whole; the prediction is "
                                "of the low-rank steps after it",
         "oktopk_threshold_every": "oktopk's re-estimations are priced as their share of a step at the default "
                                   "periods (thresholds every 32 steps, boundaries every 64)",
         "oktopk_repartition_every": "oktopk's re-estimations are priced as their share of a step at the default "
                                     "periods (thresholds every 32 steps, boundaries every 64)",
         "conv_autotune": "each convolution is costed with its threshold algorithm; the run measures the algorithms "
                          "(--conv_autotune, the default) and may take faster ones"}
OUTSIDE_A_STEP = (
    "help", "list_models", "num_epochs", "steps_per_epoch", "evaluate", "weights_and_bias_filename", "summary",
    "dataset_train_path", "dataset_test_path", "download", "validation_split", "test_as_validation", "flip_images",
    "flip_images_prob", "crop_images", "crop_images_padding", "use_synthetic_data", "learning_rate", "beta1",
    "beta2", "epsilon", "rho", "loss_func", "metrics", "lr_schedulers", "warm_up_epochs", "warm_up_start_factor",
    "cosine_min_factor", "reduce_lr_on_plateau_metric", "reduce_lr_on_plateau_factor",
    "reduce_lr_on_plateau_patience", "reduce_lr_on_plateau_min_lr", "reduce_lr_every_nepochs_factor",
    "reduce_lr_every_nepochs_nepochs", "reduce_lr_every_nepochs_min_lr", "early_stopping_metric",
    "early_stopping_patience", "stop_at_loss_metric", "stop_at_loss_threshold", "model_checkpoint_save_freq",
    "learning_rate_scaling", "drop_last", "stall_timeout", "tracing", "tracer_output", "profile", "seed",
    "metrics_file", "history_file", "checkpoint_dir", "resume", "overwrite", "config", "progress", "data_workers",
    "tokenizer", "average",
)


def refuse_unmodelled(args, defaults):
    """ConfigError for the first REFUSED flag whose value is not its default (`defaults`: flag -> default)."""
    for flag, what in REFUSED.items():
        value = getattr(args, flag)
        if value != defaults[flag]:
            raise ConfigError(f"--simulate does not model {what}, but --{flag} {value} was given; leave --{flag} "
                              f"out to predict the run without it")


@dataclass(frozen=True)
class Data:
    """The samples a model is built for: shape (C, H, W), classes, and the flags they come from (for messages)."""

    shape: tuple
    classes: int
    source: str


def dataset_data(name):
    """Data of dataset `name` (pydtnn.data.NAMES) from DATASET_SHAPES, without reading or downloading it."""
    if name not in DATASET_SHAPES:
        raise ConfigError(f"--dataset {name!r} has no image shape fixed in advance; expected one of "
                          f"{', '.join(DATASET_SHAPES)}, or --input_shape C,H,W with --num_classes N in its place")
    shape, classes = DATASET_SHAPES[name]
    return Data(shape, classes, f"--dataset {name}")


def text_data(args):
    """Data of a text dataset without reading it: windows of --context_length tokens (default: the model's design
    context), a vocabulary of 256 tokens (bytes; a text's characters are fewer, which the head's cost barely sees)."""
    from pydtnn.data.text import DEFAULT_CONTEXT
    from pydtnn.models import defaults, names

    context = args.context_length
    if context is None:
        chosen = args.model if args.model in names() else pick(args.model, (DEFAULT_CONTEXT,))
        shape = defaults(chosen)[0]
        context = shape[0] if len(shape) == 1 else DEFAULT_CONTEXT
    return Data((context,), 256, f"--dataset {args.dataset}, modelled as bytes")


def pick(name, shape=None):
    """The registered model that `name` stands for: itself, or a family's variant for images of `shape`
    (C, H, W) by families.variant, as pydtnn-train picks it; with no shape, for ImageNet-sized images, as
    models.create does. Nothing is built (the name of an output can be known before any work)."""
    from pydtnn.models.families import variant

    return variant(name, shape if shape is not None else DATASET_SHAPES["imagenet"][0])


def build_model(name, data=None, num_classes=None, dtype="float32", say=None):
    """(registered name, Model on a CPU backend) of `name` for `data` as pydtnn-train resolves it
    (models/families.py: the variant, the first layer's channels, the last layer's classes, padding);
    without data, the model as designed (a family name: its ImageNet variant, else its only one).
    say(line): told which variant was taken and why, where a family name was resolved or the model
    adapted to the data."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.models.families import resolve

    if data is None:
        chosen = pick(name)
        model = models.create(chosen, num_classes=num_classes, backend=CPUBackend(dtype))
        if chosen != name and say is not None:
            say(f"{name} -> {chosen} ({_shape(model.input_shape)} images, its design input; --dataset or "
                "--input_shape picks another)")
        return chosen, model
    choice, model = resolve(name, data.shape, data.classes,
                            build=lambda n, s: models.create(n, input_shape=s, num_classes=data.classes,
                                                             backend=CPUBackend(dtype)))
    adapted = [n for n in choice.notes if not n.startswith(f"{name} is ")]  # the variant is said in front
    if (choice.name != name or adapted) and say is not None:
        say(f"{name} -> {choice.name} ({data.source}: {_shape(data.shape)} images, {data.classes} classes"
            + "".join(f"; {n}" for n in adapted) + ")")
    return choice.name, model


def _shape(shape):
    return "x".join(map(str, shape))


def build(args):
    """(model name as modelled, built model) for the run's flags; a family name's variant is said on stderr."""
    from pydtnn import models

    if args.model_file:  # built for the images of --dataset, as pydtnn-train builds it
        from pydtnn.backends import CPUBackend
        from pydtnn.models import model_file

        data = dataset_data(args.dataset)
        model = model_file.load(args.model_file, data.shape, data.classes, CPUBackend(args.dtype))
        return model.name, model
    if args.dataset in TEXT and not args.use_synthetic_data:
        return build_model(args.model, text_data(args), dtype=args.dtype,
                           say=lambda line: print(f"pydtnn: {line}", file=sys.stderr, flush=True))
    if args.model in models.names():
        return build_model(args.model, dtype=args.dtype)
    if args.dataset not in DATASET_SHAPES:
        raise ConfigError(f"--simulate with the family name {args.model!r} needs the images' shape: --dataset "
                          f"{args.dataset!r} has none fixed; expected one of {', '.join(DATASET_SHAPES)}, or a "
                          f"registered model name (--list_models)")
    return build_model(args.model, dataset_data(args.dataset), dtype=args.dtype,
                       say=lambda line: print(f"pydtnn: {line}", file=sys.stderr, flush=True))


def batch_size(plan, name, optimizer):
    """Samples per replica and step: the plan's (--global_batch_size over the replicas, else --batch_size), else
    the recipe's of model `name` for `optimizer`."""
    from pydtnn.models.families import recipe

    return plan.batch_size or recipe(name, optimizer)["batch_size"]


def predict_run(args, world_size, machine, name, model, memory=None, with_memory=True):
    """(Prediction, memory.Memory) of the run pydtnn-train's parsed flags `args` describe over world_size
    processes of `machine`, for `model` (named `name`, built by build()); `memory`: that run's Memory where it
    is known already (the planner's, for layouts that differ only in their lossless reduction); with_memory=False: None
    in its place, nothing measured. ConfigError where the trainer would refuse the flags."""
    from pydtnn.perfmodel.memory import plan_memory
    from pydtnn.perfmodel.predict import optimizer_state_arrays, predict_plan, update_passes

    plan = RunPlan.from_args(args, world_size)
    hyper = optim.hyperparameters(args.optimizer, **optimizer_options(args, name))
    stage_starts = args.stage_boundaries.split(",") if args.stage_boundaries else None
    p = predict_plan(model, plan, machine, batch_size(plan, name, args.optimizer),
                     update_passes=update_passes(args.optimizer, hyper), name=name, recompute=args.recompute,
                     schedule=args.pipeline_schedule, stage_starts=stage_starts,
                     state_arrays=optimizer_state_arrays(args.optimizer, hyper))
    if memory is None and with_memory:
        memory = plan_memory(model, dataclasses.replace(plan, batch_size=p.batch_size),
                             (args.optimizer, optimizer_options(args, name)), args.recompute, args.pipeline_schedule,
                             stage_starts, machine)
    return p, memory


def simulate(args, defaults, say=print):
    """Print the prediction of the run `args` describes (--parallel auto resolved first: auto.for_simulate);
    returns the Prediction. defaults: each flag's default value (pydtnn-train's parser), against which REFUSED
    flags are checked."""
    refuse_unmodelled(args, defaults)
    from pydtnn.perfmodel import machine as machines
    from pydtnn.perfmodel.table import duration, rate, table

    machine = machines.DEFAULT if args.machine is None else machines.load(args.machine)
    RunPlan.from_args(args, args.np)  # a layout the run would refuse, refused before the model is built
    name, model = build(args)
    p, memory = predict_run(args, args.np, machine, name, model)
    say(table(p))
    from pydtnn.perfmodel.memory import memory_table

    say(memory_table(memory, name))
    if args.conv_autotune is not False:  # None: the run's default, env.conv_autotune(), measures
        print(f"pydtnn: --simulate: {NOTED['conv_autotune']}", file=sys.stderr, flush=True)
    for flag in ("powersgd_start_step", "post_local_sgd", "powersgd_hierarchical"):
        if getattr(args, flag):
            print(f"pydtnn: --simulate: {NOTED[flag]}", file=sys.stderr, flush=True)
    if {"oktopk_threshold_every", "oktopk_repartition_every"} & set(getattr(args, "explicit", ())):
        print(f"pydtnn: --simulate: {NOTED['oktopk_threshold_every']}", file=sys.stderr, flush=True)
    say(f"pydtnn: simulated, nothing trained: {duration(p.step_s)} a step, {rate(p.samples_per_second)} samples/s "
        f"over {p.np} process(es)")
    return p
