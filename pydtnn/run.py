"""Assemble and execute one run from a parsed configuration (the CLI's namespace).

    flags -> Backend, datasets, Model, optimizer, schedules, callbacks -> Trainer.fit -> outputs

Everything here is plain wiring: each piece is built by the module that owns it. The checks made before
anything runs live in preflight.py, what a run says in report.py, resuming and checkpoints in resume.py.
"""

import csv
import io
import gc
import os
import sys
import time

from pydtnn import checkpoint, data, env, losses, models, optim
from pydtnn.backends import CPUBackend, get_backend
from pydtnn.callbacks import EarlyStopping, ModelCheckpoint, StopAtThreshold
from pydtnn.distributed import launch, model_parallel, reducers
from pydtnn.distributed.consistency import broadcast_state
from pydtnn.errors import ConfigError
from pydtnn.files import write_atomic
from pydtnn.plan import RunPlan, build_schedules, optimizer_options
from pydtnn.preflight import (
    NOT_SAVED,
    PATH_FLAGS,
    agree_on_flags,
    check_agreement,
    check_combinations,
    check_monitored,
    check_outputs,
    chosen_schedulers,
    metric_names,
)
from pydtnn.report import announce_compilation, conv_shapes, effective_values, header, models_table
from pydtnn.resume import resume, save_checkpoint
from pydtnn.trainer import MetricsFile, Trainer, format_record


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(args):
    """Train (or evaluate) as `args` says; returns the final metrics record (None for --list_models).

    Every check that needs no data runs before the communicator is split, and every check at all before
    a byte is written: outputs are created by the first epoch's end, not before.
    """
    if args.list_models:
        print(models_table())
        return None
    comm, say, (group, replicas, mp_size, pipe), plan = start(args)
    world = replicas.size  # model replicas: the batch, the learning rate and the reduction follow them
    # the flags as given (None: "the default for this model and optimizer"), saved as the run's
    # configuration; the values they resolve to are saved next to them as "effective"
    config = {k: (os.path.abspath(v) if k in PATH_FLAGS and isinstance(v, str) else v)
              for k, v in sorted(vars(args).items()) if k not in NOT_SAVED}
    backend, choice, model, datasets, data_shape = build_model_and_data(args, comm)
    family = None if args.model_file else choice.name  # a model file's name is its own, not a zoo family's
    fill_defaults(args, family)
    if args.weights_and_bias_filename and not args.resume:  # a resumed run takes every weight from its checkpoint
        checkpoint.load_weights(args.weights_and_bias_filename, model)
    whole = model
    if plan.layout.pipelined:  # from here on, this rank's stage (split over its group, where it has one)
        model, cut = pipeline_stage(args, model, pipe)
    if group is not None:
        model_parallel.partition(model, group)
    comm, replicas, grad_comm = device_communicators(args, comm, replicas, backend, say)
    options, lr_note = scaled_optimizer_options(args, family, world, mp_size * plan.layout.pipeline_stages)
    strategy = plan.reduction.name
    corrected = momentum_correction(args, strategy, options)  # SGD's momentum, moved into the topk reducer
    check_reducer_flags(args, strategy)
    optimizer, reducer = optimizer_and_reducer(args, plan, model, options, grad_comm, corrected)
    loss = losses.create(args.loss_func)
    step = None
    schedules = build_schedules(args, plan.layout.replicas)
    tracer = new_tracer(model, comm) if args.tracing else None
    if plan.layout.pipelined:  # the Trainer attaches the reducer to the stage before the first step
        from pydtnn.distributed.pipeline import PipelineStep
        from pydtnn.step import BatchNormSync

        step = PipelineStep(model, loss, optimizer, pipe, cut, args.accumulation_steps, args.pipeline_schedule,
                            reducer=reducer, tracer=tracer, recompute=args.recompute,
                            batchnorm_sync=BatchNormSync(replicas) if args.sync_batchnorm else None)
    effective = effective_values(args, choice, options, plan, schedules)
    effective["data_shape"] = list(data_shape)  # the images before any padding: what an exported graph takes
    tokenizer = getattr(datasets[0], "tokenizer", None)
    if tokenizer is not None:  # a text dataset's ids mean its vocabulary's characters: kept with every checkpoint
        effective["tokenizer"] = tokenizer.to_dict()
    if corrected:
        effective["topk_momentum"] = corrected  # the optimizer's momentum is 0: the reducer applies this one
    trainer = Trainer(model, loss, optimizer, metrics=metric_names(args), seed=args.seed,
                      progress=args.progress, epoch_lines=True, metrics_file=args.metrics_file, schedules=schedules,
                      log=log, comm=replicas, reducer=reducer, is_root=comm.rank == 0, sync_every=args.sync_every,
                      accumulation_steps=args.accumulation_steps, sync_batchnorm=args.sync_batchnorm,
                      callbacks=build_callbacks(args, config, effective, is_root=comm.rank == 0),
                      tracer=tracer, step=step,
                      recompute=args.recompute, data_workers=args.data_workers)
    start_epoch = 0
    if args.resume:
        check_tokenizer(args.resume, tokenizer)
        start_epoch = resume(args.resume, trainer, options["lr"] if "learning_rate" in args.explicit else None,
                             scaled=world > 1 and args.learning_rate_scaling and args.global_batch_size is None)
    check_agreement(comm, model, datasets, start_epoch)  # a stage's state layout and name are the whole model's
    broadcast_state(replicas, model, optimizer)
    if plan.zero == 3:  # each replica keeps its shard of the parameters, the layers gather theirs as they run
        optimizer.shards.attach()
    for line in header(args, choice, whole, datasets, effective, lr_note, data_shape):
        say(line)
    if step is not None:
        say(f"pydtnn: pipeline of {pipe.size} stages ({args.pipeline_schedule}, {args.accumulation_steps} "
            f"micro-batches a step): {cut.describe()}")
    if args.summary and comm.rank == 0:
        whole.summary(file=sys.stderr)
    if args.tracing:
        attach_tracer(trainer)
    announce_compilation(backend, say)
    if isinstance(backend, CPUBackend):  # every rank takes rank 0's measured choices (docs/performance.md)
        backend.tune_convolutions(comm, say, conv_shapes(whole))  # a pipeline: every stage's shapes
    whole = None  # a pipeline stage keeps its own layers only
    gc.collect()  # the layers it let go of (a stage's others, a split's whole ones) hold cycles: freed now
    return execute(args, trainer, datasets, start_epoch, comm, say)


