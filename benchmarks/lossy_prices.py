"""The performance model's prices of the lossy reductions against their measured steps on the emulated networks.

    python benchmarks/lossy_prices.py [--measured docs/scaling_network_round2.json]
                                      [--links docs/planner_benchmark_epyc.json] [--machine docs/machine_epyc_avx2.yaml]
                                      [--json docs/lossy_prices.json] [--plot docs/perfmodel_lossy_prices.png]

Measured: benchmarks/scaling.py's records (pydtnn's steps, batch 32 per process, SGD with momentum, one thread per
process) of each reducer of the second round (powersgd, oktopk, local SGD, one step stale) beside bucketed and
topk, np 2 and 4, on the 1 Gbit/s and 200 Mbit/s emulated networks (benchmarks/netem.py's one namespace). A local
SGD record's step is its mean over the timed steps, one of which averages the replicas, as the model prices it.

Predicted: `pydtnn-train --simulate`'s own path (perfmodel.simulate.predict_run) for the same flags on the machine
file, with each network as benchmarks/perfmodel_validation.py models it (machine_for: every rank on one node, the
probed link's latency, its rate shared by the ranks, TCP moving posted bytes on its own). The links are those
benchmarks/planner.py probed on this machine type (its JSON's "links"). Nothing is measured here: it takes seconds.

Reported: each record's predicted and measured step and their error; each (model, network, np) case's
reducers ranked by both (Spearman's rank correlation), and each reducer's step over bucketed's, predicted and
measured.
"""

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

STRATEGIES = ("bucketed", "topk:0.01", "oktopk:0.01", "powersgd:4", "local_sgd:4", "stale", "bucketed+thread",
              "stale+thread")


def flags_of(strategy):
    """pydtnn-train's flags of a benchmarks/scaling.py strategy name ("powersgd:4", "stale+thread", ...)."""
    base, _, progress = strategy.partition("+")
    name, _, arg = base.partition(":")
    flags = {"topk": ["--reduction", "topk", "--density", arg], "oktopk": ["--reduction", "oktopk", "--density", arg],
             "powersgd": ["--reduction", "powersgd", "--rank", arg], "local_sgd": ["--local_sgd", arg],
             "stale": ["--reduction_staleness", "1"]}.get(name, ["--reduction", name])
    return flags + (["--reduction_progress", "thread"] if progress == "thread" else [])


def predict(record, machine, link, built):
    """The predicted step (seconds) of a scaling.py record on `machine` over the probed `link`."""
    import perfmodel_validation as validation

    from pydtnn.flags import build_parser
    from pydtnn.perfmodel.simulate import build_model, predict_run

    argv = ["--model", record["model"], "--batch_size", str(record["batch"]), "--parallel", "data",
            "--threads_per_process", "1", "--optimizer", "sgd", "--momentum", "0.9", *flags_of(record["strategy"])]
    args = build_parser().parse_args(argv)
    args.np = record["np"]
    if record["model"] not in built:
        built[record["model"]] = build_model(record["model"])
    name, model = built[record["model"]]
    p, _ = predict_run(args, record["np"], validation.machine_for(machine, record["np"], link), name, model,
                       with_memory=False)
    return p.step_s


def spearman(a, b):
    """Spearman's rank correlation of two equal-length lists (no ties expected)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else float("nan")


def rows_of(measured, links, machine):
    rows, built = [], {}
    for r in measured["records"]:
        if r["lib"] != "pydtnn" or r["np"] < 2 or r["strategy"] not in STRATEGIES or r.get("net") not in links:
            continue
        predicted = predict(r, machine, links[r["net"]], built)
        rows.append({"model": r["model"], "network": r["net"], "np": r["np"], "strategy": r["strategy"],
                     "measured_s": r["step_s"], "predicted_s": predicted, "error": predicted / r["step_s"] - 1})
        print(f"{r['model']} {r['net']} np {r['np']} {r['strategy']}: measured {r['step_s']:.3f} s, predicted "
              f"{predicted:.3f} s ({100 * rows[-1]['error']:+.0f}%)", file=sys.stderr, flush=True)
    return rows


def report(rows, host):
    lines = [f"{host}; the step of the slowest rank, batch 32 per process", "",
             "| model | network | np | reducer | measured s | predicted s | error | measured x bucketed | "
             "predicted x bucketed |", "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    cases = {}
    for r in rows:
        cases.setdefault((r["model"], r["network"], r["np"]), []).append(r)
    correlations = []
    for (model, net, np_), group in cases.items():
        base = next((g for g in group if g["strategy"] == "bucketed"), None)
        for g in group:
            rel = (f"{g['measured_s'] / base['measured_s']:.2f} | {g['predicted_s'] / base['predicted_s']:.2f}"
                   if base else " | ")
            lines.append(f"| {model} | {net} | {np_} | {g['strategy']} | {g['measured_s']:.3f} | "
                         f"{g['predicted_s']:.3f} | {100 * g['error']:+.0f}% | {rel} |")
        if len(group) > 2:
            correlations.append((model, net, np_, spearman([g["measured_s"] for g in group],
                                                           [g["predicted_s"] for g in group])))
    lines += ["", "| model | network | np | reducers | rank correlation |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {m} | {n} | {p} | {len(cases[m, n, p])} | {c:+.2f} |" for m, n, p, c in correlations]
    by = {}
    for r in rows:
        by.setdefault(r["strategy"].split(":")[0], []).append(abs(r["error"]))
    lines += ["", "median |error| by reducer: " + ", ".join(f"{k} {100 * statistics.median(v):.0f}%"
                                                            for k, v in by.items()),
              f"all {len(rows)}: median |error| {100 * statistics.median(abs(r['error']) for r in rows):.0f}%"]
    return "\n".join(lines), correlations


def plot(rows, path, host):
    from parity import parity_plot

    groups = {k: [(r["measured_s"], r["predicted_s"]) for r in rows if r["strategy"] == k]
              for k in sorted({r["strategy"] for r in rows})}
    parity_plot(path, groups, 1.25, "measured step (s)", "predicted step (s)",
                f"Lossy reductions on emulated networks, np 2 and 4 ({host})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", default=os.path.join(ROOT, "docs", "scaling_network_round2.json"))
    p.add_argument("--links", default=os.path.join(ROOT, "docs", "planner_benchmark_epyc.json"),
                   help="a JSON with the probed links under 'links' (benchmarks/planner.py's)")
    p.add_argument("--machine", default=os.path.join(ROOT, "docs", "machine_epyc_avx2.yaml"))
    p.add_argument("--json", help="every row and the rank correlations, as JSON")
    p.add_argument("--plot", help="predicted against measured, a PNG")
    args = p.parse_args(argv)
    from pydtnn.perfmodel import machine as machines

    with open(args.measured, encoding="utf-8") as f:
        measured = json.load(f)
    with open(args.links, encoding="utf-8") as f:
        links = json.load(f)["links"]
    machine = machines.load(args.machine)
    rows = rows_of(measured, links, machine)
    host = f"measured on {measured['machine']['cpu']} ({measured['machine']['cpus']} cores), predicted on {machine.name}"
    text, correlations = report(rows, host)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"host": host, "measured": os.path.relpath(args.measured, ROOT),
                       "machine": os.path.relpath(args.machine, ROOT), "rows": rows,
                       "rank_correlations": [{"model": m, "network": n, "np": p_, "spearman": c}
                                             for m, n, p_, c in correlations]}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, measured["machine"]["cpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
