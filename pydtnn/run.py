"""Assemble and execute one run from a parsed configuration (the CLI's namespace).

    flags -> Backend, datasets, Model, optimizer, schedules, callbacks -> Trainer.fit -> outputs

Everything here is plain wiring: each piece is built by the module that owns it.
"""

import csv
import io
import os
import sys
import time

import numpy as np

from pydtnn import checkpoint, data, env, losses, models, optim
from pydtnn.backends import CPUBackend, get_backend
from pydtnn.callbacks import EarlyStopping, ModelCheckpoint, StopAtThreshold
from pydtnn.distributed import launch, model_parallel, reducers
from pydtnn.distributed.consistency import broadcast_state
from pydtnn.errors import ConfigError, DataError
from pydtnn.files import inside, same_file, write_atomic
from pydtnn.optim import schedules as sch
from pydtnn.trainer import MetricsFile, Trainer, format_record

# flags that describe how to run rather than what to compute: not saved as the run's configuration
_NOT_SAVED = ("config", "resume", "list_models", "profile", "explicit", "notes", "overwrite", "download")
# flags naming files and folders: saved as absolute paths, so a resumed run finds them from any directory
PATH_FLAGS = ("dataset_train_path", "dataset_test_path", "weights_and_bias_filename", "checkpoint_dir",
              "metrics_file", "history_file", "tracer_output", "model_file")
# outputs that a resumed run writes again: inside the checkpoint directory, they follow it when it moves
_OUTPUTS = ("metrics_file", "history_file", "tracer_output")
# what may differ between the ranks of one job: paths (each node has its own disks) and what rank 0 alone does
_PER_RANK = PATH_FLAGS + ("summary", "tracing", "threads_per_process", "progress")


def saved_config(directory):
    """The configuration stored in a checkpoint directory by an earlier run."""
    config = checkpoint.read_meta(directory).get("config", {})
    if not isinstance(config, dict):
        raise DataError(f"{os.path.join(directory, checkpoint.META_FILE)} is corrupt: its 'config' is a "
                        f"{type(config).__name__}; expected an object of flag values")
    return config