def optimizer_and_reducer(args, plan, model, options, grad_comm, corrected):
    """(optimizer, reducer or None) of this rank: the optimizer over every parameter it holds, or (--zero 1 to 3)
    over its shard of them (pydtnn.distributed.zero); the reducer --reduction names, or (--zero 2 and 3) the
    reduce-scatter of the gradients into that shard."""
    def make(params):
        return optim.create(args.optimizer, params, backend=model.backend, **options)

    strategy = plan.reduction.name
    if not plan.zero:
        reducer = None if strategy is None else reducers.create(
            strategy, grad_comm, **plan.reduction.create_options(**topk_momentum(corrected)))
        return make(model.parameters()), reducer
    from pydtnn.distributed import zero

    optimizer = zero.ShardedOptimizer(make, model, grad_comm, plan.zero,  # cut by the reducer's buckets, or by layer
                                      bucket_mb=plan.reduction.options.get("bucket_mb", zero.BUCKET_MB))
    if plan.zero >= 2:
        return optimizer, zero.ShardedReducer(grad_comm, optimizer) if strategy is not None else None
    return optimizer, None if strategy is None else reducers.create(strategy, grad_comm,
                                                                    **plan.reduction.create_options())


def start(args):
    """(comm, say, (group, replicas, M, pipeline)): MPI up, flags agreed before any split, the layout made, the batch per
    replica set, every output checked. say prints on rank 0 only."""
    check_combinations(args)
    if args.conv_autotune is None:  # before the ranks compare their flags: all must time, or none
        args.conv_autotune = env.conv_autotune()
    comm = launch.init(args.threads_per_process, args.stall_timeout, args.debug_collectives)
    launch.install_abort_handler(comm)
    say = log if comm.rank == 0 else (lambda msg: None)
    agree_on_flags(comm, args)  # before any collective that the flags shape (a split, a reducer's groups)
    for note in args.notes:
        say(note)
    if args.parallel == "auto":  # rank 0 plans, every rank takes its layout
        from pydtnn.perfmodel.auto import choose
        from pydtnn.perfmodel.simulate import build

        choose(args, comm, say, built=build(args) if comm.rank == 0 else None)
    if args.parallel in ("data", "model") and comm.size == 1:
        say(f"pydtnn: --parallel {args.parallel} with one process trains sequentially")
    plan = RunPlan.from_args(args, comm.size)
    if plan.layout.pipelined:  # (its stage's group, the replicas of its place, M, this rank's pipeline)
        from pydtnn.distributed import pipeline

        lay = plan.layout
        pipe, replicas, group = pipeline.groups(comm, lay.pipeline_stages, lay.model_parallel_size)
        layout = (group, replicas, lay.model_parallel_size, pipe)
    else:
        layout = (*model_parallel.layout(comm, args.parallel, args.model_parallel_size), None)
    args.batch_size = plan.batch_size
    check_outputs(args, comm)
    return comm, say, layout, plan


