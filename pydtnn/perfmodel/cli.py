"""`pydtnn-perfmodel`: the performance model from the command line, one subcommand per question.

  collective  seconds of one collective operation (allreduce, allgather, ...) by algorithm
  predict     predicted time of one training step, per layer and split into compute, memory and communication
  calibrate   measure this machine (kernel rates, bandwidths, one network level) into a machine file
  sweep       throughput and exposed communication along five axes (batch, rate, bandwidth, link, nodes)
  plan        every layout a model can run in on P processes, ranked by predicted step (plain data parallelism
              first unless beaten by 5%), what does not fit dropped
  profile     time every distinct layer of some models on this machine into a layer profile (measured layer times)

Each subcommand is an add_<name>(subparsers) that declares its flags and a run_<name>(args) that
returns the exit code. Exit codes: 0 success, 2 user error (one line `pydtnn-perfmodel: error: ...`).
"""

import argparse
import json
import math
import sys

from pydtnn.errors import command_status

PROG = "pydtnn-perfmodel"


def byte_count(text):
    """argparse type: a number of bytes, as an integer or in exponent form (8000000, 8e6)."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        value = int(value) if math.isfinite(value) and value.is_integer() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes >= 0 (8000000 or 8e6), got {text!r}")
    return value


def add_data_flags(p):
    """--dataset, --input_shape and --num_classes: the data a model is built for, as pydtnn-train builds it."""
    from pydtnn.argtypes import positive_int, sample_shape
    from pydtnn.data import NAMES

    p.add_argument("--dataset", choices=NAMES,
                   help="build the model for this dataset's images and classes as pydtnn-train would (a family "
                        "name such as vgg16 takes the variant for them; nothing is read or downloaded)")
    p.add_argument("--input_shape", type=sample_shape,
                   help="C,H,W of the samples (default: --dataset's, else the model's own; a family name: its "
                        "ImageNet variant)")
    p.add_argument("--num_classes", type=positive_int, help="classes of the last layer (default: --dataset's, else "
                                                            "the model's own)")


def data_from(args, name):
    """simulate.Data that --dataset, --input_shape and --num_classes describe for model `name`, or None where
    neither --dataset nor --input_shape is given (the model as designed)."""
    from pydtnn import models
    from pydtnn.perfmodel.simulate import Data, dataset_data, pick

    if args.dataset is None and args.input_shape is None:
        return None
    named = dataset_data(args.dataset) if args.dataset is not None else None
    shape = args.input_shape or named.shape
    # classes: the flag's, else the dataset's, else those of the variant these images take
    classes = args.num_classes or (named.classes if named else models.defaults(pick(name, shape))[1])
    source = [named.source] if named else []
    if args.input_shape is not None:
        source.append(f"--input_shape {','.join(map(str, shape))}")
    if args.num_classes is not None:
        source.append(f"--num_classes {classes}")
    return Data(shape, classes, " ".join(source))


def say(line):
    """A note about what the command modelled, on stderr (stdout stays the table or the JSON)."""
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def machine_from(args):
    """The Machine named by --machine, or the built-in default."""
    from pydtnn.perfmodel import machine

    return machine.DEFAULT if args.machine is None else machine.load(args.machine)


def add_collective(subparsers):
    from pydtnn.argtypes import positive_int
    from pydtnn.perfmodel.collectives import ALGORITHMS, OPS
    from pydtnn.perfmodel.machine import LEVELS

    p = subparsers.add_parser("collective", allow_abbrev=False, help="seconds of one collective operation",
                              description="Seconds of one collective operation under the alpha-beta-gamma model.")
    p.add_argument("--op", required=True, choices=OPS, help="the operation")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS, help="the algorithm that runs it")
    p.add_argument("--bytes", required=True, type=byte_count, dest="nbytes",
                   help="bytes of the whole vector (allgather: the gathered result)")
    p.add_argument("--np", required=True, type=positive_int, help="number of processes")
    p.add_argument("--machine", help="machine description, YAML or JSON (default: built-in 2-core VM values)")
    p.add_argument("--level", choices=LEVELS,
                   help="link of a flat algorithm (default: intra if --np fits on one node, else inter)")
    p.add_argument("--inner", default="ring", help="inter-node algorithm of --algorithm hierarchical (default ring)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    p.set_defaults(run=run_collective)


def run_collective(args):
    from pydtnn.perfmodel.collectives import HIERARCHICAL, default_level, seconds

    machine = machine_from(args)
    cost = seconds(args.op, args.algorithm, args.nbytes, args.np, machine, level=args.level, inner=args.inner)
    if args.json:
        print(json.dumps({"seconds": cost, "op": args.op, "algorithm": args.algorithm, "bytes": args.nbytes,
                          "np": args.np}))
    else:
        if args.algorithm == HIERARCHICAL:
            how = f"inner {args.inner}, {machine.processes_per_node} per node"
        else:
            how = f"{args.level or default_level(args.np, machine)} link"
        print(f"{args.op} {args.algorithm}: {args.nbytes:,} bytes over {args.np} processes ({how}) on "
              f"{machine.name}: {cost * 1e3:.6g} ms")
    return 0


def add_predict(subparsers):
    p = subparsers.add_parser("predict", allow_abbrev=False, help="predicted time of one training step",
                              description="Predicted time of one training step, per layer and in total (with "
                                          "--json, the per-process memory too).")
    add_step_flags(p)
    p.set_defaults(run=run_predict)


def add_memory(subparsers):
    p = subparsers.add_parser("memory", allow_abbrev=False, help="predicted memory of one process at a step's peak",
                              description="Predicted bytes one process holds at a training step's peak: "
                                          "parameters, gradients, optimizer state, activations kept for backward, "
                                          "workspace, buffers (docs/perfmodel.md).")
    add_step_flags(p)
    p.set_defaults(run=run_memory)


def add_step_flags(p):
    """The flags of a training step's layout, model and data, which predict and memory share."""
    from pydtnn.argtypes import positive_int, share
    from pydtnn.distributed.pipeline import SCHEDULES
    from pydtnn.perfmodel.collectives import algorithms
    from pydtnn.perfmodel.predict import PARALLEL, PROGRESS, REDUCTIONS, UPDATE_PASSES
    from pydtnn.recompute import MODES

    p.add_argument("--model", required=True, help="a model of the zoo (pydtnn-train --list_models)")
    p.add_argument("--batch_size", required=True, type=positive_int,
                   help="samples per model replica and step (per process with data parallelism)")
    p.add_argument("--np", type=positive_int, default=1, help="number of processes (default 1)")
    p.add_argument("--threads", type=positive_int, default=1, help="threads per process (default 1)")
    p.add_argument("--parallel", choices=PARALLEL, default="data",
                   help="data (default), model (every layer split over the --np processes), pipeline (--np stages) "
                        "or hybrid (groups of --model_parallel_size, or pipelines of --pipeline_stages; "
                        "docs/parallelism.md)")
    p.add_argument("--model_parallel_size", type=positive_int, help="--parallel hybrid: processes per model replica")
    p.add_argument("--pipeline_stages", type=positive_int,
                   help="--parallel pipeline (default --np) or hybrid: stages per pipeline, one process each")
    p.add_argument("--pipeline_schedule", choices=SCHEDULES, default="1f1b", help="a pipeline's schedule (default 1f1b)")
    p.add_argument("--stage_boundaries", default=None,
                   help="comma-separated layer paths where stages 2.. begin (default: balanced predicted time)")
    p.add_argument("--micro_batches", type=positive_int, default=1,
                   help="micro-batches per step, their gradients summed and reduced once (default 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO's stage over the model replicas: 1 shards the optimizer state, 2 the reduced "
                        "gradients too, 3 the parameters too (default 0: none)")
    p.add_argument("--recompute", choices=MODES, default="none",
                   help="activation recomputation: none (default), segments or all")
    p.add_argument("--density", type=share, default=0.01,
                   help="--reduction topk, oktopk: the share of gradient entries selected, in (0, 1] (default 0.01)")
    p.add_argument("--rank", type=positive_int, default=4,
                   help="--reduction powersgd: the rank of each gradient matrix's approximation (default 4)")
    p.add_argument("--local_sgd", type=positive_int, default=4,
                   help="--reduction local_sgd: the steps between the replicas' averages (default 4)")
    p.add_argument("--reduction", choices=REDUCTIONS, default="bucketed", help="gradient reduction (default bucketed)")
    p.add_argument("--algorithm", default="ring", choices=("best",) + algorithms("allreduce"),
                   help="allreduce algorithm (default ring; best: the cheapest)")
    p.add_argument("--progress", choices=PROGRESS, default="test",
                   help="when a started collective progresses: test (the default: only inside MPI calls) or thread "
                        "(all the time: the reducers' progress thread, or a library that progresses on its own)")
    p.add_argument("--optimizer", choices=tuple(UPDATE_PASSES), default=None,
                   help="the update's passes over the parameters (default: adam for a model whose family trains "
                        "with an Adam-family optimizer, as ViT does, else sgd_momentum)")
    add_data_flags(p)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--machine", help="machine description, YAML or JSON (default: built-in 2-core VM values)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run_predict(args):
    from pydtnn.perfmodel.predict import STATE_ARRAYS, UPDATE_PASSES, predict_plan
    from pydtnn.perfmodel.table import table

    machine, plan, name, model = _step_plan(args)
    p = predict_plan(model, plan, machine, update_passes=UPDATE_PASSES[update_class(args)], algorithm=args.algorithm,
                     name=name, recompute=args.recompute, schedule=args.pipeline_schedule,
                     state_arrays=STATE_ARRAYS[update_class(args)],
                     stage_starts=args.stage_boundaries.split(",") if args.stage_boundaries else None)
    if args.json:
        print(json.dumps({**p.to_dict(), "memory": _memory(args, plan, model, machine).to_dict()}))
    else:
        print(table(p))
    return 0


