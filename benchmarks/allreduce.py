"""Our gradient reducers against raw mpi4py Allreduce on the same bytes.

    mpiexec -n 2 python benchmarks/allreduce.py [--max_mb 256] [--repeats 10] [--out FILE] [--json FILE]
    python benchmarks/allreduce.py --plot docs/benchmarks_allreduce.png RESULT.json [RESULT.json ...]

For each message size (powers of 4 from --min_kb to --max_mb), the bytes are split into 16 float32
gradient tensors of a stand-in model; each reducer (blocking, per_layer, bucketed) gets them as a
backward pass would (begin_step(1/P), gradients reported ready in reverse order, then finish()),
and raw MPI reduces one float32 buffer of the same size in place: `Allreduce(IN_PLACE, buf, SUM)`
(the target's reference) and, for information, `Iallreduce` + `Wait` on the same buffer.

Every timed repeat starts after a barrier; each method is warmed up first. A method's time is the
median over repeats of the slowest rank's median. Bandwidth is algorithm bandwidth, bytes / time.
One BLAS/OpenMP thread per rank.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time

import numpy as np

TENSORS = 16
REDUCERS = ("blocking", "per_layer", "bucketed")


class StandIn:
    """What a reducer sees of a model: parameters() -> [(name, param, grad)], the gradients-ready hook, and
    the gradients as views of one buffer in reverse parameter order (grad_buffer, grad_offsets), as Model has."""

    def __init__(self, nbytes, tensors=TENSORS):
        total = max(nbytes // 4, tensors)
        sizes = [total // tensors + (1 if i < total % tensors else 0) for i in range(tensors)]  # sums to total
        self.grad_buffer, self.grad_offsets = np.ones(total, np.float32), {}
        stop = total
        self.params = []
        for i, n in enumerate(sizes):  # the first parameter sits at the end of the buffer
            self.grad_offsets[f"{i}.weight"] = (stop - n, stop)
            self.params.append((f"{i}.weight", np.zeros(n, np.float32), self.grad_buffer[stop - n : stop]))
            stop -= n
        self.hooks = []

    def parameters(self):
        return self.params

    def add_grad_ready_hook(self, fn):
        self.hooks.append(fn)

    def backward(self):
        """Report each gradient ready, last layer first, as Model.backward does."""
        for name, _, _ in reversed(self.params):
            for fn in self.hooks:
                fn([name])


def timed(fn, repeats, world, warmup=1):
    """Slowest rank's median time of fn over `repeats` runs, each started after a barrier."""
    from mpi4py import MPI

    for _ in range(warmup):
        world.Barrier()
        fn()
    times = []
    for _ in range(repeats):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return world.allreduce(statistics.median(times), op=MPI.MAX)


def busy_seconds():
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_seconds():
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def size_label(nbytes):
    return f"{nbytes / 2**20:g} MB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KB"