def build_model_and_data(args, comm):
    """(backend, families.Choice, Model, (train, val, test), the images' shape before padding): the data
    loaded, padded to the model's design size where the family needs it, the training set augmented."""
    if args.enable_gpu:
        backend = get_backend("gpu", args.dtype, args.seed)
    else:
        backend = get_backend("cpu", args.dtype, args.seed, autotune=args.conv_autotune)
    train, val, test = load_datasets(args, comm)
    check_monitored(args, val)
    choice, model = resolve_model(args.model, train, backend, args.model_file)
    data_shape = tuple(train.input_shape)
    if choice.input_shape != data_shape:  # before augmentation, so crops see the padded image
        from pydtnn.data.pad import PaddedDataset

        train, val, test = (None if d is None else PaddedDataset(d, choice.input_shape) for d in (train, val, test))
    return backend, choice, model, (augmented(train, args), val, test), data_shape


def device_communicators(args, comm, replicas, backend, say):
    """(comm, replicas, the gradients' communicator): on a GPU, collectives that take device arrays, and the
    gradients over NCCL when asked; on the CPU, the replicas themselves."""
    if not args.enable_gpu:
        return comm, replicas, replicas
    from pydtnn.distributed.gpu_comm import DeviceComm, NcclComm

    world = replicas.size
    comm = replicas = grad_comm = DeviceComm(comm)
    if args.enable_nccl:
        try:
            grad_comm = NcclComm(comm)
        except ConfigError as e:
            raise ConfigError(f"--enable_nccl: {e}, or run without --enable_nccl (MPI through host memory)") from None
    say(f"pydtnn: {backend}, {grad_comm.name} gradient reduction" if world > 1 else f"pydtnn: {backend}")
    return comm, replicas, grad_comm


def pipeline_stage(args, model, comm):
    """(this rank's stage Model, the pipeline.Cut): the model cut where --stage_boundaries says, else into
    stages of balanced predicted time (perfmodel.pipelined.stage_cut, on --machine: the built-in one without it);
    comm: this rank's pipeline."""
    from pydtnn.perfmodel import machine as machines
    from pydtnn.perfmodel.pipelined import stage_cut

    machine = machines.DEFAULT if args.machine is None else machines.load(args.machine)
    cut = stage_cut(model, comm.size, args.batch_size, args.accumulation_steps, machine, args.threads_per_process,
                    args.stage_boundaries.split(",") if args.stage_boundaries else None)
    return cut.stage(comm.rank), cut


def scaled_optimizer_options(args, family, world, mp_size):
    """(optimizer keyword arguments, the header's note on the learning rate): the rate scaled by the model
    replicas where the batch per process grows the global batch (Goyal et al. 2017). mp_size: processes per
    replica (model-parallel group x pipeline stages)."""
    options = optimizer_options(args, family)
    if world == 1 or not args.learning_rate_scaling or args.global_batch_size is not None:
        return options, ""
    base = options["lr"]
    options["lr"] *= world  # the global batch grew P times
    return options, (f" = {base:g} x {world} {'model replicas' if mp_size > 1 else 'processes'} (linear scaling; "
                     f"--learning_rate_scaling false keeps {base:g})")


