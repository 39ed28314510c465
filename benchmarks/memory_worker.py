"""Worker launched by benchmarks/memory_validation.py and tests/test_perfmodel_memory.py under mpiexec: each
process's traced peak over training steps of a model split over model-parallel groups and/or cut into
pipeline stages, measured as the one-process measurement is (a first build's step at a small batch untraced,
so kernels are compiled; then, under tracemalloc, the model built, split and cut, and its steps).

    mpiexec -n P python benchmarks/memory_worker.py MODEL BATCH [--model_parallel_size M] [--stages S]
                                               [--micro_batches K] [--schedule 1f1b|gpipe] [--optimizer adam]
                                               [--zero 1|2|3] [--replicas P [--reduction SPEC]] [--steps 2]

P = S x M (one pipeline; S = 1: model parallelism only), or with --zero or --replicas P, P data-parallel
replicas of BATCH samples each (the bucketed reducer, or --reduction's; at stages 2 and 3 ZeRO's reduce-scatter;
at stage 3 the parameters sharded, as pydtnn-train shards them before its first step). SPEC: a reducer and its
options as reducers.create takes them, "topk:density=0.01", "bucketed:compression=fp16", "local_sgd:every=2",
"stale" (reduction_of). Each rank prints one line, "peak RANK BYTES".
"""

import argparse
import gc
import os
import sys
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pydtnn import losses, models, optim
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, model_parallel, pipeline
from pydtnn.perfmodel import machine as machines
from pydtnn.perfmodel.memory import OPTIMIZERS
from pydtnn.perfmodel.pipelined import stage_cut
from pydtnn.step import Step


def reduction_of(spec):
    """(reducer name, {option: value}) of a SPEC such as "topk:density=0.01,momentum=0.9" (numbers as numbers)."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = int(value) if value.isdigit() else float(value)
        except ValueError:
            options[key] = value
    return name, options


def build(args, world, pipe, group):
    """This rank's step (Step or PipelineStep) over its part of a freshly built model."""
    if args.zero or args.replicas > 1:
        return build_sharded(args, world)
    shape, classes = models.defaults(args.model)
    model = models.create(args.model, input_shape=shape, num_classes=classes, backend=CPUBackend(np.float32, seed=0))
    name, hyper = OPTIMIZERS[args.optimizer]
    loss = losses.create("categorical_cross_entropy")
    if args.stages > 1:
        cut = stage_cut(model, args.stages, args.batch, args.micro_batches, machines.DEFAULT)
        del model
        model = cut.stage(pipe.rank)
    if group is not None:
        model_parallel.partition(model, group)
    gc.collect()  # as pydtnn-train does: the whole model's other layers go now, not at the collector's next pass
    opt = optim.create(name, model.parameters(), backend=model.backend, **hyper)
    if args.stages > 1:
        return pipeline.PipelineStep(model, loss, opt, pipe, cut, args.micro_batches, args.schedule)
    return Step(model, loss, opt, accumulation_steps=args.micro_batches)


def build_sharded(args, world):
    """A data-parallel replica's Step with ZeRO's sharded optimizer and its reduction over `world` (--zero 0:
    the plain optimizer and --reduction's reducer)."""
    from pydtnn.distributed import reducers, zero

    shape, classes = models.defaults(args.model)
    model = models.create(args.model, input_shape=shape, num_classes=classes, backend=CPUBackend(np.float32, seed=0))
    name, hyper = OPTIMIZERS[args.optimizer]
    def make(params):
        return optim.create(name, params, backend=model.backend, **hyper)

    opt = zero.ShardedOptimizer(make, model, world, args.zero) if args.zero else make(model.parameters())
    if args.zero >= 2:
        reducer = zero.ShardedReducer(world, opt)
    else:
        name, options = reduction_of(args.reduction)
        reducer = reducers.create(name, world, **options)
    reducer.attach(model)
    if args.zero == 3:  # as pydtnn-train does once the replicas agree: the whole parameters let go
        opt.shards.attach()
    return Step(model, losses.create("categorical_cross_entropy"), opt, reducer,
                accumulation_steps=args.micro_batches)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("batch", type=int)
    p.add_argument("--model_parallel_size", type=int, default=1)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--micro_batches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--optimizer", default="sgd_momentum", choices=tuple(OPTIMIZERS))
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (the world), with or without --zero")
    p.add_argument("--reduction", default="bucketed", help="the reducer of --replicas without --zero, as SPEC")
    p.add_argument("--steps", type=int, default=2, help="traced steps (local SGD every 2: 3, so a step's peak "
                                                         "meets the buffers its first average makes)")
    args = p.parse_args()
    world = launch.init()
    launch.install_abort_handler(world)
    if args.stages > 1:
        pipe, _, group = pipeline.groups(world, args.stages, args.model_parallel_size)
    else:
        pipe, group = None, (world if args.model_parallel_size > 1 else None)
    shape, classes = models.defaults(args.model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, *shape)).astype(np.float32)
    y = np.eye(classes, dtype=np.float32)[rng.integers(0, classes, args.batch)]
    build(args, world, pipe, group).run(x[:4], y[:4])  # kernels compiled, untraced
    tracemalloc.start()
    step = build(args, world, pipe, group)
    tracemalloc.reset_peak()
    for _ in range(args.steps):
        step.run(x, y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    world.barrier()
    print(f"peak {world.rank} {peak}", flush=True)


if __name__ == "__main__":
    main()