def resumed_config(directory, given=None, notes=None):
    """The saved configuration of the checkpoint in `directory`, continued in `directory` itself.

    The run goes on writing checkpoints into `directory` (wherever the checkpoint was first written,
    and wherever it has been moved since), or into the checkpoint_dir given now (a fork). A path from
    a checkpoint is never trusted as a place to write: an output file that was inside the old
    checkpoint directory moves with it (unless a link in the checkpoint leads it out), any other goes
    back to its default, and `notes` (a list, when given) receives a line saying so. `given` ({flag:
    value} set now) are left out, as the caller sets them. An evaluation (evaluate_only given) inherits
    no output file: it would replace the run's own metrics with its one record. A model file is never
    taken from a checkpoint: without --model_file given, its checkpoint is refused (ConfigError).
    """
    given = given or {}
    config = saved_config(directory)
    saved_file = config.pop("model_file", None)
    if isinstance(saved_file, str) and "model_file" not in given:  # code to run never comes from a checkpoint
        raise ConfigError(f"checkpoint {directory} was trained on the model of --model_file {saved_file[:300]}; a "
                          f"checkpoint never runs code by itself: give --model_file {saved_file[:300]} again to "
                          f"resume it")
    old = config.get("checkpoint_dir")
    here = os.path.abspath(given.get("checkpoint_dir") or directory)
    if "checkpoint_dir" not in given:
        config["checkpoint_dir"] = here
    for key in _OUTPUTS:
        path = config.pop(key, None)  # absent: the flag's default, as for any flag not saved
        if key in given or not isinstance(path, str):
            continue
        if given.get("evaluate_only") and key != "tracer_output":
            config[key] = None
            continue
        old_abs, moved = os.path.abspath(old) if isinstance(old, str) else None, None
        if old_abs is not None and os.path.commonpath([os.path.abspath(path), old_abs]) == old_abs:
            moved = os.path.join(here, os.path.relpath(os.path.abspath(path), old_abs))
            if not inside(moved, here):  # a symbolic link in the checkpoint directory leads out of it
                moved = None
        if moved is not None:
            config[key] = moved
        elif notes is not None and key == "tracer_output" and config.get("tracing"):
            notes.append(f"pydtnn: the checkpoint's --tracer_output {path[:200]} lies outside it: the trace goes to "
                         f"the default (give --tracer_output to choose)")
        elif notes is not None and key != "tracer_output":
            notes.append(f"pydtnn: the checkpoint's --{key} {path[:200]} lies outside it and is not written "
                         f"again; give --{key} to write one")
    return config


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(args):
    """Train (or evaluate) as `args` says; returns the final metrics record (None for --list_models).

    Every check that needs no data runs before the communicator is made, and every check at all before
    a byte is written: outputs are created by the first epoch's end, not before.
    """
    if args.list_models:
        print(models_table())
        return None
    check_combinations(args)
    if args.conv_autotune is None:  # before the ranks compare their flags: all must time, or none
        args.conv_autotune = env.conv_autotune()
    comm = launch.init(args.threads_per_process, args.stall_timeout, args.debug_collectives)
    launch.install_abort_handler(comm)
    say = log if comm.rank == 0 else (lambda msg: None)
    agree_on_flags(comm, args)  # before any collective that the flags shape (a split, a reducer's groups)
    for note in args.notes:
        say(note)
    if comm.size > 1 and args.parallel == "sequential":
        raise ConfigError(f"--parallel sequential, but {comm.size} processes were launched; use --parallel data, "
                          f"model or hybrid, or one process")
    if args.parallel in ("data", "model") and comm.size == 1:
        say(f"pydtnn: --parallel {args.parallel} with one process trains sequentially")
    group, replicas, mp_size = model_parallel.layout(comm, args.parallel, args.model_parallel_size)
    world = replicas.size  # model replicas: the batch, the learning rate and the reduction follow them
    if args.global_batch_size is not None:
        if args.global_batch_size % world:
            raise ConfigError(f"--global_batch_size {args.global_batch_size} does not divide by {world} "
                              f"{'model replicas' if mp_size > 1 else 'processes'}")
        args.batch_size = args.global_batch_size // world
    check_outputs(args, comm)
    # the flags as given (None: "the default for this model and optimizer"), saved as the run's
    # configuration; the values they resolve to are saved next to them as "effective"
    config = {k: (os.path.abspath(v) if k in PATH_FLAGS and isinstance(v, str) else v)
              for k, v in sorted(vars(args).items()) if k not in _NOT_SAVED}

    if args.enable_gpu:
        backend = get_backend("gpu", args.dtype, args.seed)
    else:
        backend = get_backend("cpu", args.dtype, args.seed, autotune=args.conv_autotune)
    train, val, test = load_datasets(args, comm)
    check_monitored(args, val)
    choice, model = resolve_model(args.model, train, backend, args.model_file)
    data_shape = tuple(train.input_shape)
    if choice.input_shape != tuple(train.input_shape):  # before augmentation, so crops see the padded image
        from pydtnn.data.pad import PaddedDataset

        train, val, test = (None if d is None else PaddedDataset(d, choice.input_shape) for d in (train, val, test))
    train = augmented(train, args)
    family = None if args.model_file else choice.name  # a model file's name is its own, not a zoo family's
    fill_defaults(args, family)
    if args.weights_and_bias_filename and not args.resume:  # a resumed run takes every weight from its checkpoint
        checkpoint.load_weights(args.weights_and_bias_filename, model)
    if group is not None:
        model_parallel.partition(model, group)
    grad_comm = replicas
    if args.enable_gpu:  # collectives that take device arrays; gradients over NCCL when asked
        from pydtnn.distributed.gpu_comm import DeviceComm, NcclComm

        comm = replicas = grad_comm = DeviceComm(comm)
        if args.enable_nccl:
            try:
                grad_comm = NcclComm(comm)
            except ConfigError as e:
                raise ConfigError(f"--enable_nccl: {e}, or run without --enable_nccl (MPI through host memory)") from None
        say(f"pydtnn: {backend}, {grad_comm.name} gradient reduction" if world > 1 else f"pydtnn: {backend}")
    options = optimizer_options(args, family)
    lr_note = ""
    if world > 1 and args.learning_rate_scaling and args.global_batch_size is None:
        base = options["lr"]
        options["lr"] *= world  # the global batch grew P times (Goyal et al. 2017)
        lr_note = (f" = {base:g} x {world} {'model replicas' if mp_size > 1 else 'processes'} (linear scaling; "
                   f"--learning_rate_scaling false keeps {base:g})")
    reducer, strategy = None, reduction_strategy(args, world)
    corrected = momentum_correction(args, strategy, options)  # SGD's momentum, moved into the topk reducer
    for flag, given in (("--topk_selection", args.topk_selection != "global"),
                        ("--density_warmup_epochs", bool(args.density_warmup_epochs))):
        if given and strategy != "topk":
            raise ConfigError(f"{flag} applies to the topk reducer over several processes; this run reduces with "
                              f"{strategy or 'nothing (one process)'}: add --reduction topk and launch 2 or more "
                              f"processes, or leave {flag} out")
    if strategy == "topk" and args.density_warmup_epochs > args.num_epochs:
        raise ConfigError(f"--density_warmup_epochs {args.density_warmup_epochs} is more than --num_epochs "
                          f"{args.num_epochs}: the density would never reach --density {args.density:g}; give at "
                          f"most {args.num_epochs}")
    optimizer = optim.create(args.optimizer, model.parameters(), backend=model.backend, **options)
    schedules = build_schedules(args, world)
    if strategy is not None:
        reducer_options = {"compression": args.gradient_compression, "progress": args.reduction_progress}
        if strategy in ("bucketed", "hierarchical"):
            reducer_options["bucket_mb"] = args.bucket_size_mb
        if strategy == "hierarchical":
            reducer_options["ranks_per_node"] = args.ranks_per_node
        if strategy == "topk":
            reducer_options.update(density=args.density, momentum=corrected, warmup_epochs=args.density_warmup_epochs,
                                   selection=args.topk_selection)
        reducer = reducers.create(strategy, grad_comm, **reducer_options)
    trainer = Trainer(model, losses.create(args.loss_func), optimizer, metrics=metric_names(args), seed=args.seed,
                      progress=args.progress, epoch_lines=True, metrics_file=args.metrics_file, schedules=schedules,
                      log=log, comm=replicas, reducer=reducer, is_root=comm.rank == 0, sync_every=args.sync_every)
    trainer.accumulation_steps = args.accumulation_steps
    if args.sync_batchnorm:
        trainer.sync_batchnorm()
    effective = effective_values(args, choice, options, world, schedules, strategy, mp_size)
    effective["data_shape"] = list(data_shape)  # the images before any padding: what an exported graph takes
    if corrected:
        effective["topk_momentum"] = corrected  # the optimizer's momentum is 0: the reducer applies this one
    trainer.callbacks = build_callbacks(args, trainer, config, effective)

    start_epoch = 0
    if args.resume:
        start_epoch = resume(args.resume, trainer, options["lr"] if "learning_rate" in args.explicit else None,
                             scaled=world > 1 and args.learning_rate_scaling and args.global_batch_size is None)
    check_agreement(comm, model, (train, val, test), start_epoch)
    broadcast_state(replicas, model, optimizer)
    for line in header(args, choice, model, (train, val, test), effective, lr_note, data_shape):
        say(line)
    if args.summary and comm.rank == 0:
        model.summary(file=sys.stderr)
    if args.tracing:
        from pydtnn.profiling import Tracer

        trainer.tracer = Tracer(pid=comm.rank, name=f"pydtnn {model.name} rank {comm.rank}")
        model.set_tracer(trainer.tracer)
        if model.sharding is not None:
            model.sharding.group.tracer = trainer.tracer
        if reducer is not None:
            reducer.tracer = trainer.tracer

    announce_compilation(backend, say)
    if isinstance(backend, CPUBackend):  # every rank takes rank 0's measured choices (docs/performance.md)
        backend.tune_convolutions(comm, say, conv_shapes(model))
    if args.evaluate_only:
        return evaluate_only(trainer, test, args)
    if args.evaluate and test is not None:
        say("before training: " + format_record({"epoch": 0, **trainer.evaluate_as("test", test, args.batch_size)}))
    if start_epoch >= args.num_epochs:
        say(f"pydtnn: the checkpoint already holds {start_epoch} epochs (--num_epochs {args.num_epochs}); nothing to train")
    trainer.fit(train, args.num_epochs, args.batch_size, val=val, test=test, steps_per_epoch=args.steps_per_epoch,
                start_epoch=start_epoch, drop_last=args.drop_last)
    if comm.rank == 0:
        print(format_record(trainer.final))
    if trainer.tracer is not None:
        from pydtnn.profiling import written

        paths = trainer.tracer.write(args.tracer_output, comm.size)
        say(f"pydtnn: {written(paths)}\n{trainer.tracer.summary_table()}")
    return trainer.final


