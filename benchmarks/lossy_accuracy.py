"""Accuracy of the lossy gradient reductions on real data: fp16 compression, topk, oktopk, powersgd, local SGD and
the one-step-stale reduction against dense.

    python benchmarks/lossy_accuracy.py [--data /usr/share/datasets/fashion-mnist] [--np 2] [--epochs 5]
                                        [--models simplecnn,resnet20_cifar10]
                                        [--reductions bucketed,fp16,topk:0.01]
                                        [--out docs/lossy_accuracy.json]      # about 55 minutes on 2 cores
    python benchmarks/lossy_accuracy.py --quick     # 1 epoch of 20 steps per run, about a minute
    python benchmarks/lossy_accuracy.py --models simplecnn --seeds 1,2 --out more.json   # other seeds
    python benchmarks/lossy_accuracy.py --from_json docs/lossy_accuracy.json more.json   # the table of both

Each configuration is one `mpiexec -n NP python -m pydtnn` run on Fashion-MNIST as Debian's
`dataset-fashion-mnist` package installs it (the IDX files, 60,000 training and 10,000 test images),
with the trainer's defaults otherwise (SGD with momentum 0.9, batch 64 per process, the learning rate
scaled by the process count, one thread per process), so the runs of a model with one seed see the same
initial parameters and the same samples in the same order: only the reduction differs. Other seeds
(--seeds) show how far two runs of one reduction differ, the scale against which a lossy reduction's
difference from dense is read. A reduction is
`bucketed` (the dense default), `fp16` (bucketed with --gradient_compression fp16: every gradient
scaled by a power of two and rounded to half precision on the wire) or `topk:D` (--reduction topk --density D: each process sends
its D share of largest-magnitude entries and keeps the rest as a residual for the next step) or
`topkmc:D` (topk with --momentum_correction: SGD's momentum applied by each process before it selects,
the optimizer without it); `topk:D:W` and `topkmc:D:W` add --density_warmup_epochs W (the density falls
from 0.25 to D over the first W epochs), and a last field `:layer` adds --topk_selection per_layer (each
layer's own largest entries), e.g. `topkmc:0.01:1:layer`; `powersgd:R` is --reduction powersgd --rank R (each
gradient matrix sent as a rank-R product, with error feedback), `powersgd:R:K` with --powersgd_start_step K;
`oktopk:D` is --reduction oktopk --density D (the ranks' largest entries summed region by region, the largest
sums kept, O(k) bytes per process), `oktopkmc:D` with --momentum_correction, `oktopk:D:W` with
--density_warmup_epochs W; `stale` is --reduction_staleness 1 (each update applies the previous step's gradients), `stale:M` with --momentum M;
`local_sgd:H` is --local_sgd H (the replicas averaged every H steps), `local_sgd:H:K` with --post_local_sgd K.

Reported: the final test accuracy over the 10,000 test images (the metrics file's `final` line), per
seed and its mean over the seeds, the difference of the means from the same model's dense mean in
points, and the wall time. Target: the lossy reductions within 1 point of dense.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

DATA = "/usr/share/datasets/fashion-mnist"


def reduction_flags(name):
    if name == "stale" or name.startswith("stale:"):
        _, *momentum = name.split(":")
        return ["--reduction_staleness", "1"] + (["--momentum", momentum[0]] if momentum else [])
    if name == "fp16":
        return ["--reduction", "bucketed", "--gradient_compression", "fp16"]
    if name.startswith(("topk:", "topkmc:")):
        kind, density, *more = name.split(":")
        flags = ["--reduction", "topk", "--density", density]
        for field in more:
            flags += ["--topk_selection", "per_layer"] if field == "layer" else ["--density_warmup_epochs", field]
        return flags + (["--momentum_correction", "true"] if kind == "topkmc" else [])
    if name.startswith(("oktopk:", "oktopkmc:")):
        kind, density, *warm = name.split(":")
        flags = ["--reduction", "oktopk", "--density", density] + (["--density_warmup_epochs", warm[0]] if warm else [])
        return flags + (["--momentum_correction", "true"] if kind == "oktopkmc" else [])
    if name.startswith("local_sgd:"):
        _, every, *post = name.split(":")
        return ["--local_sgd", every] + (["--post_local_sgd", post[0]] if post else [])
    if name.startswith("powersgd:"):
        _, rank, *start = name.split(":")
        return ["--reduction", "powersgd", "--rank", rank] + (["--powersgd_start_step", start[0]] if start else [])
    return ["--reduction", name]


def run_one(model, reduction, seed, args, workdir):
    metrics = os.path.join(workdir, f"{model}-{reduction.replace(':', '_')}-{seed}.jsonl")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(args.np),
           sys.executable, "-m", "pydtnn", "--model", model, "--dataset", "fashion_mnist",
           "--dataset_train_path", args.data, "--num_epochs", str(args.epochs),
           "--threads_per_process", "1", "--seed", str(seed), "--metrics_file", metrics,
           *reduction_flags(reduction)]
    if args.steps_per_epoch:
        cmd += ["--steps_per_epoch", str(args.steps_per_epoch)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"lossy_accuracy: {model} {reduction} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in open(metrics)]
    final = next(x for x in lines if x.get("final"))
    epochs = [x for x in lines if "epoch" in x]
    return {"model": model, "reduction": reduction, "seed": seed, "np": args.np, "epochs": args.epochs,
            "test_accuracy": final["test_accuracy"], "test_loss": final["test_loss"],
            "train_loss_by_epoch": [x["loss"] for x in epochs], "wall_s": round(wall, 1),
            "command": " ".join(cmd[cmd.index("-m") - 1:]).replace(metrics, "FILE")}


def table(results):
    """One row per model and reduction: the accuracy of each seed, their mean, the mean's difference from
    dense (bucketed), the mean final training loss and wall time."""
    groups = {}
    for r in results:
        groups.setdefault((r["model"], r["reduction"]), []).append(r)
    mean = {k: sum(r["test_accuracy"] for r in v) / len(v) for k, v in groups.items()}
    lines = ["| model | reduction | test accuracy per seed | mean | vs dense (points) | within 1 point "
             "| final train loss | wall (s) |", "|---|---|---|---|---|---|---|---|"]
    for (model, reduction), runs in groups.items():
        runs = sorted(runs, key=lambda r: r.get("seed", 0))
        base = mean.get((model, "bucketed"))
        m = mean[(model, reduction)]
        diff = "" if base is None or reduction == "bucketed" else f"{100 * (m - base):+.2f}"
        ok = "" if diff == "" else ("yes" if abs(100 * (m - base)) <= 1.0 else "no")
        seeds = ", ".join(f"{100 * r['test_accuracy']:.2f} ({r.get('seed', 0)})" for r in runs)
        loss = sum(r["train_loss_by_epoch"][-1] for r in runs) / len(runs)
        wall = sum(r["wall_s"] for r in runs) / len(runs)
        lines.append(f"| {model} | {reduction} | {seeds} | {100 * m:.2f}% | {diff} | {ok} | {loss:.4f} | {wall:.0f} |")
    return "\n".join(lines)


class OneLineErrors(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"lossy_accuracy: error: {message}\n")


def main(argv=None):
    p = OneLineErrors(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=DATA, help=f"Fashion-MNIST IDX directory (default {DATA})")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps_per_epoch", type=int, default=0, help="cap per epoch (default: the whole set)")
    p.add_argument("--seeds", default="0", help="comma list of seeds, each a run per model and reduction")
    p.add_argument("--models", default="simplecnn,resnet20_cifar10")
    p.add_argument("--reductions", default="bucketed,fp16,topk:0.01")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--out", help="JSON file of the results")
    p.add_argument("--from_json", nargs="+", help="print the table of saved runs (merged) and exit")
    p.add_argument("--quick", action="store_true", help="1 epoch of 20 steps per run")
    args = p.parse_args(argv)
    if args.from_json:
        print(table([r for path in args.from_json for r in json.load(open(path))["results"]]))
        return 0
    if not os.path.isdir(args.data):
        p.error(f"--data {args.data}: no such directory; expected the Fashion-MNIST IDX files "
                "(apt-get install dataset-fashion-mnist)")
    reductions = args.reductions.split(",")
    for r in reductions:
        if r not in ("blocking", "per_layer", "bucketed", "hierarchical", "fp16", "stale") and not r.startswith(
                ("topk:", "topkmc:", "oktopk:", "oktopkmc:", "powersgd:", "local_sgd:", "stale:")):
            p.error(f"--reductions: {r!r}; expected blocking, per_layer, bucketed, hierarchical, fp16, stale[:MOMENTUM], topk:DENSITY "
                    "or topkmc:DENSITY (either with :WARMUP_EPOCHS and/or :layer), oktopk:DENSITY or "
                    "oktopkmc:DENSITY (either with :WARMUP_EPOCHS), powersgd:RANK[:START_STEP], "
                    "local_sgd:H[:POST_LOCAL_STEPS]")
    if "bucketed" in reductions:
        reductions = ["bucketed"] + [r for r in reductions if r != "bucketed"]
    if args.quick:
        args.epochs, args.steps_per_epoch = 1, 20
    workdir = tempfile.mkdtemp(prefix="pydtnn-lossy-")
    results = []
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
        runs = [(m, r, s) for m in args.models.split(",") for s in seeds for r in reductions]
        for i, (model, reduction, seed) in enumerate(runs, 1):
            r = run_one(model, reduction, seed, args, workdir)
            results.append(r)
            print(f"[{i}/{len(runs)}] {model} {reduction} seed {seed}: test accuracy "
                  f"{100 * r['test_accuracy']:.2f}%, {r['wall_s']:.0f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"np": args.np, "epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch,
                       "data": args.data, "results": results}, f, indent=1)
        os.replace(tmp, args.out)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