def run_memory(args):
    from pydtnn.perfmodel.memory import memory_table

    machine, plan, name, model = _step_plan(args)
    memory = _memory(args, plan, model, machine)
    print(json.dumps({"model": name, **memory.to_dict()}) if args.json else memory_table(memory, name))
    return 0


def _step_plan(args):
    """(machine, RunPlan, model name, built model) of predict's and memory's flags."""
    from pydtnn.perfmodel.simulate import build_model
    from pydtnn.plan import Reduction, RunPlan, layout

    machine = machine_from(args)
    stages = args.np if args.parallel == "pipeline" and args.pipeline_stages is None else args.pipeline_stages
    lay = layout(args.parallel, args.np, args.model_parallel_size, pipeline_stages=stages)
    plan = RunPlan(lay, args.batch_size, None,
                   Reduction(args.reduction, "none", args.progress,
                             {"density": args.density, "rank": args.rank, "every": args.local_sgd}),
                   accumulation_steps=args.micro_batches, threads=args.threads, dtype=args.dtype, zero=args.zero)
    name, model = build_model(args.model, data_from(args, args.model), args.num_classes, args.dtype, say)
    return machine, plan, name, model


def update_class(args):
    """--optimizer of predict and memory, or where not given the model family's (models/families.py) as its update
    class: "adam" for the Adam family, else "sgd_momentum" (pydtnn-train's SGD default)."""
    from pydtnn.models.families import default_optimizer

    if args.optimizer is not None:
        return args.optimizer
    return "adam" if default_optimizer(args.model) in ("adam", "adamw", "nadam") else "sgd_momentum"