def conv_shapes(model):
    """(geometry, output channels) of every convolution of `model` as it now stands."""
    from pydtnn.layers.conv import Conv2D

    return [(layer.geometry, layer.params["weight"].shape[0]) for _, layer in model.layers() if isinstance(layer, Conv2D)]


def announce_compilation(backend, say):
    """One line before the first compiled CPU kernel when Numba's cache does not hold them yet."""
    if not isinstance(backend, CPUBackend) or backend.kernels != "numba":
        return
    from pydtnn.backends.cpu.kernels import jit

    try:
        path, held = jit.cache_dir()
    except Exception:  # Numba's cache locators are not public API: without them, no notice
        return
    if not held:
        say(f"pydtnn: compiling CPU kernels, first run only (10-30 s); cached in {path}")


def models_table():
    """--list_models: every registered model with its input, classes, parameters and GFLOPs, then the
    family names and the variants they pick (facts from models/catalog.py; nothing is built)."""
    from pydtnn.models.catalog import CATALOG
    from pydtnn.models.families import FAMILIES, SMALL_SIDE

    rows = [("model", "input", "classes", "parameters", "GFLOPs")]
    for name in models.names():
        shape, classes, params, gflops = CATALOG[name][:4]
        rows.append((name, "x".join(map(str, shape)), str(classes), f"{params:,}", f"{gflops:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i == 0 or i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", f"Family names pick a variant by image size (up to {SMALL_SIDE} pixels a side: the CIFAR-10 one); "
              "see docs/models.md:"]
    for family, v in sorted(FAMILIES.items()):
        picks = " / ".join(n for n in (v["cifar10"], v["imagenet"]) if n)
        lines.append(f"  {family:<12} {picks}")
    return "\n".join(lines)


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
    """--momentum_correction: SGD's momentum, which the topk reducer then applies to each rank's gradients
    before it selects (the optimizer's momentum is set to 0 in `options`); 0.0 without the flag. A
    ConfigError where it does not apply."""
    if not args.momentum_correction:
        return 0.0
    if strategy != "topk":
        raise ConfigError(f"--momentum_correction applies to the topk reducer over several processes; this run "
                          f"reduces with {strategy or 'no reducer (one process)'}: add --reduction topk and launch 2 "
                          "or more processes")
    if args.optimizer != "sgd" or options.get("nesterov"):
        raise ConfigError(f"--momentum_correction moves SGD's momentum into the topk reducer; got --optimizer "
                          f"{args.optimizer}{' with --nesterov' if options.get('nesterov') else ''}: expected "
                          "--optimizer sgd without Nesterov")
    if not options.get("momentum"):
        raise ConfigError("--momentum_correction moves SGD's momentum into the topk reducer, but --momentum is 0; "
                          "expected a momentum in (0, 1)")
    if options.get("weight_decay"):
        raise ConfigError(f"--momentum_correction with --decay {options['weight_decay']:g}: the decay would skip the "
                          "reducer's momentum; expected --decay 0")
    momentum, options["momentum"] = options["momentum"], 0.0
    return momentum


def reduction_strategy(args, world):
    """The gradient reducer's name with several processes (None with one)."""
    if world == 1:
        return None
    return args.reduction or ("per_layer" if args.non_blocking_mpi else "bucketed")


def effective_values(args, choice, options, world, schedules, strategy, mp_size=1):
    """What the run computes with, after defaults, family resolution, scaling and warm-up: saved in
    config.json under "effective" and summarized in the header. world: model replicas; mp_size: the
    processes of each (model parallelism)."""
    parallel = ("hybrid" if world > 1 else "model") if mp_size > 1 else ("data" if world > 1 else "sequential")
    out = {"model": choice.name, "input_shape": list(choice.input_shape), "num_classes": choice.num_classes,
           "adapted": list(choice.notes), "processes": world * mp_size, "parallel": parallel,
           "model_parallel_size": mp_size, "replicas": world,
           "reduction": strategy, "batch_size_per_process": args.batch_size,
           "global_batch_size": args.batch_size * world, "num_epochs": args.num_epochs,
           "lr_schedulers": _chosen(args),
           "optimizer": args.optimizer, "learning_rate": options["lr"],
           **{k: v for k, v in optim.hyperparameters(args.optimizer, **options).items() if k != "lr"}}
    for s in schedules:
        if isinstance(s, sch.WarmUp):
            out["warm_up"] = {"epochs": s.epochs, "start_factor": s.start_factor}
    return out


def header(args, choice, model, datasets, eff, lr_note, data_shape):
    """The run's few header lines (rank 0 prints them): model, data (data_shape: its images before any
    padding), parallelism, optimizer."""
    train, val, test = datasets
    name = choice.name if choice.name == args.model else f"{choice.name} (from --model {args.model})"
    if args.model_file:
        name = f"{choice.name} from --model_file {args.model_file}"
    yield f"pydtnn: model {name}, {model.count_params():,} parameters"
    for note in choice.notes[1 if choice.name != args.model else 0:]:
        yield f"pydtnn:   adapted: {note}"
    dataset = "synthetic" if args.use_synthetic_data else args.dataset
    yield (f"pydtnn: data {dataset}: {len(train):,} train, {len(val) if val else 0:,} validation, "
           f"{len(test) if test else 0:,} test; {'x'.join(map(str, data_shape))} images, {train.num_classes} classes")
    if eff["model_parallel_size"] > 1:
        each = f"split over {eff['model_parallel_size']} processes by output channels"
        if eff["replicas"] > 1:
            yield (f"pydtnn: {eff['processes']} processes, hybrid parallel: {eff['replicas']} model replicas, each "
                   f"{each}; {eff['reduction']} gradient reduction, batch {args.batch_size} per replica "
                   f"({eff['global_batch_size']} global)")
        else:
            yield f"pydtnn: {eff['processes']} processes, model parallel: every layer {each}; batch {args.batch_size}"
    elif eff["processes"] > 1:
        yield (f"pydtnn: {eff['processes']} processes, data parallel, {eff['reduction']} gradient reduction, "
               f"batch {args.batch_size} per process ({eff['global_batch_size']} global)")
    else:
        yield f"pydtnn: one process, batch {args.batch_size}"
    extras = [f"{k.replace('_', ' ')} {v:g}" for k, v in eff.items()
              if k in ("momentum", "weight_decay", "beta1", "beta2") and isinstance(v, float)]
    if "topk_momentum" in eff:  # the optimizer's momentum is 0: the reducer applies it
        extras = [e for e in extras if not e.startswith("momentum ")] + [
            f"momentum {eff['topk_momentum']:g} in the topk reducer (momentum correction)"]
    if eff.get("reduction") == "topk" and args.topk_selection == "per_layer":
        extras.append("topk selection per layer")
    if eff.get("reduction") == "topk" and args.density_warmup_epochs and args.density < 0.25:
        extras.append(f"topk density from 0.25 to {args.density:g} over {_count(args.density_warmup_epochs, 'epoch')}")
    schedules = ",".join(_chosen(args)) or "none"
    if "warm_up" in eff:
        w = eff["warm_up"]
        ramp = f"warm_up ({_count(w['epochs'], 'epoch')} from {w['start_factor']:g}x)"
        schedules = schedules.replace("warm_up", ramp)
    yield (f"pydtnn: {args.optimizer}, learning rate {eff['learning_rate']:g}{lr_note}; {', '.join(extras)}; "
           f"{_count(args.num_epochs, 'epoch')}; schedules: {schedules}")
    if args.checkpoint_dir and not args.evaluate_only:
        yield f"pydtnn: checkpoints and the whole configuration (config.json) go to {args.checkpoint_dir}"
    yield from scale_warnings(args, train, eff)
    from pydtnn.models.families import expectation

    expect = None if args.model_file else expectation(choice.name)
    if expect and not args.evaluate_only:
        yield f"pydtnn: what to expect: {expect}"


def scale_warnings(args, train, eff):
    """Warnings on a run whose sizes defeat its own settings: a global batch larger than the training
    set, a warm-up longer than the run."""
    n, batch = len(train), eff["global_batch_size"]
    if batch > n:
        yield (f"pydtnn: warning: the global batch of {batch:,} samples is larger than the {n:,} training samples: "
               f"every step takes the whole set, one step an epoch; expected at most {n:,} (a smaller --batch_size)")
    warm = eff.get("warm_up")
    if warm and warm["epochs"] > args.num_epochs:
        reached = warm["start_factor"] + (1 - warm["start_factor"]) * args.num_epochs / warm["epochs"]
        yield (f"pydtnn: warning: warm_up ramps the learning rate over {_count(warm['epochs'], 'epoch')} but the run "
               f"trains {_count(args.num_epochs, 'epoch')}: it never reaches the full rate (about {reached:.2g}x at "
               f"the end); give --warm_up_epochs {args.num_epochs} or fewer")


def _count(n, word):
    return f"{n} {word}{'s' * (n != 1)}"


def check_combinations(args):
    """Flags that contradict each other: found before anything is loaded, on every rank alike."""
    if args.model_file and "model" in args.explicit:
        raise ConfigError(f"--model {args.model} and --model_file {args.model_file} both name the model; give one")
    if args.enable_nccl and not args.enable_gpu:
        raise ConfigError("--enable_nccl reduces GPU gradients; expected it together with --enable_gpu")
    if args.evaluate_only and "checkpoint_dir" in args.explicit:  # from a file or a checkpoint it is moot
        raise ConfigError(f"--evaluate_only trains nothing and writes no checkpoint, but --checkpoint_dir "
                          f"{args.checkpoint_dir} was given; drop it (to evaluate a checkpoint: --resume DIR "
                          f"--evaluate_only, or --weights_and_bias_filename DIR)")
    if "model_checkpoint" in _chosen(args) and not args.checkpoint_dir:
        raise ConfigError("model_checkpoint needs --checkpoint_dir DIR")


def profile_path(rank=0, size=1):
    """--profile's output, in the working directory: pydtnn.prof, or pydtnn.rankR.prof per process of a job."""
    return os.path.abspath("pydtnn.prof" if size == 1 else f"pydtnn.rank{rank}.prof")


def check_outputs(args, comm):
    """Every file and folder the run will write can be written, no output is a file the run reads or
    another output, and no other run's checkpoint is in the way: checked before training starts, on
    each rank for what that rank writes."""
    from pydtnn.files import check_distinct, check_writable

    made = None if args.evaluate_only else args.checkpoint_dir
    if args.tracing:  # every rank writes its own trace
        check_writable(trace_path(args.tracer_output, comm), "trace file", made)
    if comm.rank:
        return
    outputs = [(what, getattr(args, key)) for key, what in (("metrics_file", "metrics file"),
                                                            ("history_file", "history file"))]
    if args.profile:
        outputs += [("profile", profile_path(r, comm.size)) for r in range(comm.size)]
    for what, path in outputs:
        if path:
            check_writable(path, what, made)
    if args.tracing:
        from pydtnn.profiling import trace_paths

        outputs += [("trace file", p) for p in trace_paths(args.tracer_output, comm.size)]
    # written through write_atomic: their temporary names are written (and first removed) too
    outputs += [(f"{what}'s temporary name", p + checkpoint.TMP) for what, p in outputs if p and what != "metrics file"]
    own = []  # the checkpoint's own files: replaced by each save, read back by --resume of the same directory
    if args.checkpoint_dir and not args.evaluate_only:
        check_checkpoint_dir(args.checkpoint_dir, args.resume, args.overwrite)
        own = [("checkpoint file", os.path.join(args.checkpoint_dir, n + tmp)) for n in checkpoint.ALL_FILES
               for tmp in ("", checkpoint.TMP)]
    inputs, folders = run_inputs(args)
    resumed = [(w, p) for w, p in inputs if w == "checkpoint file being resumed"]
    check_distinct(own, [(w, p) for w, p in inputs if (w, p) not in resumed and not
                         (w == "config file" and any(same_file(p, q) for _, q in own))], folders)
    check_distinct(outputs, inputs + own, folders)


def run_inputs(args):
    """([(what, path)] files the run reads, [(what, folder)] folders it reads files from)."""
    files = [("config file", args.config), ("model file", args.model_file)]
    read, trees = data.source_files(args.dataset, args.dataset_train_path, args.dataset_test_path)
    files += [("data file", f) for f in read]
    folders = [("image folder", f) for f in trees]
    for what, path in (("dataset train path", args.dataset_train_path), ("dataset test path", args.dataset_test_path)):
        if path and not os.path.isdir(path):  # a file where a folder belongs: load says so, but it is read
            files.append((what, path))
    weights = args.weights_and_bias_filename
    if weights and os.path.isdir(weights):  # a checkpoint directory: its files
        files += [("weights checkpoint file", os.path.join(weights, n + tmp)) for n in checkpoint.ALL_FILES
                  for tmp in ("", checkpoint.TMP)]
    elif weights:
        files.append(("weights file", weights))
    if args.resume:
        files += [("checkpoint file being resumed", os.path.join(args.resume, n + tmp)) for n in checkpoint.ALL_FILES
                  for tmp in ("", checkpoint.TMP)]
    return [(w, p) for w, p in files if p], folders


def trace_path(path, comm):
    """The trace file of this rank: `path` itself with one process, else path's stem + .rankR.json."""
    from pydtnn.profiling import trace_paths

    return trace_paths(path, comm.size)[comm.rank]


def check_checkpoint_dir(directory, resume=None, overwrite=False):
    """A fresh run never replaces another run's checkpoint unless asked (--overwrite); resuming
    writes on into the directory it resumed from."""
    from pydtnn.files import check_writable

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"cannot write checkpoint directory {directory}: it exists and is not a directory")
    long = [c for c in os.path.abspath(directory).split(os.sep) if len(os.fsencode(c)) > 255]
    if long:  # made with the first checkpoint: found here, not after an epoch
        raise ConfigError(f"cannot write checkpoint directory {directory[:120]}...: its folder name {long[0][:40]}... "
                          f"is {len(os.fsencode(long[0]))} bytes; expected at most 255")
    check_writable(os.path.join(directory, checkpoint.META_FILE), "checkpoint directory", made=directory)
    for name in checkpoint.ALL_FILES:  # each file a save writes, and its temporary name
        for tmp in ("", checkpoint.TMP):
            check_writable(os.path.join(directory, name + tmp), "checkpoint file", made=directory)
    held = [n for n in (checkpoint.META_FILE, checkpoint.META_FILE + checkpoint.TMP, *checkpoint.TENSOR_FILES)
            if os.path.lexists(os.path.join(directory, n))]
    if not held or overwrite or (resume and _same_dir(directory, resume)):
        return
    try:
        meta = checkpoint.read_manifest(directory)
        what = f"a checkpoint of {meta['model'].get('name')!r} after epoch {meta['meta'].get('epoch')}"
    except Exception:  # any content at all is protected; the description is a courtesy
        what = f"checkpoint files ({', '.join(held)})"
    raise ConfigError(f"checkpoint directory {directory} already holds {what}; pass --resume {directory} to "
                      f"continue it, --overwrite to replace it, or choose another --checkpoint_dir")


