"""Worker launched by tests/test_pipeline.py under mpiexec (or plain python for one process).

    python tests/pipe_worker.py OUT_FILE [--micro_batches 4] [--schedule gpipe|1f1b] [--boundaries 5,9]

Trains tests/mp_worker.py's network (BatchNorm, dropout, a residual and a concatenation block, random
flips and crops of the images) for --steps steps of SGD with momentum. One process: Step with
accumulation_steps = --micro_batches, the reference. Several: one pipeline stage per process (cut by the
units' costs, or where --boundaries says), PipelineStep. Rank 0 saves the whole state to OUT_FILE
(safetensors) and prints the stage bounds.
"""

import argparse
import os
import sys

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_worker import network

from pydtnn import data
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, pipeline
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD
from pydtnn.trainer import Trainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--boundaries", default="", help="comma-separated unit paths where stages 1.. begin")
    args = p.parse_args()
    world = launch.init()
    launch.install_abort_handler(world)
    model = network(CPUBackend(args.dtype, seed=3), 0.3)
    train, _ = data.load("mnist5k")
    train = data.with_augmentation(train.subset(np.arange(args.steps * args.batch) * 7), flip=True, crop=True,
                                   crop_padding=2)
    loss = SoftmaxCrossEntropy()
    if world.size == 1:
        optimizer = SGD(model.parameters(), lr=0.05, momentum=0.9, backend=model.backend)
        trainer = Trainer(model, loss, optimizer, progress=False, accumulation_steps=args.micro_batches)
        trainer.fit(train, epochs=1, batch_size=args.batch)
        state, bounds = model.whole_state_dict(), None
    else:
        cut = pipeline.Cut.of(model, world.size, args.boundaries.split(",") if args.boundaries else None)
        bounds = cut.bounds
        stage = cut.stage(world.rank)
        del model
        optimizer = SGD(stage.parameters(), lr=0.05, momentum=0.9, backend=stage.backend)
        step = pipeline.PipelineStep(stage, loss, optimizer, world, cut, args.micro_batches, args.schedule)
        trainer = Trainer(stage, loss, optimizer, progress=False, is_root=world.rank == 0, step=step)
        trainer.fit(train, epochs=1, batch_size=args.batch)
        state = step.whole_state()
    if world.rank == 0:
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, args.out)
        print("bounds", bounds, "loss", trainer.history[-1]["loss"], flush=True)


if __name__ == "__main__":
    main()