def measure(args):
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from pydtnn.distributed import reducers
    from pydtnn.distributed.comm import MPIComm

    threadpool_limits(1)
    world = MPI.COMM_WORLD
    comm = MPIComm(stall_timeout=None)
    sizes, n = [], int(args.min_kb * 1024)
    while n <= args.max_mb * 2**20:
        sizes.append(n)
        n *= 4
    rows = []
    for nbytes in sizes:
        repeats = args.repeats if nbytes < 2**24 else max(3, args.repeats // 2)
        raw = np.ones(nbytes // 4, np.float32)
        row = {"bytes": raw.nbytes}
        row["raw"] = timed(lambda raw=raw: world.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM), repeats, world)
        row["raw_iallreduce"] = timed(lambda raw=raw: world.Iallreduce(MPI.IN_PLACE, raw, op=MPI.SUM).Wait(),
                                      repeats, world)
        del raw
        for name in REDUCERS:
            model = StandIn(nbytes)
            red = reducers.create(name, comm).attach(model)

            def step(red=red, model=model):
                red.begin_step(1 / world.size)
                model.backward()
                red.finish()

            row[name] = timed(step, repeats, world)
            del model, red
        rows.append(row)
        if world.rank == 0 and args.verbose:
            print(f"  {size_label(nbytes)} done", file=sys.stderr, flush=True)
    return rows


def table(rows, world_size, library):
    cpus = os.cpu_count()
    lines = [f"{world_size} ranks on {cpus} cores" + (" (oversubscribed)" if world_size > cpus else "")
             + f", {library}, float32, {TENSORS} gradient tensors per message", "",
             "| size | raw Allreduce ms | raw GB/s | raw Iallreduce ms | "
             + " | ".join(f"{n} ms | {n} GB/s | {n}/raw" for n in REDUCERS) + " |",
             "| ---: | ---: | ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in REDUCERS) + " |"]
    for r in rows:
        def gbs(t, r=r):
            return r["bytes"] / t / 1e9

        cells = " | ".join(f"{r[n] * 1e3:.3f} | {gbs(r[n]):.2f} | {r['raw'] / r[n]:.2f}" for n in REDUCERS)
        lines.append(f"| {size_label(r['bytes'])} | {r['raw'] * 1e3:.3f} | {gbs(r['raw']):.2f} | "
                     f"{r['raw_iallreduce'] * 1e3:.3f} | {cells} |")
    lines += ["", ("(GB/s: algorithm bandwidth, bytes / time. n/raw: reducer n's bandwidth as a fraction of raw "
              "Allreduce's; 1.00 = as fast, above 1 = faster. Target: >= 0.90 from 1 MB up.)")]
    return "\n".join(lines) + "\n"


def plot(json_files, out):
    """Bandwidth against message size: raw MPI and each reducer, one panel per results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = []
    for name in json_files:
        with open(name, encoding="utf-8") as f:
            results.append(json.load(f))
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = res["rows"]
        x = [r["bytes"] for r in rows]
        for key, label, style in [("raw", "raw MPI Allreduce", "k-o"), ("raw_iallreduce", "raw MPI Iallreduce", "k:x"),
                                  ("blocking", "blocking", "-s"), ("per_layer", "per_layer", "-^"),
                                  ("bucketed", "bucketed", "-D")]:
            ax.plot(x, [r["bytes"] / r[key] / 1e9 for r in rows], style, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [size_label(b).replace(" ", "") for b in x], rotation=45)
        ax.axvline(2**20, color="grey", lw=0.5, ls="--")
        ax.set_xlabel("message size")
        ax.set_ylabel("algorithm bandwidth (GB/s)")
        ax.set_title(f"{res['world_size']} ranks on {res['cpus']} cores"
                     + (" (oversubscribed)" if res["world_size"] > res["cpus"] else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min_kb", type=float, default=1)
    p.add_argument("--max_mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per size (half from 16 MB up, at least 3)")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    p.add_argument("--json", help="also write the raw numbers (seconds) to this file, for --plot")
    p.add_argument("--plot", metavar="PNG", help="plot results files given as arguments instead of measuring")
    p.add_argument("--verbose", action="store_true", help="report progress per size on stderr")
    p.add_argument("results", nargs="*", help="with --plot: JSON files written by --json")
    args = p.parse_args()
    if args.plot:
        return plot(args.results, args.plot)

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    t0, b0, o0 = time.perf_counter(), busy_seconds(), own_seconds()
    rows = measure(args)
    ours = world.allreduce(own_seconds() - o0)  # CPU-seconds of all ranks
    if world.rank == 0:
        wall = time.perf_counter() - t0
        foreign = max(0.0, (busy_seconds() - b0 - ours) / wall) if b0 is not None else float("nan")
        library = MPI.Get_library_version().splitlines()[0].strip()
        library = " ".join(library.split()) + f", mpi4py {__import__('mpi4py').__version__}"
        text = table(rows, world.size, library)
        text += (f"\n{wall:.0f} s; other processes used {foreign:.2f} cores on average meanwhile (CPU time of the "
                 f"machine minus this job's ranks).\n")
        print(text, flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"world_size": world.size, "cpus": os.cpu_count(), "library": library, "wall_s": wall,
                           "foreign_cores": foreign, "rows": rows}, f,
                          indent=1)


if __name__ == "__main__":
    main()
