"""Whole training steps of this checkout against another checkout of pydtnn, alternating, in fresh processes.

    python benchmarks/ab_step.py --baseline DIR [--models simplecnn,vgg11_cifar10,resnet20_cifar10,mobilenetv1_cifar10]
                                 [--batches 32,64] [--threads 1,2] [--rounds 3] [--out FILE.md] [--json FILE]

DIR is another checkout (e.g. `git worktree add /tmp/base <commit>`). Each configuration is measured
--rounds times, the baseline and this checkout back to back in each round, each in a fresh process
(train_step.py's pydtnn worker with PYTHONPATH pointing at the checkout measured), so both see the
machine's slow and fast minutes alike: a change of code is told from a change of machine by the
per-round ratios, which a comparison of two separate runs cannot do. Same models, initial weights
(checked by SHA-256), data, warm-up and timed steps as train_step.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step  # noqa: E402  (the worker, its idle wait and its retries)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(path):
    r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--", "pydtnn"], capture_output=True,
                           text=True, check=False).stdout.strip()
    return (r.stdout.strip() or "?") + (" plus uncommitted changes" if dirty else "")


def measure(source, name, batch, threads, steps, args, prepared, tmp):
    """One worker of train_step.py importing pydtnn from `source`."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = source
    try:
        return train_step.run_worker("pydtnn", name, batch, threads, steps, args, prepared, tmp)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="another pydtnn checkout (a folder holding pydtnn/)")
    p.add_argument("--models", default=",".join(train_step.MODELS))
    p.add_argument("--batches", default="32,64")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, help="timed steps of every model (default: train_step.py's per model)")
    p.add_argument("--wait_idle", type=float, default=15)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--conv_autotune", action="store_true",
                   help="both checkouts measure each layer's convolution algorithm first (train_step.py's flag)")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--json", help="also write every record here")
    args = p.parse_args(argv)
    baseline = os.path.abspath(args.baseline)
    if not os.path.isdir(os.path.join(baseline, "pydtnn")):
        p.error(f"--baseline {args.baseline!r} holds no pydtnn/ folder; expected a checkout of pydtnn")
    sources = {"baseline": baseline, "this": HERE}
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            prepared = train_step.prepare(name, tmp)
            steps = args.steps or train_step.STEPS.get(name, 10)
            for batch in map(int, args.batches.split(",")):
                for threads in map(int, args.threads.split(",")):
                    runs = {k: [] for k in sources}
                    for _ in range(args.rounds):
                        for k, src in sources.items():
                            runs[k].append(measure(src, name, batch, threads, steps, args, prepared, tmp))
                    rows.append({"model": name, "batch": batch, "threads": threads,
                                 **{k: [r["step_ms"] for r in v] for k, v in runs.items()},
                                 "foreign_cores": max(r["foreign_cores"] or 0.0 for v in runs.values() for r in v)})
    lines = [f"This checkout {commit(HERE)} against {commit(baseline)} ({baseline}); {args.rounds} rounds, each the "
             f"baseline then this checkout in fresh processes; ms/step is the median of a round's timed steps. "
             f"Wall time {time.perf_counter() - t0:.0f} s.", "",
             "| model | batch | threads | baseline ms/step (rounds) | this ms/step (rounds) | this / baseline per round "
             "| median ratio |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratios = []
    for r in rows:
        per_round = [t / b for t, b in zip(r["this"], r["baseline"])]
        ratios.append(statistics.median(per_round))
        fmt = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
        lines.append(f"| {r['model']} | {r['batch']} | {r['threads']} | {statistics.median(r['baseline']):.1f} "
                     f"({fmt(r['baseline'])}) | {statistics.median(r['this']):.1f} ({fmt(r['this'])}) | "
                     f"{', '.join(f'{x:.2f}' for x in per_round)} | {ratios[-1]:.2f} |")
    lines += ["", f"Median ratio over configurations {statistics.median(ratios):.3f}, from {min(ratios):.2f} to "
                  f"{max(ratios):.2f}; other processes used at most "
                  f"{max(r['foreign_cores'] for r in rows):.2f} cores during a timed run."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"baseline": commit(baseline), "this": commit(HERE), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
