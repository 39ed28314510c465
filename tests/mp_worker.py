"""Worker launched by tests/test_model_parallel.py under mpiexec (or plain python for one process).

    python tests/mp_worker.py OUT_FILE [--model_parallel_size M] [--dtype float64] [--steps 10]

Trains a small network with every kind of layer model parallelism treats differently (channel counts
that do not divide by 2 or 3, BatchNorm, a residual and a concatenation block, a depthwise
convolution, dropout after a Dense) for --steps steps of SGD with momentum, M-way model parallel inside
groups of M ranks and data parallel across the groups (synchronized BatchNorm); --model_parallel_size 1 is
pure data parallelism. Dropout masks and augmentation are drawn per sample (pydtnn.randomness), so every
layout draws what one process draws. Rank 0 saves the
whole parameters to OUT_FILE (safetensors).
"""

import argparse
import os
import signal
import time

import numpy as np
from safetensors.numpy import save_file

from pydtnn import data
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, model_parallel, reducers
from pydtnn.distributed.comm import SingleProcess
from pydtnn.layers import (AdditionBlock, BatchNorm, ConcatenationBlock, Conv2D, Dense, Dropout, Flatten,
                           MaxPool2D, ReLU)
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.optim import SGD
from pydtnn.trainer import Trainer


def network(backend, dropout):
    layers = [
        Conv2D(5, 3, padding=1, use_bias=False), BatchNorm(), ReLU(), MaxPool2D(2),
        Conv2D(7, 3, padding=1, use_bias=False), BatchNorm(), ReLU(),
        AdditionBlock([Conv2D(7, 3, padding=1, use_bias=False), BatchNorm()], []),
        ReLU(),
        ConcatenationBlock([Conv2D(3, 1)], [Conv2D(4, 3, padding=1), ReLU()]),
        Conv2D(7, 3, padding=1, groups=7, use_bias=False), BatchNorm(), ReLU(), MaxPool2D(2),
        Flatten(), Dense(11), ReLU(), Dropout(dropout), Dense(10),
    ]
    return Model(layers, (1, 28, 28), backend=backend, name="mp-test")


class Misbehave:
    """A layer's forward that, in its `at`-th call, mid-step: kills its process (no clean exit, no abort),
    raises, or stops for 120 s."""

    def __init__(self, forward, at, how):
        self.forward, self.at, self.how, self.calls = forward, at, how, 0

    def __call__(self, x, training=True):
        self.calls += 1
        if self.calls == self.at:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "raise":
                raise RuntimeError(f"deliberate failure in call {self.at}")
            time.sleep(120)
        return self.forward(x, training)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model_parallel_size", type=int, default=0, help="0: every process (pure model parallelism)")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=12, help="global batch")
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--augment", action="store_true", help="random flips and crops of the training images")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--kill_at", type=int, default=0, help="rank 1 kills itself (SIGKILL) in this step's forward")
    p.add_argument("--raise_at", type=int, default=0, help="rank 1 raises in this step's forward")
    p.add_argument("--stall_at", type=int, default=0, help="rank 1 sleeps 120 s in this step's forward")
    p.add_argument("--stall_timeout", type=float, default=120.0)
    args = p.parse_args()
    world = launch.init(stall_timeout=args.stall_timeout)
    launch.install_abort_handler(world)
    m = args.model_parallel_size or world.size
    if world.size > 1:
        group = world.split(world.rank // m, world.rank)
        replicas = world.split(world.rank % m, world.rank)
    else:
        group = replicas = SingleProcess()
    model = network(CPUBackend(args.dtype, seed=3), args.dropout)
    if group.size > 1:
        model_parallel.partition(model, group)
    how = "kill" if args.kill_at else "raise" if args.raise_at else "stall" if args.stall_at else None
    if how and world.rank == 1:
        layer = dict(model.root.children)["6"]  # a BatchNorm between two gathers
        layer.forward = Misbehave(layer.forward, args.kill_at or args.raise_at or args.stall_at, how)
    train, _ = data.load("mnist5k")
    train = train.subset(np.arange(args.steps * args.batch) * 7)
    if args.augment:
        train = data.with_augmentation(train, flip=True, crop=True, crop_padding=2)
    reducer = reducers.create("bucketed", replicas) if replicas.size > 1 else None
    comm = replicas if replicas.size > 1 else SingleProcess()
    optimizer = SGD(model.parameters(), lr=0.05, momentum=0.9, backend=model.backend)
    trainer = Trainer(model, SoftmaxCrossEntropy(), optimizer, progress=False, comm=comm, reducer=reducer,
                      is_root=world.rank == 0, accumulation_steps=args.accumulate, sync_batchnorm=comm.size > 1)
    trainer.fit(train, epochs=1, batch_size=args.batch // comm.size)
    state = model.whole_state_dict()
    if world.rank == 0:
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, args.out)
        print("sha", trainer.final["params_sha256"])


if __name__ == "__main__":
    main()