def _memory(args, plan, model, machine):
    """The plan's memory.Memory."""
    from pydtnn.perfmodel.memory import OPTIMIZERS, plan_memory

    return plan_memory(model, plan, OPTIMIZERS[update_class(args)], args.recompute, args.pipeline_schedule,
                       args.stage_boundaries.split(",") if args.stage_boundaries else None, machine)


def thread_list(text):
    """argparse type: a comma list of thread counts that includes 1 ("1,2")."""
    try:
        values = count_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a comma list of thread counts >= 1 (1,2), got {text!r}") from None
    if values[0] != 1:
        raise argparse.ArgumentTypeError(f"expected 1 among the thread counts (rates are per thread), got {text!r}")
    return values


def add_calibrate(subparsers):
    from pydtnn.argtypes import positive_float, positive_int
    from pydtnn.perfmodel.machine import LEVELS

    p = subparsers.add_parser("calibrate", allow_abbrev=False, help="measure this machine into a machine file",
                              description="Measure kernel rates, thread scaling, memory bandwidth, reduction "
                                          "rate and one network level here (under 3 minutes) and write a "
                                          "machine file (pydtnn/perfmodel/calibrate.py says how).")
    p.add_argument("--out", required=True, help="machine file to write, YAML (JSON when it ends in .json)")
    p.add_argument("--quick", action="store_true", help="one layer per kernel class, fewer repeats and sizes")
    p.add_argument("--threads", type=thread_list, default=[1, 2], help="thread counts to time (default 1,2)")
    p.add_argument("--np", type=positive_int, default=2, help="MPI processes of the probe (default 2, at least 2)")
    p.add_argument("--level", choices=LEVELS, default="intra",
                   help="network level the probe measures (default intra; inter: run under benchmarks/netem.py)")
    p.add_argument("--base", help="machine file whose unmeasured fields are kept (default: built-in values)")
    p.add_argument("--name", help="machine name (default: the CPU model and core count)")
    p.add_argument("--no_mpi", "--no-mpi", action="store_true", help="skip the MPI probe, keep the base's links")
    p.add_argument("--mpi_timeout", "--mpi-timeout", type=positive_float, default=120.0,
                   help="seconds the MPI probe may take (default 120)")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args):
    from pydtnn.errors import ConfigError
    from pydtnn.files import check_distinct, check_writable
    from pydtnn.perfmodel import calibrate, machine

    check_writable(args.out, "machine file")  # before anything is measured: a bad path costs nothing
    check_distinct([("machine file", args.out)], inputs=[("base machine file", args.base)])
    if args.np < 2 and not args.no_mpi:
        raise ConfigError(f"--np {args.np}: the ping-pong needs at least 2 processes")
    base = machine.DEFAULT if args.base is None else machine.load(args.base)
    missing = None if args.no_mpi else calibrate.mpi_missing()
    if missing:
        raise ConfigError(f"cannot measure the {args.level} link: {missing}; pass --no_mpi to keep the base's links")

    def progress(line):
        print(f"calibrate: {line}", file=sys.stderr, flush=True)

    m, report = calibrate.calibrate(threads=args.threads, np_=args.np, level=args.level, base=base, name=args.name,
                                    quick=args.quick, mpi=not args.no_mpi, mpi_timeout=args.mpi_timeout,
                                    progress=progress)
    machine.save(m, args.out)
    print("\n".join(calibrate.summary(m, report, args.base or "the built-in defaults")))
    print(f"wrote {args.out}")
    return 0