def check_reducer_flags(args, strategy):
    """ConfigError where a topk, oktopk, powersgd, local SGD or staleness flag is given to a run that reduces
    otherwise (one model replica included), or topk's warm-up outlasts the run."""
    for flag, given, wanted in (("--topk_selection", args.topk_selection != "global", "topk"),
                                ("--density_warmup_epochs", bool(args.density_warmup_epochs), ("topk", "oktopk")),
                                ("--oktopk_threshold_every", "oktopk_threshold_every" in args.explicit, "oktopk"),
                                ("--oktopk_repartition_every", "oktopk_repartition_every" in args.explicit, "oktopk"),
                                ("--rank", "rank" in args.explicit, "powersgd"),
                                ("--powersgd_start_step", "powersgd_start_step" in args.explicit, "powersgd"),
                                ("--powersgd_hierarchical", args.powersgd_hierarchical, "powersgd"),
                                ("--local_sgd", bool(args.local_sgd), "local_sgd"),
                                ("--average", "average" in args.explicit, "local_sgd"),
                                ("--post_local_sgd", "post_local_sgd" in args.explicit, "local_sgd"),
                                ("--reduction_staleness", bool(args.reduction_staleness), "stale")):
        wanted = (wanted,) if isinstance(wanted, str) else wanted
        if given and strategy not in wanted:
            add = {"local_sgd": "add --local_sgd H and ", "stale": ""}.get(wanted[0],
                                                                        f"add --reduction {' or '.join(wanted)} and ")
            raise ConfigError(f"{flag} applies to the {' or '.join(wanted)} reducer over several processes; this "
                              f"run reduces with {strategy or 'nothing (one model replica)'}: {add}launch 2 or more "
                              f"replicas, or leave {flag} out")
    if strategy in ("topk", "oktopk") and args.density_warmup_epochs > args.num_epochs:
        raise ConfigError(f"--density_warmup_epochs {args.density_warmup_epochs} is more than --num_epochs "
                          f"{args.num_epochs}: the density would never reach --density {args.density:g}; give at "
                          f"most {args.num_epochs}")


def topk_momentum(corrected):
    """The topk reducer's momentum option where --momentum_correction moved SGD's momentum into it."""
    return {"momentum": corrected} if corrected else {}


def new_tracer(model, comm):
    """--tracing: this rank's timeline, which the trainer gets at construction."""
    from pydtnn.profiling import Tracer

    return Tracer(pid=comm.rank, name=f"pydtnn {model.name} rank {comm.rank}")


def attach_tracer(trainer):
    """--tracing: the trainer's timeline also gets the spans of the model, its groups and the reducer."""
    model = trainer.model
    model.set_tracer(trainer.tracer)
    if model.sharding is not None:
        model.sharding.group.tracer = trainer.tracer
    if trainer.reducer is not None:
        trainer.reducer.tracer = trainer.tracer
    if hasattr(trainer.optimizer, "tracer"):  # ZeRO's allgathers of the shards
        trainer.optimizer.tracer = trainer.tracer
    if model.param_shards is not None:  # ZeRO stage 3's gathers of the layers' parameters
        model.param_shards.tracer = trainer.tracer


def execute(args, trainer, datasets, start_epoch, comm, say):
    """Evaluate only, or train (evaluating first with --evaluate); results on stdout; the trace written."""
    train, val, test = datasets
    if args.evaluate_only:
        return evaluate_only(trainer, test, args)
    if args.evaluate and test is not None and comm.rank == 0:
        print("before training: " + format_record({"epoch": 0, **trainer.evaluate_as("test", test, args.batch_size)}),
              flush=True)
    elif args.evaluate and test is not None:
        trainer.evaluate_as("test", test, args.batch_size)  # a collective: every rank takes part
    if start_epoch >= args.num_epochs:
        say(f"pydtnn: the checkpoint already holds {start_epoch} epochs (--num_epochs {args.num_epochs}); "
            f"nothing to train")
    trainer.fit(train, args.num_epochs, args.batch_size, val=val, test=test, steps_per_epoch=args.steps_per_epoch,
                start_epoch=start_epoch, drop_last=args.drop_last)
    if comm.rank == 0:
        print(format_record(trainer.final))
    if trainer.tracer is not None:
        from pydtnn.profiling import written

        paths = trainer.tracer.write(args.tracer_output, comm.size)
        say(f"pydtnn: {written(paths)}\n{trainer.tracer.summary_table()}")
    return trainer.final