def _same_dir(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_monitored(args, val):
    """The metrics that schedules and callbacks watch are ones the run reports (before an epoch is spent)."""
    from pydtnn.metrics import canonical

    names = {canonical(m) for m in metric_names(args)} | {"accuracy"}
    keys = {"loss", "lr", "time_s", "samples_per_second", *names}
    if val is not None:
        keys |= {f"val_{k}" for k in ("loss", *names)}
    record = dict.fromkeys(keys, 0.0)
    chosen = _chosen(args)
    for who, metric in (("reduce_lr_on_plateau", args.reduce_lr_on_plateau_metric),
                        ("early_stopping", args.early_stopping_metric), ("stop_at_loss", args.stop_at_loss_metric)):
        if who in chosen:
            sch.monitored(record, metric, who)


def agree_on_flags(comm, args):
    """Every rank was started with the same flags (all but paths and what rank 0 alone does); else one
    line names the first flag that differs and the ranks. The first collective of a run: a rank that
    split the communicator for another layout would otherwise wait forever for the others."""
    if comm.size == 1:
        return
    from pydtnn.distributed.consistency import check_agreement as agree

    agree(comm, {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_SAVED + _PER_RANK})


def check_agreement(comm, model, datasets, start_epoch):
    """Every rank runs the same computation: the data (sizes, shapes, a hash of a few samples), the
    model and the epoch to start from agree (the flags did, at the start); else one line names the
    first difference and the ranks, before a collective can hang on it."""
    if comm.size == 1:
        return
    from pydtnn.distributed.consistency import check_agreement as agree, sample_digest

    facts = {}
    for name, ds in zip(("train", "validation", "test"), datasets):
        facts[f"{name} set"] = None if ds is None else sample_digest(ds)
    facts["model"] = f"{model.name}, {model.count_params():,} parameters, state {checkpoint.fingerprint(model)}"
    facts["epoch to start from"] = start_epoch
    agree(comm, facts)


def load_datasets(args, comm=None):
    """(train, validation or None, test or None) as the dataset flags say, not yet augmented.

    With --download and several processes, rank 0 fetches first and the others then find its copy."""
    if args.use_synthetic_data or args.dataset == "synthetic":
        from pydtnn.models.families import variant

        if args.model_file:  # what the file builds is not known before it runs: CIFAR-10's images
            shape, classes = (3, 32, 32), 10
        else:
            shape, classes = models.defaults(variant(args.model, (3, 32, 32)))  # a family: its small-image variant
        train, test = data.load("synthetic", input_shape=shape, num_classes=classes, seed=args.seed)
    else:
        first = comm is None or comm.size == 1 or comm.rank == 0
        if args.download and not first:
            comm.barrier()  # rank 0 has fetched (or failed, and ended the job)
        train, test = data.load(args.dataset, args.dataset_train_path, args.dataset_test_path,
                                download=args.download and first)
        if args.download and first and comm is not None and comm.size > 1:
            comm.barrier()
    train, val = data.resolve_validation(train, test, args.validation_split, args.test_as_validation, args.seed)
    return train, val, test


def augmented(train, args):
    """The training set with the flips and crops the flags ask for."""
    return data.with_augmentation(train, flip=args.flip_images, flip_prob=args.flip_images_prob,
                                  crop=args.crop_images, crop_padding=args.crop_images_padding)


def metric_names(args):
    return tuple(m.strip() for m in args.metrics.split(",") if m.strip())


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


def _chosen(args):
    return [s for s in (args.lr_schedulers or "").split(",") if s]  # None: the family's, set by fill_defaults


def build_schedules(args, world):
    chosen, out = _chosen(args), []
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


def build_callbacks(args, trainer, config, effective=None):
    chosen, out = _chosen(args), []
    if "early_stopping" in chosen:
        out.append(EarlyStopping(args.early_stopping_metric, args.early_stopping_patience))
    if "stop_at_loss" in chosen:
        out.append(StopAtThreshold(args.stop_at_loss_metric, args.stop_at_loss_threshold))
    if args.history_file and trainer.is_root:
        out.append(HistoryCSV(args.history_file, made=args.checkpoint_dir))
    reducer_has_state = trainer.reducer is not None and bool(trainer.reducer.state_dict())
    if ("model_checkpoint" in chosen or args.checkpoint_dir) and (trainer.is_root or trainer.model.sharding
                                                                   or reducer_has_state):
        # rank 0 writes; parameters are identical on every rank, or (model parallelism) gathered from
        # every rank of its group, which all take part
        out.append(ModelCheckpoint(lambda t, epoch: save_checkpoint(args.checkpoint_dir, t, epoch, config, effective),
                                   args.model_checkpoint_save_freq))
    return out


def save_checkpoint(directory, trainer, epoch, config, effective=None):
    """Everything a resumed run needs to continue bit-identically after `epoch` (0-based) ended."""
    meta = {
        "epoch": epoch + 1,
        "config": config,
        "step": trainer.optimizer.t,
        "world_size": trainer.world_size,
        "rng": checkpoint.rng_state(trainer.model.backend.rng),
        "base_lr": trainer.base_lr,
        "schedules": [s.state_dict() for s in trainer.schedules],
        "callbacks": [getattr(c, "state_dict", dict)() for c in trainer.callbacks],
        "history": trainer.history,
    }
    checkpoint.save(directory, trainer.model, trainer.optimizer, meta, write=trainer.is_root,
                    extra=reducer_state(trainer))
    if not trainer.is_root:
        return
    # a readable copy of the configuration, written with the checkpoint (never before a run has one); it
    # is a valid --config file: load_config_file skips the "effective" values computed from the flags
    checkpoint.write_json_atomic(os.path.join(directory, checkpoint.CONFIG_FILE),
                                 {**config, "effective": effective or {}})


def reducer_state(trainer):
    """{"@reducer.<name>": every rank's array, stacked (ranks, ...)} of a reducer with state of its own (topk's
    residuals): a collective over the replicas, so every rank's checkpoint callback calls it."""
    reducer = trainer.reducer
    own = reducer.state_dict() if reducer is not None else {}
    out = {}
    for name, a in sorted(own.items()):
        a = np.ascontiguousarray(trainer.model.backend.to_numpy(a))
        every = np.empty((trainer.comm.size,) + a.shape, a.dtype)
        trainer.comm.allgatherv(a.reshape(-1), every.reshape(-1), [a.size] * trainer.comm.size, "reducer state")
        out[f"{checkpoint.EXTRA}reducer.{name}"] = every
    return out


def check_reducer_state(trainer, extras, where, saved_ranks=None):
    """ConfigError, before anything is restored, where the checkpoint's reducer state (its extras) is not the kind
    this run's reducer keeps (topk saved with momentum correction, residuals and velocities, resumed without it, or
    the reverse); DataError where an array is not what a reducer saves: floating point, one row per saved rank
    (saved_ranks, the meta's world_size), each row of this run's shape."""
    prefix = f"{checkpoint.EXTRA}reducer."
    saved = {k[len(prefix):]: v for k, v in extras.items() if k.startswith(prefix)}
    own = trainer.reducer.state_dict() if trainer.reducer is not None else {}
    if saved and own and set(saved) != set(own):
        how = ("give --momentum_correction true as the saved run did" if "velocity" in saved else
               "the saved run had no --momentum_correction: resume without it")
        raise ConfigError(f"{where}: the checkpoint's topk reducer state is {', '.join(sorted(saved))}, this run's "
                          f"is {', '.join(sorted(own))}; {how}")
    for name, every in saved.items():
        shape = tuple(own[name].shape) if name in own else None
        rows = "any" if saved_ranks is None else saved_ranks
        if (every.dtype not in (np.float32, np.float64) or every.ndim < 1
                or (saved_ranks is not None and every.shape[0] != saved_ranks)
                or (shape is not None and tuple(every.shape[1:]) != shape)):
            raise DataError(f"{where}: reducer state {name} is {every.dtype} of shape {tuple(every.shape)}; expected "
                            f"float32 or float64, {rows} rows (one per saved process) of shape {shape or '(its own)'}")


def restore_reducer(trainer, extras):
    """Give each rank its saved reducer state: its own row at the saved process count; at another count rank 0
    takes the sum of the rows (topk: every gradient not yet sent stays in the run) and the others zeros. A run
    without such a reducer (one process) has nowhere to put it: it says what is dropped."""
    reducer, prefix = trainer.reducer, f"{checkpoint.EXTRA}reducer."
    state = {k[len(prefix):]: v for k, v in extras.items() if k.startswith(prefix)}
    if state and (reducer is None or not reducer.state_dict()) and any(np.any(v) for v in state.values()):
        rows = next(iter(state.values())).shape[0]
        trainer.log(f"pydtnn: note: the checkpoint's reducer state ({', '.join(sorted(state))}: gradients its {rows} "
                    f"processes had not sent yet) is dropped: this run has no reducer to hold it")
    if reducer is None or not state or not reducer.state_dict():
        return
    rank, size = trainer.comm.rank, trainer.comm.size
    mine = {}
    for name, every in state.items():
        if every.shape[0] == size:
            mine[name] = every[rank]
        else:
            mine[name] = every.sum(axis=0) if rank == 0 else np.zeros_like(every[0])
    reducer.load_state_dict(mine)


def resume(directory, trainer, lr=None, scaled=False):
    """Restore a checkpoint into a freshly built trainer; returns the epoch to start from.

    lr: a learning rate given on the command line now, which wins over the saved one. scaled: the
    rate follows the process count (linear scaling), so a resume at another count rescales it.
    """
    restorable = {"schedules": [s.state_dict() for s in trainer.schedules],
                  "callbacks": [getattr(c, "state_dict", dict)() if hasattr(c, "load_state_dict") else None
                                for c in trainer.callbacks]}

    def check(meta, where):  # before anything is restored: a refused checkpoint leaves the trainer as it was
        checkpoint.check_training_meta(meta, where, trainer.model.backend.rng, restorable)
        check_reducer_state(trainer, extras, where, meta.get("world_size"))

    extras = {}
    meta = checkpoint.load(directory, trainer.model, trainer.optimizer, check_meta=check, extras=extras)
    restore_reducer(trainer, extras)
    checkpoint.set_rng_state(trainer.model.backend.rng, meta["rng"])
    base = meta["base_lr"] * (trainer.world_size / meta.get("world_size", 1) if scaled else 1)
    trainer.base_lr = trainer.optimizer.lr = lr if lr is not None else base
    for s, state in zip(trainer.schedules, meta["schedules"]):
        s.load_state_dict(state)
    for c, state in zip(trainer.callbacks, meta["callbacks"]):
        if hasattr(c, "load_state_dict"):
            c.load_state_dict(state)
    trainer.history = list(meta["history"])
    trainer.log(f"pydtnn: resumed {directory} after epoch {meta['epoch']}")
    return meta["epoch"]


def evaluate_only(trainer, test, args):
    """Evaluate on the test set and report inference throughput; writes the final record."""
    if test is None:
        raise ConfigError(f"--evaluate_only needs a test set; dataset {args.dataset} has none")
    t0 = time.perf_counter()
    values = trainer.evaluate_as("test", test, args.batch_size)
    wall = time.perf_counter() - t0
    final = {"final": True, **values, "wall_time_s": wall, "samples_per_second": len(test) / wall,
             **trainer.layout(), "params_sha256": trainer.model.params_sha256()}
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