def name_list(text):
    """argparse type: a comma list of names ("vgg16_imagenet,resnet50_imagenet")."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of names, got {text!r}")
    return names


def add_sweep(subparsers):
    from pydtnn.argtypes import positive_int, share
    from pydtnn.perfmodel.collectives import algorithms
    from pydtnn.perfmodel.predict import PROGRESS, REDUCTIONS
    from pydtnn.perfmodel.sweep import AXES
    from pydtnn.recompute import MODES

    p = subparsers.add_parser("sweep", allow_abbrev=False, help="throughput along the five axes, as PNGs",
                              description="Predicted training throughput and exposed communication along batch size, "
                                          "node arithmetic rate, node memory bandwidth, link bandwidth and number "
                                          "of nodes, one axis at a time around a baseline: one PNG per model "
                                          "(pydtnn/perfmodel/sweep.py says what each axis varies).")
    p.add_argument("--model", type=name_list, default=["vgg16_imagenet", "resnet50_imagenet"],
                   help="comma list of zoo models (default vgg16_imagenet,resnet50_imagenet)")
    p.add_argument("--machine", help="machine description, YAML or JSON (default: built-in 2-core VM values)")
    p.add_argument("--out_dir", default=".", help="existing folder of the PNGs, perfmodel_<model>.png (default: the "
                                                  "current folder)")
    p.add_argument("--overwrite", action="store_true", help="replace PNGs and the --json file that already exist")
    p.add_argument("--axes", type=name_list, default=list(AXES), help=f"comma list of axes (default {','.join(AXES)})")
    p.add_argument("--nodes", type=positive_int, default=64, help="baseline number of nodes (default 64)")
    p.add_argument("--batch_size", type=positive_int, default=32, help="baseline samples per process (default 32)")
    p.add_argument("--points", type=positive_int, help="at most this many values per axis (default: the whole grid)")
    p.add_argument("--reduction", choices=REDUCTIONS, default="bucketed", help="gradient reduction (default bucketed)")
    p.add_argument("--algorithm", default="ring", choices=("best",) + algorithms("allreduce"),
                   help="allreduce algorithm (default ring; best: the cheapest)")
    p.add_argument("--progress", choices=PROGRESS, default="test",
                   help="when a started collective progresses: test (the default: only inside MPI calls) or thread "
                        "(all the time: the reducers' progress thread, or a library that progresses on its own)")
    p.add_argument("--density", type=share, default=0.01,
                   help="--reduction topk, oktopk: the share of gradient entries selected, in (0, 1] (default 0.01)")
    p.add_argument("--rank", type=positive_int, default=4,
                   help="--reduction powersgd: the rank of each gradient matrix's approximation (default 4)")
    p.add_argument("--local_sgd", type=positive_int, default=4,
                   help="--reduction local_sgd: the steps between the replicas' averages (default 4)")
    p.add_argument("--micro_batches", type=positive_int, default=1,
                   help="micro-batches per step of the data, model and hybrid schemes (default 1)")
    p.add_argument("--pipeline_micro_batches", type=positive_int, default=8,
                   help="micro-batches per step of the pipeline scheme (default 8)")
    p.add_argument("--recompute", choices=MODES, default="none", help="activation recomputation in every scheme")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO's stage over the model replicas of every scheme: 1 shards the optimizer state, 2 the "
                        "reduced gradients too, 3 the parameters too (default 0: none)")
    add_data_flags(p)
    p.add_argument("--json", help="file to write every point to, as JSON")
    p.set_defaults(run=run_sweep)


def sweep_figures(args):
    """The PNG each model of --model goes to, <out_dir>/perfmodel_<variant>.png: named by the model it shows
    (two names of one model cannot overwrite each other). With the --json file, every output is checked
    here before any work: each writable, none an input or another output, none already there unless
    --overwrite."""
    import os

    from pydtnn.errors import ConfigError
    from pydtnn.files import check_distinct, check_writable
    from pydtnn.perfmodel.simulate import pick

    figures = []
    for name in args.model:
        data = data_from(args, name)
        figures.append(os.path.join(args.out_dir, f"perfmodel_{pick(name, data and data.shape)}.png"))
    outputs = [(f"figure of {name}", path) for name, path in zip(args.model, figures)]
    outputs += [("--json file", args.json)] if args.json is not None else []
    for what, path in outputs:
        check_writable(path, what)
    check_distinct(outputs, inputs=[("machine file", args.machine)])
    for what, path in outputs:
        if not args.overwrite and os.path.lexists(path):
            raise ConfigError(f"{what} {path} already exists; pass --overwrite to replace it, or give another "
                              f"{'--json file' if path == args.json else '--out_dir'}")
    return figures


def run_sweep(args):
    import dataclasses

    from tqdm import tqdm

    from pydtnn.distributed.zero import check_stage
    from pydtnn.files import write_atomic
    from pydtnn.perfmodel import sweep
    from pydtnn.perfmodel.machine import to_dict
    from pydtnn.perfmodel.simulate import build_model

    axes = sweep.check_axes(args.axes)
    check_stage(args.zero, args.reduction, progress=args.progress)  # before any work: one line
    figures = sweep_figures(args)
    machine = machine_from(args)
    baseline = sweep.Baseline(nodes=args.nodes, batch_size=args.batch_size)
    options = {"reduction": args.reduction, "algorithm": args.algorithm, "progress": args.progress}
    total = len(args.model) * sweep.count(machine, baseline, axes, args.points)
    points = []
    with tqdm(total=total, unit="point", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False) as bar:
        for given, figure in zip(args.model, figures):
            bar.set_description(given)
            # built once per model, then dropped: ImageNet models are large
            name, model = build_model(given, data_from(args, given), args.num_classes,
                                      say=lambda line: bar.write(f"{PROG}: {line}", file=sys.stderr))
            mine = sweep.sweep(model, name, machine, baseline, axes, points=args.points, on_point=bar.update,
                               density=args.density, rank=args.rank, every=args.local_sgd,
                               micro_batches=args.micro_batches, recompute=args.recompute,
                               pipeline_micro_batches=args.pipeline_micro_batches, zero=args.zero, **options)
            del model
            bar.write(f"wrote {sweep.plot(mine, figure, machine, baseline, **options)}", file=sys.stdout)
            points += mine
    print("\n".join(sweep.summary(points)))
    if args.json:
        data = {"machine": to_dict(machine), "baseline": dataclasses.asdict(baseline), "schemes": list(sweep.SCHEMES),
                **options, "density": args.density, "micro_batches": args.micro_batches,
                "pipeline_micro_batches": args.pipeline_micro_batches, "recompute": args.recompute, "zero": args.zero,
                "points": [p.to_dict() for p in points]}
        write_atomic(args.json, (json.dumps(data, indent=1) + "\n").encode("utf-8"))
        print(f"wrote {args.json}")
    return 0


def add_plan(subparsers):
    from pydtnn.argtypes import positive_float, positive_int
    from pydtnn.optim import NAMES

    p = subparsers.add_parser("plan", allow_abbrev=False, help="the layouts of a model on P processes, ranked",
                              description="Every layout pydtnn-train can run --model in on --np processes (data "
                                          "parallelism with each lossless reducer and ZeRO stage, model, hybrid, "
                                          "pipelines, recomputation where memory asks for it), predicted, what "
                                          "does not fit in --memory_per_process dropped, the rest ranked by step "
                                          "time (pydtnn/perfmodel/planner.py).")
    p.add_argument("--model", required=True, help="a model of the zoo (pydtnn-train --list_models)")
    p.add_argument("--np", required=True, type=positive_int, help="number of processes")
    p.add_argument("--machine", help="machine description, YAML or JSON (default: built-in 2-core VM values)")
    p.add_argument("--global_batch_size", type=positive_int,
                   help="samples per step over the job, divided over each layout's replicas (default: the model's "
                        "recipe batch x --np)")
    p.add_argument("--memory_per_process", type=positive_float,
                   help="GB (10^9 bytes) a process may hold for training, beside the interpreter and libraries "
                        "(default: no limit)")
    p.add_argument("--ranks_per_node", type=positive_int, help="processes per node: adds the hierarchical reducer")
    p.add_argument("--optimizer", choices=NAMES, default=None,
                   help="the optimizer (default: the model family's, as pydtnn-train: adamw for ViT, else sgd with "
                        "momentum)")
    p.add_argument("--lossy", action="store_true",
                   help="also weigh the data-parallel reductions that change the algorithm: fp16 on the wire, topk "
                        "and oktopk at density 0.01, powersgd at rank 4, local SGD every 4 steps, one step stale "
                        "(each marked lossy; docs/benchmarks.md has their accuracy)")
    p.add_argument("--top", type=positive_int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print every layout, and the refused ones, as one JSON object")
    p.set_defaults(run=run_plan)


def run_plan(args):
    from tqdm import tqdm

    from pydtnn.models.families import default_optimizer
    from pydtnn.perfmodel import planner

    machine = machine_from(args)
    optimizer = args.optimizer or default_optimizer(args.model)
    limit = None if args.memory_per_process is None else args.memory_per_process * 1e9
    layouts = planner.candidates(args.np, args.ranks_per_node, args.lossy)  # a bad --ranks_per_node: one line, first
    with tqdm(total=len(layouts), unit="layout", file=sys.stderr, disable=not sys.stderr.isatty(),
              leave=False) as bar:
        choices, refused, common = planner.plan(args.model, args.np, machine, args.global_batch_size, limit, optimizer,
                                        args.ranks_per_node, on_layout=bar.update, lossy=args.lossy)
    planner.check_fits(choices, refused, limit, args.model, args.np)
    fitting = [c for c in choices if c.fits]
    if args.json:
        print(json.dumps({"model": args.model, "np": args.np, "machine": machine.name,
                          "global_batch_size": int(common[common.index("--global_batch_size") + 1]),
                          "memory_per_process_bytes": limit,
                          "optimizer": optimizer, "common_flags": list(common),
                          "layouts": [c.to_dict(common) for c in choices],
                          "refused": [{"flags": list(f), "reason": r} for f, r in refused]}))
        return 0
    say(f"{len(choices)} layouts predicted, {len(choices) - len(fitting)} of them over the memory limit, "
        f"{len(refused)} refused; machine {machine.name}; each run takes {' '.join(common)} and its flags")
    print(planner.table(fitting, args.top))
    if fitting[0].flags == planner.DEFAULT and any(c.step_s < fitting[0].step_s for c in fitting[1:]):
        say(f"--parallel data is kept first: no layout is predicted faster than it by more than "
            f"{100 * planner.MARGIN:g}%")
    return 0


def count_list(text):
    """argparse type: a comma list of positive integers ("16,32,64"), sorted, each once."""
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers (16,32,64), got {text!r}")
    return values


def add_profile(subparsers):
    from pydtnn.argtypes import non_negative_int, positive_int

    p = subparsers.add_parser("profile", allow_abbrev=False, help="measured layer times of models, for predict",
                              description="Time every distinct layer of each --model on this machine, forward and "
                                          "backward on one process, at each batch size and thread count, into a "
                                          "layer profile (JSON). A machine file's `layer_profile: FILE` makes the "
                                          "model take these times in place of its roofline "
                                          "(pydtnn/perfmodel/layer_profile.py).")
    p.add_argument("--model", required=True, type=name_list, help="models of the zoo, comma separated")
    p.add_argument("--out", required=True, help="the layer profile to write (JSON)")
    p.add_argument("--batch_sizes", type=count_list, default=[4, 8, 16, 32, 64, 128],
                   help="samples per step timed (default 4,8,16,32,64,128)")
    p.add_argument("--threads", type=count_list, default=[1], help="thread counts timed (default 1)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per batch size (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--merge", action="store_true",
                   help="keep what --out holds, the layers measured again replaced")
    p.set_defaults(run=run_profile)


def run_profile(args):
    import os

    from pydtnn.errors import ConfigError
    from pydtnn.files import check_writable
    from pydtnn.perfmodel import layer_profile, layer_timing
    from pydtnn.perfmodel.calibrate import cpu_model
    from pydtnn.perfmodel.simulate import build_model

    check_writable(args.out, "layer profile")  # before anything is measured: a bad path costs nothing
    for name in args.model:
        build_model(name)  # an unknown name is one line before anything is measured
    into = layer_profile.load(args.out) if args.merge and os.path.exists(args.out) else None
    if into is not None and into.about.get("cpu", cpu_model()) != cpu_model():
        raise ConfigError(f"--merge: {args.out} was measured on {into.about['cpu']!r}; expected this machine's CPU "
                          f"{cpu_model()!r} (write another file)")
    profile = layer_timing.measure(args.model, args.batch_sizes, args.threads, args.steps, args.warmup,
                                    progress=lambda line: print(f"profile: {line}", file=sys.stderr, flush=True),
                                    into=into)
    layer_profile.save(profile, args.out)
    say(f"wrote {args.out}: {len(profile)} distinct layers of {', '.join(profile.about['models'])}")
    return 0


def build_parser():
    from pydtnn.argtypes import Parser

    parser = Parser(prog=PROG, allow_abbrev=False,
                    description="The pydtnn performance model: predicted costs of collectives and training steps.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_collective(subparsers)
    add_predict(subparsers)
    add_memory(subparsers)
    add_calibrate(subparsers)
    add_sweep(subparsers)
    add_plan(subparsers)
    add_profile(subparsers)
    return parser


def main(argv=None):
    """`pydtnn-perfmodel`: the subcommand's exit code; 2 and one line on a user error."""
    def body():
        args = build_parser().parse_args(argv)
        return args.run(args)

    return command_status(body, PROG)


if __name__ == "__main__":
    sys.exit(main())
