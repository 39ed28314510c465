"""Bytes each process sends per step with the sparse reducers, topk and oktopk, from 2 to 8 processes.

    python benchmarks/sparse_bytes.py [--models simplecnn,resnet20_cifar10] [--nps 2,4,8] [--density 0.01]
                                      [--steps 40] [--json docs/sparse_bytes.json] [--plot docs/benchmarks_sparse_bytes.png]
    python benchmarks/sparse_bytes.py --from_json docs/sparse_bytes.json [--plot PNG]     # the table again

Each configuration is one `mpiexec -n NP python -m pydtnn` run of one epoch of --steps steps on Fashion-MNIST (as
Debian's dataset-fashion-mnist installs it; --data) with `--reduction topk|oktopk --density D`, batch 64 per process,
one thread per process, the learning rate not scaled with the processes (simplecnn with oktopk at np 8 and the
scaled rate 0.4 diverged within 40 steps; the bytes are read, not the training); the epoch's record in the metrics file carries `sent_bytes_per_step`, rank 0's bytes sent per
step as the collectives send them (a ring allgather passes on every block but its successor's; an alltoallv sends
each block to its rank once). Reported beside it: k = ceil(D x the model's parameters), read off topk's bytes
(exactly k (P - 1) entries), and the measured bytes in units of k entries of 12 bytes (an int64 index and a float32 value): topk's are P - 1, Ok-Topk's at most
6 (P - 1) / P (Li and Hoefler's bound; 2 (P - 1) / P when every rank selects exactly k and keeps exactly k). Bytes do
not depend on the machine; the runs take about 10 minutes on 2 cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

DATA = "/usr/share/datasets/fashion-mnist"
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENTRY = 12  # bytes of one sent entry: an int64 index and a float32 value


def run(model, np_, reduction, density, steps, data):
    """Rank 0's bytes sent per step in one run."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [MPIEXEC, "-n", str(np_), sys.executable, "-m", "pydtnn", "--model", model, "--dataset", "fashion_mnist",
               "--dataset_train_path", data, "--dataset_test_path", data, "--num_epochs", "1", "--steps_per_epoch",
               str(steps), "--batch_size", "64", "--reduction", reduction, "--density", str(density), "--progress",
               "false", "--metrics_file", metrics, "--learning_rate_scaling", "false"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp, check=False)
        if r.returncode:
            sys.exit(f"sparse_bytes: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
    return records[0]["sent_bytes_per_step"]


def table(rows):
    out = [("| model | k | reduction | np | bytes sent per step (rank 0) | in k x 12 bytes | "
            "bound (k x 12 bytes) | vs np 2 |"),
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    first = {(r["model"], r["reduction"]): r["bytes"] for r in rows if r["np"] == min(x["np"] for x in rows)}
    for r in rows:
        units = r["bytes"] / (ENTRY * r["k"])
        bound = r["np"] - 1 if r["reduction"] == "topk" else 6 * (r["np"] - 1) / r["np"]
        out.append(f"| {r['model']} | {r['k']:,} | {r['reduction']} | {r['np']} | {r['bytes']:,.0f} | "
                   f"{units:.2f} | {bound:.2f} | {r['bytes'] / first[r['model'], r['reduction']]:.2f}x |")
    return "\n".join(out)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for reduction, style in (("topk", "o-"), ("oktopk", "s-")):
            pts = sorted((r["np"], r["bytes"] / 1e3) for r in mine if r["reduction"] == reduction)
            ax.plot([p for p, _ in pts], [b for _, b in pts], style, label=reduction)
        k = mine[0]["k"]
        nps = sorted({r["np"] for r in mine})
        ax.plot(nps, [6 * (p - 1) / p * ENTRY * k / 1e3 for p in nps], "k:", label="Ok-Topk's bound 6k(P-1)/P")
        ax.set(title=f"{model} (k = {k:,})", xlabel="processes", ylabel="kB sent per step, rank 0", xticks=nps)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="simplecnn,resnet20_cifar10")
    p.add_argument("--nps", default="2,4,8")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--data", default=DATA)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--plot", default=None, help="write the plot here (PNG)")
    p.add_argument("--from_json", default=None, help="read the rows from this file instead of running")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
    else:
        if not os.path.isdir(args.data):
            p.error(f"--data {args.data}: no such directory; expected the Fashion-MNIST IDX files "
                    "(apt-get install dataset-fashion-mnist)")
        rows = []
        for model in args.models.split(","):
            for reduction in ("topk", "oktopk"):
                for np_ in (int(n) for n in args.nps.split(",")):
                    sent = run(model, np_, reduction, args.density, args.steps, args.data)
                    rows.append({"model": model, "reduction": reduction, "np": np_, "bytes": sent,
                                 "density": args.density, "steps": args.steps})
                    print(f"{model} {reduction} np {np_}: {sent:,.0f} bytes per step", flush=True)
        for r in rows:  # topk sends k (P - 1) entries exactly: k, read off its first row
            first = next(x for x in rows if x["model"] == r["model"] and x["reduction"] == "topk")
            r["k"] = round(first["bytes"] / (ENTRY * (first["np"] - 1)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
