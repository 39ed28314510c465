"""Worker launched by tests/test_oktopk.py under mpiexec: a sparse reducer's steps on known gradients, written out.

    mpiexec -n P python tests/oktopk_worker.py OUT [--strategy oktopk|topk] [--density D] [--steps S]
                                                   [--threshold_every T] [--repartition_every R] [--size N]

Each rank attaches the reducer to a model of one Dense layer (float64, N inputs), and for each step sets the gradients
to draws that depend on the rank and the step (normal, times a scale drawn per entry), runs begin_step(1 / P) and finish(), and keeps what it gave and got. Rank r writes OUT/rank<r>.npz: "given" (steps, n)
the gradients as set, flat in the reducer's buffer order, "got" (steps, n) after finish, "residual" the residual after the last step, "sent" the
bytes it sent at each step (sent_bytes after each step).
"""

import argparse
import os

import numpy as np

from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, reducers
from pydtnn.layers import Dense
from pydtnn.model import Model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="oktopk")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threshold_every", type=int, default=2)
    p.add_argument("--repartition_every", type=int, default=3)
    p.add_argument("--size", type=int, default=60)
    args = p.parse_args()
    comm = launch.init()
    model = Model([Dense(7)], (args.size,), CPUBackend("float64", seed=1))
    options = {"density": args.density}
    if args.strategy == "oktopk":
        options.update(threshold_every=args.threshold_every, repartition_every=args.repartition_every)
    red = reducers.create(args.strategy, comm, **options).attach(model)
    spans = red.param_spans()

    def flat():  # the gradients laid out as the reducer's buffer holds them (the regions cut that order)
        out = np.zeros(max(b for _, b in spans.values()))
        for name, g in model.gradients():
            out[slice(*spans[name])] = g.reshape(-1)
        return out

    given, got, sent = [], [], []
    for step in range(args.steps):
        draw = np.random.default_rng(1000 * comm.rank + step)
        for _, g in model.gradients():
            g[...] = draw.standard_normal(g.shape) * draw.uniform(0.1, 3.0, g.shape)
        given.append(flat())
        red.begin_step(1 / comm.size)
        red.finish()
        got.append(flat())
        sent.append(red.sent_bytes)
    residual = red.residual.copy()
    np.savez(os.path.join(args.out, f"rank{comm.rank}.npz"), given=np.array(given), got=np.array(got),
             residual=residual, sent=np.array(sent), k=red.k)


if __name__ == "__main__":
    main()
