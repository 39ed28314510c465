"""Worker launched by tests/test_pipeline.py under mpiexec (or plain python for one process).

    python tests/pipe_worker.py OUT_FILE [--micro_batches 4] [--schedule gpipe|1f1b] [--boundaries 5,9]
                                [--replicas R] [--misbehave stall|kill|shape --at STEP --rank R --stall_timeout S]

Trains tests/mp_worker.py's network (BatchNorm, dropout, a residual and a concatenation block, random
flips and crops of the images) for --steps steps of SGD with momentum. One process: Step with
accumulation_steps = --micro_batches, the reference. Several: one pipeline stage per process (cut by the
units' costs, or where --boundaries says), PipelineStep; with --replicas R, R data-parallel pipelines of
np / R stages, each stage's gradients reduced across them (bucketed), and with np = R plain data
parallelism (Step's micro-batches), their reference. (Each replica takes its part of every micro-batch of
the global batch, so with --sync_batchnorm R replicas equal one process; without, each replica's BatchNorm
sees its part of a micro-batch only, and they equal R data-parallel processes.) Rank 0 saves the whole
state to OUT_FILE
(safetensors) and prints the stage bounds. --misbehave: after step --at, rank --rank sleeps 120 s, kills
itself (SIGKILL: no word to anyone), or sends its activations with half their values from then on.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mp_worker import network

from pydtnn import data
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, pipeline, reducers
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD
from pydtnn.step import BatchNormSync
from pydtnn.trainer import Trainer


class Misbehave:
    """After step `at`, on rank `rank` of the world: sleep, die, or send short activations (see the docstring)."""

    def __init__(self, how, at, rank, mine):
        self.how, self.at, self.rank, self.mine = how, at, rank, mine

    def on_batch_end(self, trainer, step, logs):
        if step + 1 != self.at or self.mine != self.rank:
            return
        if self.how == "stall":
            time.sleep(120)
        elif self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.how == "shape":
            send = pipeline._Messages.send_activation
            pipeline._Messages.send_activation = lambda messages, i, out: send(messages, i, out[:, : out.shape[1] // 2])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--boundaries", default="", help="comma-separated unit paths where stages 1.. begin")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel pipelines")
    p.add_argument("--recompute", default="none")
    p.add_argument("--sync_batchnorm", action="store_true", help="BatchNorm statistics over the replicas")
    p.add_argument("--misbehave", choices=("stall", "kill", "shape"), default=None)
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--stall_timeout", type=float, default=300.0)
    args = p.parse_args()
    world = launch.init(stall_timeout=args.stall_timeout)
    callbacks = [Misbehave(args.misbehave, args.at, args.rank, world.rank)] if args.misbehave else []
    launch.install_abort_handler(world)
    model = network(CPUBackend(args.dtype, seed=3), 0.3)
    train, _ = data.load("mnist5k")
    train = data.with_augmentation(train.subset(np.arange(args.steps * args.batch) * 7), flip=True, crop=True,
                                   crop_padding=2)
    loss = SoftmaxCrossEntropy()
    if world.size == args.replicas:  # one process, or plain data parallelism: Step's micro-batches
        optimizer = SGD(model.parameters(), lr=0.05, momentum=0.9, backend=model.backend)
        reducer = reducers.create("bucketed", world) if world.size > 1 else None
        trainer = Trainer(model, loss, optimizer, progress=False, accumulation_steps=args.micro_batches,
                          comm=world if world.size > 1 else None, reducer=reducer, is_root=world.rank == 0,
                          recompute=args.recompute, sync_batchnorm=args.sync_batchnorm)
        trainer.fit(train, epochs=1, batch_size=args.batch // args.replicas)
        state, bounds = model.whole_state_dict(), None
    else:
        stages = world.size // args.replicas
        pipe, replicas, _ = pipeline.groups(world, stages)
        cut = pipeline.Cut.of(model, stages, args.boundaries.split(",") if args.boundaries else None)
        bounds = cut.bounds
        stage = cut.stage(pipe.rank)
        del model
        optimizer = SGD(stage.parameters(), lr=0.05, momentum=0.9, backend=stage.backend)
        reducer = reducers.create("bucketed", replicas) if replicas.size > 1 else None
        step = pipeline.PipelineStep(stage, loss, optimizer, pipe, cut, args.micro_batches, args.schedule,
                                     reducer=reducer, recompute=args.recompute,
                                     batchnorm_sync=BatchNormSync(replicas) if args.sync_batchnorm else None)
        trainer = Trainer(stage, loss, optimizer, progress=False, is_root=world.rank == 0, step=step,
                          comm=replicas if replicas.size > 1 else None, reducer=reducer, callbacks=callbacks)
        trainer.fit(train, epochs=1, batch_size=args.batch // args.replicas)
        state = step.whole_state()
    if world.rank == 0:
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, args.out)
        print("bounds", bounds, "loss", trainer.history[-1]["loss"], flush=True)


if __name__ == "__main__":
    main()