def resolve_model(name, train, backend, model_file=None):
    """(families.Choice, Model): the variant of `name` that fits the training data, built on backend; or the
    model of the Python file `model_file` (--model_file), built for the data as it is."""
    from pydtnn.models.families import Choice, resolve

    if model_file:
        from pydtnn.models import model_file as from_file

        model = from_file.load(model_file, tuple(train.input_shape), train.num_classes, backend)
        return Choice(model.name, tuple(train.input_shape), train.num_classes, []), model
    return resolve(name, tuple(train.input_shape), train.num_classes,
                   build=lambda variant, shape: models.create(variant, input_shape=shape,
                                                              num_classes=train.num_classes, backend=backend))


def fill_defaults(args, model_name):
    """--batch_size, --num_epochs and --lr_schedulers left unset take the model family's values
    (models/families.py; the learning rate is optimizer_options')."""
    from pydtnn.models.families import recipe

    for key, value in recipe(model_name, args.optimizer).items():
        if key != "learning_rate" and getattr(args, key) is None:
            setattr(args, key, value)


def momentum_correction(args, strategy, options):
    """--momentum_correction: SGD's momentum, which the topk (or oktopk) reducer then applies to each rank's gradients
    before it selects (the optimizer's momentum is set to 0 in `options`); 0.0 without the flag. A
    ConfigError where it does not apply."""
    if not args.momentum_correction:
        return 0.0
    if strategy not in ("topk", "oktopk"):
        raise ConfigError(f"--momentum_correction applies to the topk or oktopk reducer over several processes; this "
                          f"run reduces with {strategy or 'no reducer (one process)'}: add --reduction topk (or "
                          "oktopk) and launch 2 or more processes")
    if args.optimizer != "sgd" or options.get("nesterov"):
        raise ConfigError(f"--momentum_correction moves SGD's momentum into the {strategy} reducer; got --optimizer "
                          f"{args.optimizer}{' with --nesterov' if options.get('nesterov') else ''}: expected "
                          "--optimizer sgd without Nesterov")
    if not options.get("momentum"):
        raise ConfigError(f"--momentum_correction moves SGD's momentum into the {strategy} reducer, but --momentum "
                          "is 0; expected a momentum in (0, 1)")
    if options.get("weight_decay"):
        raise ConfigError(f"--momentum_correction with --decay {options['weight_decay']:g}: the decay would skip the "
                          "reducer's momentum; expected --decay 0")
    momentum, options["momentum"] = options["momentum"], 0.0
    return momentum


def load_datasets(args, comm=None):
    """(train, validation or None, test or None) as the dataset flags say, not yet augmented.

    With --download and several processes, rank 0 fetches first and the others then find its copy."""
    if args.use_synthetic_data or args.dataset == "synthetic":
        from pydtnn.models.families import variant

        if args.model_file:  # what the file builds is not known before it runs: CIFAR-10's images
            shape, classes = (3, 32, 32), 10
        else:
            shape, classes = models.defaults(variant(args.model, (3, 32, 32)))  # a family: its small-image variant
        if len(shape) == 1:  # a token model: random token windows
            from pydtnn.data.text import random_text

            train, test = random_text(args.context_length or shape[0], classes, args.seed)
        else:
            train, test = data.load("synthetic", input_shape=shape, num_classes=classes, seed=args.seed)
    else:
        first = comm is None or comm.size == 1 or comm.rank == 0
        if args.download and not first:
            comm.barrier()  # rank 0 has fetched (or failed, and ended the job)
        train, test = data.load(args.dataset, args.dataset_train_path, args.dataset_test_path,
                                download=args.download and first, **text_options(args))
        if args.download and first and comm is not None and comm.size > 1:
            comm.barrier()
    train, val = data.resolve_validation(train, test, args.validation_split, args.test_as_validation, args.seed)
    return train, val, test


def check_tokenizer(directory, tokenizer):
    """ConfigError unless the checkpoint in `directory` was trained on token ids of this `tokenizer` (None: the data
    has none): a resumed text model must read the same ids as the same characters."""
    from pydtnn.data.text import Tokenizer

    where = os.path.join(directory, checkpoint.META_FILE)
    saved = checkpoint.read_meta(directory).get("tokenizer")
    if saved is None and tokenizer is None:
        return
    if saved is None or tokenizer is None:
        raise ConfigError(f"{where} was trained on {'text' if saved else 'data without a tokenizer'}, but this run's "
                          f"data {'is not text' if saved else 'is text'}; expected the checkpoint's kind of data")
    saved = Tokenizer.from_dict(saved, f"{where}: meta.tokenizer")
    if saved != tokenizer:
        chars = f" {saved.vocabulary[:60]!r}" if saved.vocabulary else ""
        raise ConfigError(f"{where} was trained on {saved!r}{chars}, "
                          f"this text gives {tokenizer!r}; expected the same text (or --tokenizer) as the saved run")


