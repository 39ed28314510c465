"""`pydtnn-train --simulate`: the performance model's prediction of the run the other flags describe,
printed instead of training (no data is read, no MPI is started).

    pydtnn-train --simulate --machine vm.yaml --np 64 --model vgg16_imagenet --batch_size 32

A registered zoo name (vgg16_imagenet) is modelled at its own input shape; a family name (vgg16) at
the shape of --dataset, as a real run would resolve it (docs/models.md). The batch per model replica
(per process with data parallelism; --parallel model|hybrid --model_parallel_size as in training) is
--batch_size, else --global_batch_size over the replicas, else the model's recipe; threads per process are
--threads_per_process; the reduction is --reduction (per_layer with --non_blocking_mpi, else bucketed)
with --bucket_size_mb.
"""

from pydtnn.errors import ConfigError

# (C, H, W) and classes of the named datasets, for family names (no file is read)
DATASET_SHAPES = {"mnist5k": ((1, 28, 28), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
                  "cifar10": ((3, 32, 32), 10), "cifar100": ((3, 32, 32), 100), "imagenet": ((3, 224, 224), 1000)}


def build(args):
    """(model name as modelled, built model) for the run's flags."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.models.families import resolve

    backend = lambda: CPUBackend(args.dtype)  # noqa: E731
    if args.model in models.names():
        return args.model, models.create(args.model, backend=backend())
    if args.dataset not in DATASET_SHAPES:
        raise ConfigError(f"--simulate with the family name {args.model!r} needs the images' shape: --dataset "
                          f"{args.dataset!r} has none fixed; expected one of {', '.join(DATASET_SHAPES)}, or a "
                          f"registered model name (--list_models)")
    shape, classes = DATASET_SHAPES[args.dataset]
    choice, model = resolve(args.model, shape, classes,
                            build=lambda n, s: models.create(n, input_shape=s, num_classes=classes, backend=backend()))
    return choice.name, model


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
    from pydtnn.perfmodel.predict import predict, table

    machine = machines.DEFAULT if args.machine is None else machines.load(args.machine)
    name, model = build(args)
    reduction = args.reduction or ("per_layer" if args.non_blocking_mpi else "bucketed")
    optimizer = {"sgd": "sgd_momentum", "adam": "adam", "adamw": "adam", "nadam": "adam"}.get(args.optimizer, "sgd")
    p = predict(model, batch_size(args, name), args.np, machine, reduction=reduction,
                threads=args.threads_per_process or 1, bucket_mb=args.bucket_size_mb, optimizer=optimizer,
                parallel=args.parallel if args.parallel not in (None, "sequential") else "data", name=name,
                model_parallel_size=args.model_parallel_size, density=args.density)
    say(table(p))
    say(f"pydtnn: simulated, nothing trained: {p.step_s * 1e3:.1f} ms a step, "
        f"{p.batch_size * (p.np // p.model_parallel_size) / p.step_s:,.0f} samples/s over {p.np} process(es)")
    return p
