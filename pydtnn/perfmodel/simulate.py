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

import sys
from dataclasses import dataclass

from pydtnn.data.datasets import SHAPES as DATASET_SHAPES
from pydtnn.errors import ConfigError


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
    if args.model in models.names():
        return build_model(args.model, dtype=args.dtype)
    if args.dataset not in DATASET_SHAPES:
        raise ConfigError(f"--simulate with the family name {args.model!r} needs the images' shape: --dataset "
                          f"{args.dataset!r} has none fixed; expected one of {', '.join(DATASET_SHAPES)}, or a "
                          f"registered model name (--list_models)")
    return build_model(args.model, dataset_data(args.dataset), dtype=args.dtype,
                       say=lambda line: print(f"pydtnn: {line}", file=sys.stderr, flush=True))


def replicas(args):
    """Model replicas of the run: the processes, or the model-parallel groups (checked as the trainer checks)."""
    from pydtnn.perfmodel.split import group_size

    if args.parallel not in ("model", "hybrid"):
        return args.np
    return args.np // group_size(args.parallel, args.np, args.model_parallel_size)


def batch_size(args, name):
    """Samples per replica and step: --batch_size, else --global_batch_size over the replicas, else the recipe's."""
    from pydtnn.models.families import recipe

    if args.batch_size:
        return args.batch_size
    if args.global_batch_size:
        n = replicas(args)
        if args.global_batch_size % n:
            raise ConfigError(f"--global_batch_size {args.global_batch_size} does not divide by the {n} model "
                              f"replicas of --np {args.np}; expected a multiple of {n}")
        return args.global_batch_size // n
    return recipe(name, args.optimizer)["batch_size"]


def simulate(args, say=print):
    """Print the prediction of the run `args` describes; returns the Prediction."""
    from pydtnn.perfmodel import machine as machines
    from pydtnn.perfmodel.predict import duration, predict, rate, table

    machine = machines.DEFAULT if args.machine is None else machines.load(args.machine)
    name, model = build(args)
    reduction = args.reduction or ("per_layer" if args.non_blocking_mpi else "bucketed")
    optimizer = {"sgd": "sgd_momentum", "adam": "adam", "adamw": "adam", "nadam": "adam"}.get(args.optimizer, "sgd")
    p = predict(model, batch_size(args, name), args.np, machine, reduction=reduction,
                threads=args.threads_per_process or 1, bucket_mb=args.bucket_size_mb, optimizer=optimizer,
                parallel=args.parallel if args.parallel not in (None, "sequential") else "data", name=name,
                model_parallel_size=args.model_parallel_size, density=args.density)
    say(table(p))
    say(f"pydtnn: simulated, nothing trained: {duration(p.step_s)} a step, {rate(p.samples_per_second)} samples/s "
        f"over {p.np} process(es)")
    return p
