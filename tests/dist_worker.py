"""Worker launched by tests/test_distributed.py under mpiexec (or plain python for one process).

    python tests/dist_worker.py OUT_DIR [--raise_at STEP --raise_rank R] [--stall_at STEP --stall_timeout S]
                                        [--mismatch_at STEP --debug_collectives] [--exit_at STEP]

Trains simplecnn on 250 embedded digits (global batch 24: the last batch of each epoch has 10
samples, uneven over 3 ranks) for 2 epochs with every reduction strategy and both dtypes, and rank 0
saves the parameters of each run to OUT_DIR/<strategy>-<dtype>.safetensors.
"""

import argparse
import os
import sys
import time

import numpy as np
from safetensors.numpy import save_file

from pydtnn import data, models
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, reducers
from pydtnn.distributed.consistency import broadcast_state
from pydtnn.layers import BatchNorm, Conv2D, Dense, Flatten, MaxPool2D, ReLU
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.optim import SGD
from pydtnn.trainer import Trainer

GLOBAL_BATCH, SAMPLES, EPOCHS = 24, 250, 2


class Misbehave:
    """On rank `rank` at step `step`: raise, stop calling collectives, issue a different one, or end the
    process cleanly (exit code 0) without aborting the job."""

    def __init__(self, step, rank, how):
        self.step, self.rank, self.how = step, rank, how

    def on_batch_end(self, trainer, step, logs):
        if step + 1 != self.step or trainer.comm.rank != self.rank:
            return
        if self.how == "raise":
            raise RuntimeError(f"deliberate failure at step {self.step}")
        if self.how == "stall":
            time.sleep(120)
        if self.how == "mismatch":
            trainer.comm.allreduce(np.zeros(3), "deliberate extra")
        if self.how == "exit":
            sys.exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--raise_at", type=int, default=0)
    p.add_argument("--raise_rank", type=int, default=1)
    p.add_argument("--stall_at", type=int, default=0)
    p.add_argument("--stall_timeout", type=float, default=300.0)
    p.add_argument("--mismatch_at", type=int, default=0)
    p.add_argument("--exit_at", type=int, default=0)
    p.add_argument("--debug_collectives", action="store_true")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--sync_bn", action="store_true", help="a model with BatchNorm, statistics synchronized")
    p.add_argument("--fp16", action="store_true", help="fp16 wire format for gradients")
    p.add_argument("--strategies", default="blocking,per_layer,bucketed")
    p.add_argument("--ranks_per_node", type=int, default=0, help="hierarchical, powersgd: ranks per emulated node")
    p.add_argument("--density", type=float, default=1.0, help="topk, oktopk: the share of entries each rank selects")
    p.add_argument("--rank", type=int, default=4, help="powersgd: the rank of each matrix's approximation")
    p.add_argument("--min_compression_rate", type=float, default=2.0, help="powersgd: which matrices it compresses")
    p.add_argument("--every", type=int, default=4, help="local_sgd: steps between averages")
    p.add_argument("--average", default="plain", help="local_sgd: plain or weighted")
    p.add_argument("--post_local", type=int, default=0, help="local_sgd: data-parallel steps first")
    p.add_argument("--progress", default="test", help="per_layer, bucketed, stale: test or thread")
    p.add_argument("--alone", action="store_true", help="one process: run --strategies' reducers all the same")
    p.add_argument("--piece_kb", type=float, default=0, help="cut messages into pieces this small (0: default)")
    args = p.parse_args()
    if args.piece_kb:
        reducers.base.PIECE_BYTES = int(args.piece_kb * 1024)
    comm = launch.init(stall_timeout=args.stall_timeout, debug_collectives=args.debug_collectives)
    launch.install_abort_handler(comm)
    train, _ = data.load("mnist5k")
    train = train.subset(np.arange(SAMPLES) * 16)  # all ten digits
    alone = args.alone and comm.size == 1  # one process through a reducer (its own algorithm, reduced over one)
    strategies = args.strategies.split(",") if comm.size > 1 or alone else ["single"]
    for strategy in strategies:
        for dtype in ("float64", "float32"):
            seed = comm.rank * 1000 + 7  # different seeds: the broadcast must make ranks equal
            if args.sync_bn:
                layers = [Conv2D(8, 3, padding=1, use_bias=False), BatchNorm(), ReLU(), MaxPool2D(2),
                          Conv2D(16, 3, padding=1, use_bias=False),
                          BatchNorm(), ReLU(), MaxPool2D(2), Flatten(), Dense(10)]
                model = Model(layers, (1, 28, 28), CPUBackend(dtype, seed=seed))
            else:
                model = models.create("simplecnn", backend=CPUBackend(dtype, seed=seed))
            opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
            options = {"compression": "fp16"} if args.fp16 else {}
            if strategy in ("bucketed", "hierarchical"):
                options.update(bucket_mb=0.05, first_bucket_mb=0.01)
            if strategy == "hierarchical" and args.ranks_per_node:
                options["ranks_per_node"] = args.ranks_per_node
            if strategy in ("topk", "oktopk"):
                options["density"] = args.density
            if strategy == "powersgd":
                options.update(rank=args.rank, min_compression_rate=args.min_compression_rate)
                if args.ranks_per_node:  # two levels over emulated nodes
                    options.update(hierarchical=True, ranks_per_node=args.ranks_per_node)
            if strategy == "local_sgd":
                options.update(every=args.every, average=args.average, post_local=args.post_local)
            if args.progress != "test":
                options["progress"] = args.progress
            reducer = reducers.create(strategy, comm, **options) if comm.size > 1 or alone else None
            callbacks = [Misbehave(step, args.raise_rank, how) for how, step in
                         (("raise", args.raise_at), ("stall", args.stall_at), ("mismatch", args.mismatch_at),
                          ("exit", args.exit_at)) if step]
            t = Trainer(model, SoftmaxCrossEntropy(), opt, progress=False, comm=comm, reducer=reducer,
                        callbacks=callbacks, seed=3, accumulation_steps=args.accumulate, sync_batchnorm=args.sync_bn)
            broadcast_state(comm, model, opt)
            t.fit(train, epochs=EPOCHS, batch_size=GLOBAL_BATCH // comm.size)
            if strategy == "local_sgd":  # every rank's parameters: the replicas' average at the end of the epoch
                save_file({n: np.ascontiguousarray(p) for n, p, _ in model.parameters()},
                          os.path.join(args.out, f"{strategy}-{dtype}-rank{comm.rank}.safetensors"))
            if comm.rank == 0:
                params = {n: np.ascontiguousarray(p) for n, p, _ in model.parameters()}
                save_file(params, os.path.join(args.out, f"{strategy}-{dtype}.safetensors"),
                          metadata={"sha": t.final["params_sha256"], "loss": repr(t.history[-1]["loss"]),
                                    "bytes": str(reducer.bytes_reduced if reducer else 0)})


if __name__ == "__main__":
    main()
