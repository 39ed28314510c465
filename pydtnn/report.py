"""What a run says: the values it computes with (saved in config.json as "effective"), the header rank 0
prints, warnings on sizes that defeat the settings, the compile notice, and --list_models."""

from pydtnn import models, optim
from pydtnn.backends import CPUBackend
from pydtnn.optim import schedules as sch
from pydtnn.preflight import chosen_schedulers


def effective_values(args, choice, options, plan, schedules):
    """What the run computes with, after defaults, family resolution, scaling and warm-up: saved in
    config.json under "effective" and summarized in the header. plan: the run's RunPlan (its layout and
    reduction); options: the optimizer's keyword arguments; schedules: the schedule objects."""
    world, mp_size, strategy = plan.layout.replicas, plan.layout.model_parallel_size, plan.reduction.name
    parallel = plan.layout.parallel
    out = {"model": choice.name, "input_shape": list(choice.input_shape), "num_classes": choice.num_classes,
           "adapted": list(choice.notes), "processes": plan.layout.world_size, "parallel": parallel,
           "model_parallel_size": mp_size, "pipeline_stages": plan.layout.pipeline_stages, "replicas": world,
           "reduction": strategy, "batch_size_per_process": args.batch_size,
           "global_batch_size": args.batch_size * world, "num_epochs": args.num_epochs,
           "lr_schedulers": chosen_schedulers(args),
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
           f"{len(test) if test else 0:,} test; {samples_text(train, data_shape)}")
    per_stage = ("one per process" if eff["model_parallel_size"] == 1 else
                 f"each split over {eff['model_parallel_size']} processes by output channels")
    if eff.get("pipeline_stages", 1) > 1 and eff["replicas"] > 1:
        yield (f"pydtnn: {eff['processes']} processes, hybrid parallel: {eff['replicas']} replicas of a pipeline of "
               f"{eff['pipeline_stages']} stages, {per_stage}; {eff['reduction']} gradient reduction, batch "
               f"{args.batch_size} per replica ({eff['global_batch_size']} global) in {args.accumulation_steps} "
               f"micro-batches")
    elif eff.get("pipeline_stages", 1) > 1 and eff["model_parallel_size"] > 1:
        yield (f"pydtnn: {eff['processes']} processes, hybrid parallel: the layers cut into {eff['pipeline_stages']} "
               f"stages, {per_stage}; batch {args.batch_size} in {args.accumulation_steps} micro-batches")
    elif eff.get("pipeline_stages", 1) > 1:
        yield (f"pydtnn: {eff['processes']} processes, pipeline parallel: the layers cut into {eff['pipeline_stages']} "
               f"stages, one per process; batch {args.batch_size} in {args.accumulation_steps} micro-batches")
    elif eff["model_parallel_size"] > 1:
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
            f"momentum {eff['topk_momentum']:g} in the {eff.get('reduction')} reducer (momentum correction)"]
    if eff.get("reduction") == "topk" and args.topk_selection == "per_layer":
        extras.append("topk selection per layer")
    if eff.get("reduction") in ("topk", "oktopk") and args.density_warmup_epochs and args.density < 0.25:
        extras.append(f"{eff['reduction']} density from 0.25 to {args.density:g} over {_count(args.density_warmup_epochs, 'epoch')}")
    schedules = ",".join(chosen_schedulers(args)) or "none"
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
              "token families take text; see docs/models.md:"]
    for family, v in sorted(FAMILIES.items()):
        picks = " / ".join(n for n in (v["cifar10"], v["imagenet"], v.get("text")) if n)
        lines.append(f"  {family:<12} {picks}")
    return "\n".join(lines)


def samples_text(train, data_shape):
    """What a dataset's samples are, for the header: images and classes, or token windows and vocabulary."""
    tokenizer = getattr(train, "tokenizer", None)
    if tokenizer is not None:
        kind = "characters" if tokenizer.kind == "chars" else "bytes"
        return f"windows of {data_shape[0]} tokens, a vocabulary of {train.num_classes} {kind}"
    return f"{'x'.join(map(str, data_shape))} images, {train.num_classes} classes"


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


def conv_shapes(model):
    """(geometry, output channels) of every convolution of `model` as it now stands."""
    from pydtnn.layers.conv import Conv2D

    return [(layer.geometry, layer.params["weight"].shape[0]) for _, layer in model.layers()
            if isinstance(layer, Conv2D)]
