"""Our gradient reducers against raw mpi4py Allreduce on the same bytes.

    mpiexec -n 2 python benchmarks/allreduce.py [--max_mb 256] [--repeats 10] [--out FILE]

For each message size, the bytes are split into 16 float32 gradient tensors of a stand-in model;
each reducer gets them as a backward pass would (gradients reported ready in reverse order, then
finish()), and raw MPI reduces one buffer of the same size in place. Prints the median time per
reduction, the algorithm bandwidth (bytes / time) and reducer / raw ratios. One BLAS thread per rank.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from pydtnn.distributed import reducers
from pydtnn.distributed.comm import MPIComm

TENSORS = 16


class StandIn:
    """What a reducer sees of a model: parameters() and the gradients-ready hook."""

    def __init__(self, nbytes):
        sizes = np.full(TENSORS, max(nbytes // 4 // TENSORS, 1))
        self.params = [(f"{i}.weight", np.zeros(n, np.float32), np.ones(n, np.float32)) for i, n in enumerate(sizes)]
        self.hooks = []

    def parameters(self):
        return self.params

    def add_grad_ready_hook(self, fn):
        self.hooks.append(fn)

    def backward(self):
        for name, _, _ in reversed(self.params):
            for fn in self.hooks:
                fn([name])


def timed(fn, repeats, comm):
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the slowest rank's time counts
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min_kb", type=float, default=1)
    p.add_argument("--max_mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args()
    threadpool_limits(1)
    world = MPI.COMM_WORLD
    comm = MPIComm(stall_timeout=None)
    sizes, n = [], int(args.min_kb * 1024)
    while n <= args.max_mb * 2**20:
        sizes.append(n)
        n *= 4
    names = reducers.NAMES
    rows = []
    for nbytes in sizes:
        repeats = args.repeats if nbytes < 2**24 else max(3, args.repeats // 3)
        raw = np.ones(nbytes // 4, np.float32)
        t_raw = timed(lambda: world.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM), repeats, world)
        row = {"bytes": nbytes, "raw": t_raw}
        for name in names:
            model = StandIn(nbytes)
            red = reducers.create(name, comm).attach(model)

            def step():
                red.begin_step(1 / world.size)
                model.backward()
                red.finish()

            step()
            row[name] = timed(step, repeats, world)
        rows.append(row)
    if world.rank == 0:
        lines = [f"{world.size} ranks, mpi4py {MPI.Get_library_version().splitlines()[0]}",
                 "", "| size | raw MPI ms | raw GB/s | " + " | ".join(f"{n} ms | {n}/raw" for n in names) + " |",
                 "| ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in names) + " |"]
        for r in rows:
            size = f"{r['bytes'] / 2**20:g} MB" if r["bytes"] >= 2**20 else f"{r['bytes'] / 1024:g} KB"
            cells = " | ".join(f"{r[n] * 1e3:.3f} | {r['raw'] / r[n]:.2f}" for n in names)
            lines.append(f"| {size} | {r['raw'] * 1e3:.3f} | {r['bytes'] / r['raw'] / 1e9:.2f} | {cells} |")
        text = "\n".join(lines) + "\n\n(n/raw: bandwidth of reducer n as a fraction of raw MPI's; above 1 is faster)\n"
        print(text)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)


if __name__ == "__main__":
    main()