def text_options(args):
    """A text dataset's loader options from the flags: the window (default: the model's design context) and the
    tokenizer; {} for any other dataset (where --context_length is refused by preflight)."""
    if args.dataset not in data.TEXT:
        return {}
    tokenizer = saved_tokenizer(args) or args.tokenizer
    context = args.context_length
    if context is None:
        from pydtnn.data.text import DEFAULT_CONTEXT
        from pydtnn.models.families import variant

        shape = None if args.model_file else models.defaults(variant(args.model, (DEFAULT_CONTEXT,)))[0]
        context = shape[0] if shape is not None and len(shape) == 1 else DEFAULT_CONTEXT
    return {"context_length": context, "tokenizer": tokenizer}


def saved_tokenizer(args):
    """The Tokenizer of the checkpoint a text run resumes or takes its weights from (its ids mean that vocabulary's
    characters), or None; ConfigError where --tokenizer asks for another kind."""
    from pydtnn.data.text import Tokenizer

    for flag, path in (("--resume", args.resume), ("--weights_and_bias_filename", args.weights_and_bias_filename)):
        if not path or not os.path.isfile(os.path.join(path, checkpoint.META_FILE)):
            continue
        saved = checkpoint.read_meta(path).get("tokenizer")
        if saved is None:
            return None
        tokenizer = Tokenizer.from_dict(saved, f"{os.path.join(path, checkpoint.META_FILE)}: meta.tokenizer")
        if "tokenizer" in args.explicit and args.tokenizer != tokenizer.kind:
            raise ConfigError(f"--tokenizer {args.tokenizer}: the checkpoint of {flag} {path} reads text as "
                              f"{tokenizer.kind}; leave --tokenizer out")
        return tokenizer
    return None


def augmented(train, args):
    """The training set with the flips and crops the flags ask for."""
    return data.with_augmentation(train, flip=args.flip_images, flip_prob=args.flip_images_prob,
                                  crop=args.crop_images, crop_padding=args.crop_images_padding)


def build_callbacks(args, config, effective=None, is_root=True):
    """The callbacks the flags ask for; is_root: this process writes the run's files. A checkpoint is saved by
    every rank's callback, as resume.save_checkpoint says which ranks take part."""
    chosen, out = chosen_schedulers(args), []
    if "early_stopping" in chosen:
        out.append(EarlyStopping(args.early_stopping_metric, args.early_stopping_patience))
    if "stop_at_loss" in chosen:
        out.append(StopAtThreshold(args.stop_at_loss_metric, args.stop_at_loss_threshold))
    if args.history_file and is_root:
        out.append(HistoryCSV(args.history_file, made=args.checkpoint_dir))
    if "model_checkpoint" in chosen or args.checkpoint_dir:
        out.append(ModelCheckpoint(lambda t, epoch: save_checkpoint(args.checkpoint_dir, t, epoch, config, effective),
                                   args.model_checkpoint_save_freq))
    return out


def evaluate_only(trainer, test, args):
    """Evaluate on the test set and report inference throughput; writes the final record."""
    if test is None:
        raise ConfigError(f"--evaluate_only needs a test set; dataset {args.dataset} has none")
    t0 = time.perf_counter()
    values = trainer.evaluate_as("test", test, args.batch_size)
    wall = time.perf_counter() - t0
    final = {"final": True, **values, "wall_time_s": wall, "samples_per_second": len(test) / wall,
             **trainer.layout(), "params_sha256": trainer.step.params_sha256()}
    if not trainer.is_root:
        return final
    if args.metrics_file:
        out = MetricsFile(args.metrics_file)
        out.write(final)
        out.close()
    print(format_record(final))
    return final


class HistoryCSV:
    """--history_file: the per-epoch records as CSV, rewritten atomically after every epoch."""

    def __init__(self, path, made=None):
        from pydtnn.files import check_writable

        self.path = check_writable(path, "history file", made)

    def on_epoch_end(self, trainer, epoch, logs):
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=list(trainer.history[0]))
        w.writeheader()
        w.writerows(trainer.history)
        write_atomic(self.path, text.getvalue().encode("utf-8"), make_folder=True)
