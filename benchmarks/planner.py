"""The planner against measurement: for each case (a model, a process count, a network), the planner's first
layouts and the default data-parallel run, each trained and timed; the regret (the measured step of the
planner's first choice over the best measured step among them) and the rank correlation of the predicted and
measured orders.

    python benchmarks/planner.py [--out docs/planner_benchmark.json] [--plot docs/perfmodel_planner.png]
                                 [--machine F] [--models M1,M2]
                                 [--networks unlimited,1gbit,200mbit,1gbit-2nodes] [--top 5] [--warmup 2]
                                 [--steps 5] [--rounds 2] [--only TEXT] [--resume]
    python benchmarks/planner.py --from_json docs/planner_benchmark.json      # the table and plot again

Cases: each model of --models (vgg11bn_cifar10, resnet20_cifar10, mobilenetv1_cifar10 and vgg16_cifar10 by default)
at np 2 and 4, 128 samples a step over the job, SGD with momentum, on each network of --networks: shared memory
("unlimited"), a rate that benchmarks/netem.py emulates on one node ("1gbit", every rank in one namespace over
TCP), or on two nodes ("1gbit-2nodes": np/2 ranks in each of two namespaces, shared memory inside a node, a veth
pair capped at the rate each way between them). VGG-11-BN and VGG-16 are not run at 200 Mbit/s, where a case would
take a quarter of an hour. The planner (pydtnn.perfmodel.planner.plan) predicts on --machine, with the emulated
link from a probe of it as benchmarks/sharding.py does (on two nodes: the inter-node link, np/2 processes and half
the cores per node, the MPI's node-aware allreduce, Machine.node_aware_collectives); its first --top layouts are
taken (a bucket size's variants of one layout counted once), and `--parallel data` (the bucketed reducer at 25 MB)
beside them. The first is the planner's choice (the default kept where nothing is predicted more than
planner.MARGIN faster); the regret of the fastest predicted one is reported beside it. Each is trained in fresh
processes for --warmup untimed and --steps timed steps, --rounds times (interleaved: every layout once, then again;
its least step kept), on random images written as CIFAR-10 files (benchmarks/parallelism.py's write_dataset: a
small test set), one thread per process, every convolution with its threshold algorithm (--conv_autotune false, as
the model costs it); a step is the slowest rank's span, the median over the timed steps
(perfmodel_validation.run_traced).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import parallelism  # noqa: E402
import perfmodel_validation as validation  # noqa: E402

from pydtnn.perfmodel import planner  # noqa: E402
from pydtnn.perfmodel.mpi_links import mpiexec_path  # noqa: E402

MODELS = ("vgg11bn_cifar10", "resnet20_cifar10", "mobilenetv1_cifar10", "vgg16_cifar10")
NPS = (2, 4)
GLOBAL_BATCH = 128
RUN_TIMEOUT_S = 1800
# 113 MB (VGG-11-BN) and 59 MB (VGG-16) of gradients: seconds a step at 200 Mbit/s, a quarter of an hour a case
SKIPPED = {("vgg11bn_cifar10", "200mbit"), ("vgg16_cifar10", "200mbit")}
TWO_NODES = "-2nodes"  # a network's suffix: the rate between two emulated nodes


def label(case):
    return f"{case['model']} np{case['np']} {case['network']}"


def rate_and_nodes(network):
    """("1gbit", 2) of "1gbit-2nodes", ("1gbit", 1) of "1gbit"."""
    return (network[: -len(TWO_NODES)], 2) if network.endswith(TWO_NODES) else (network, 1)


def machine_for(base, case, link):
    """The machine of a case: perfmodel_validation.machine_for on one node; on two nodes np/2 processes on each,
    half of base's cores each (the emulated nodes share this machine's), base's intra-node link (shared memory),
    the probed link between them (sockets: Link.background), the MPI composing its allreduce over the nodes."""
    if rate_and_nodes(case["network"])[1] == 1:
        return validation.machine_for(base, case["np"], link)
    m = dataclasses.replace(base, processes_per_node=case["np"] // 2, cores=max(1, base.cores // 2),
                            node_aware_collectives=True)
    return m.with_link("inter", bandwidth=link["bandwidth_bytes_per_s"], latency=link["latency_s"], background=True)


def without_bucket(flags):
    out = list(flags)
    if "--bucket_size_mb" in out:
        i = out.index("--bucket_size_mb")
        del out[i : i + 2]
    return tuple(out)


def picked(choices, top):
    """The first `top` choices, a bucket size's variants of one layout counted once, and the default run."""
    out, seen = [], set()
    for c in choices:
        key = without_bucket(c.flags)
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == top:
            break
    default = next(c for c in choices if c.flags == planner.DEFAULT)
    fastest = min(choices, key=lambda c: c.step_s)  # below the default where the margin keeps it first
    for c in (default, fastest):
        if all(c is not o for o in out):
            out.append(c)
    return out


def command(case, flags, common, dataset, trace, warmup, steps):
    train = [sys.executable, "-m", "pydtnn", *common, *flags, *dataset, "--steps_per_epoch", str(warmup + steps),
             "--num_epochs", "1", "--learning_rate", validation.LR, "--tracing", "--tracer_output", trace,
             "--progress", "false", "--threads_per_process", "1", "--conv_autotune", "false"]
    train = [mpiexec_path(), "-n", str(case["np"]), *train]
    rate, nodes = rate_and_nodes(case["network"])
    return train if rate == "unlimited" else [*validation.under_netem(rate, case["np"], nodes), *train]


def spearman(xs, ys):
    """Spearman's rank correlation of two equal-length lists (average ranks for ties); None under 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return num / den if den else None


def summarize(case):
    """The case's regret and rank correlation from its measured runs."""
    runs = case["runs"]
    best = min(r["measured_s"] for r in runs)
    case["regret"] = runs[0]["measured_s"] / best
    case["regret_fastest"] = min(runs, key=lambda r: r["predicted_s"])["measured_s"] / best  # without the margin
    case["best"] = min(runs, key=lambda r: r["measured_s"])["flags"]
    case["spearman"] = spearman([r["predicted_s"] for r in runs], [r["measured_s"] for r in runs])
    return case


def measure_case(case, layouts, common, dataset, tmp, args):
    """[{flags, predicted_s, measured_s, rounds_s}] of `layouts` (Choices), each trained --rounds times, the
    rounds interleaved (every layout once, then again), so that a spell of a slower machine falls on all of
    them alike; a layout's step is the least of its rounds' (a quiet machine's)."""
    rounds = {c.flags: [] for c in layouts}
    for r in range(args.rounds):
        for c in layouts:
            trace = os.path.join(tmp, "trace.json")
            meas, _, _ = validation.run_traced(command(case, c.flags, common, dataset, trace, args.warmup, args.steps),
                                               validation.thread_env(1), tmp, trace, case["np"], args.warmup, 0.0,
                                               f"{label(case)} {' '.join(c.flags)}", RUN_TIMEOUT_S)
            rounds[c.flags].append(meas["step_s"])
            print(f"  round {r + 1}: {' '.join(c.flags)}: predicted {1e3 * c.step_s:.0f} ms, measured "
                  f"{1e3 * meas['step_s']:.0f} ms", file=sys.stderr, flush=True)
    return [{"flags": list(c.flags), "predicted_s": c.step_s, "measured_s": min(rounds[c.flags]),
             "rounds_s": rounds[c.flags]} for c in layouts]


def drive(args):
    from pydtnn import models
    from pydtnn.perfmodel import machine as machines

    t0 = time.perf_counter()
    base = machines.load(args.machine)
    networks = args.networks.split(",")
    refusal = validation.netem_refusal() if any(n != "unlimited" for n in networks) else None
    if refusal:
        print(f"planner: the emulated networks skipped: {refusal}", file=sys.stderr)
        networks = ["unlimited"]
    links = {net: validation.probe_link(rate, nps=(2,) if nodes == 1 else (2, 4), nodes=nodes)
             for net in networks if net != "unlimited" for rate, nodes in [rate_and_nodes(net)]}
    saved = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            saved = {label(c): c for c in json.load(f)["cases"]}
    run = {"host": validation.host(), "commit": validation.commit(), "machine_file": os.path.relpath(args.machine, ROOT),
           "global_batch_size": GLOBAL_BATCH, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
           "margin": planner.MARGIN,
           "links": links, "cases": [], "wall_s": 0.0}
    cases = [{"model": m, "np": n, "network": net} for net in networks for m in args.models.split(",") for n in NPS
             if (m, net) not in SKIPPED]
    cases = [c for c in cases if not args.only or args.only in label(c)]
    with tempfile.TemporaryDirectory(prefix="planner-") as tmp:
        for i, case in enumerate(cases):
            if label(case) in saved:
                run["cases"].append(saved[label(case)])
                continue
            m = machine_for(base, case, links.get(case["network"]))
            per_node = case["np"] // 2 if rate_and_nodes(case["network"])[1] == 2 and case["np"] > 2 else None
            choices, _, common = planner.plan(case["model"], case["np"], m, GLOBAL_BATCH, optimizer="sgd",
                                              ranks_per_node=per_node, with_memory=False)
            dataset = parallelism.write_dataset(os.path.join(tmp, case["model"]), *models.defaults(case["model"]),
                                                train_samples=4 * GLOBAL_BATCH)
            case.update(commit=run["commit"], common=list(common),
                        runs=measure_case(case, picked(choices, args.top), common, dataset, tmp, args))
            run["cases"].append(summarize(case))
            save(run, args.out, t0)  # every case saved as it is measured
            print(f"[{i + 1}/{len(cases)}] {label(case)}: regret {case['regret']:.3f}, rank correlation "
                  f"{case['spearman'] if case['spearman'] is None else round(case['spearman'], 2)}", file=sys.stderr,
                  flush=True)
    save(run, args.out, t0)  # and the saved cases after the last one measured (--resume)
    return run


def save(run, path, t0):
    run["wall_s"] = time.perf_counter() - t0
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=1)


def spread(case):
    """How far apart one layout's rounds fall, the median over the case's layouts: (slowest - fastest) / fastest;
    None without rounds. A regret below it is within the machine's own variation."""
    apart = [(max(r["rounds_s"]) - min(r["rounds_s"])) / min(r["rounds_s"]) for r in case["runs"]
             if len(r.get("rounds_s", ())) > 1]
    return statistics.median(apart) if apart else None


def table(run):
    lines = ["| model | network | np | planner's choice | predicted ms | measured ms | best measured | best ms | regret "
             "| rank correlation | rounds apart |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for c in run["cases"]:
        first, best = c["runs"][0], min(c["runs"], key=lambda r: r["measured_s"])
        rho = "" if c["spearman"] is None else f"{c['spearman']:+.2f}"
        apart = spread(c)
        lines.append(f"| {c['model']} | {c['network']} | {c['np']} | `{' '.join(first['flags'])}` | "
                     f"{1e3 * first['predicted_s']:.0f} | {1e3 * first['measured_s']:.0f} | "
                     f"`{' '.join(best['flags'])}` | {1e3 * best['measured_s']:.0f} | {c['regret']:.3f} | {rho} | "
                     f"{'' if apart is None else f'{100 * apart:.0f}%'} |")
    regrets = [c["regret"] for c in run["cases"]]
    rhos = [c["spearman"] for c in run["cases"] if c["spearman"] is not None]
    lines.append("")
    lines.append(f"regret: median {statistics.median(regrets):.3f}, worst {max(regrets):.3f} over {len(regrets)} "
                 f"cases; rank correlation: median {statistics.median(rhos):+.2f}" if rhos else "")
    apart = [(c["regret"], spread(c)) for c in run["cases"] if spread(c) is not None]
    if apart:
        lines.append(f"rounds apart: median {100 * statistics.median(a for _, a in apart):.0f}%; a regret beyond its "
                     f"case's rounds apart in {sum(r - 1 > a for r, a in apart)} of {len(apart)} cases")
    fastest = [c["regret_fastest"] for c in run["cases"] if "regret_fastest" in c]
    if fastest:
        lines.append(f"the fastest predicted layout instead of the choice (no margin): regret median "
                     f"{statistics.median(fastest):.3f}, worst {max(fastest):.3f}")
    return "\n".join(lines)


def plot(run, path):
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    colors = colormaps["tab20"]
    fig = Figure(figsize=(13, 4.4 if len(run["cases"]) <= 16 else 5.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    names = [label(c) for c in run["cases"]]
    left.barh(range(len(names)), [c["regret"] for c in run["cases"]], color="C0")
    left.axvline(1.05, color="k", ls=":", lw=0.8)
    left.axvline(1.15, color="k", ls="--", lw=0.8)
    left.set_yticks(range(len(names)), names, fontsize=7)
    left.set_xlim(0.95, max(1.2, 1.02 * max(c["regret"] for c in run["cases"])))
    left.set_xlabel("regret: the choice's measured step / the best measured (dotted 1.05, dashed 1.15)")
    for k, c in enumerate(run["cases"]):
        xs = [1e3 * r["measured_s"] for r in c["runs"]]
        ys = [1e3 * r["predicted_s"] for r in c["runs"]]
        right.scatter(xs, ys, s=14, color=colors(k % 20), label=label(c))
        right.scatter(xs[:1], ys[:1], s=60, facecolors="none", edgecolors=colors(k % 20))
    top = max(max(1e3 * r["measured_s"], 1e3 * r["predicted_s"]) for c in run["cases"] for r in c["runs"])
    right.plot([0, top], [0, top], color="k", lw=0.8)
    right.set_xscale("log")
    right.set_yscale("log")
    ticks = [t for t in (100, 200, 300, 500, 1000, 2000, 3000, 5000, 10000, 20000) if t <= 1.2 * top]
    for axis in (right.xaxis, right.yaxis):
        axis.set_minor_formatter(NullFormatter())
        axis.set_ticks(ticks, [f"{t:g}" for t in ticks])
    right.set_xlabel("measured step (ms)")
    right.set_ylabel("predicted step (ms)")
    right.legend(fontsize=6 if len(names) <= 16 else 5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    right.set_title("each case's measured layouts (circled: the planner's choice)", fontsize=9)
    fig.suptitle(f"The planner against measurement ({run['host']}, one thread per process)", fontsize=10)
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "planner_benchmark.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "perfmodel_planner.png"))
    p.add_argument("--machine", default=os.path.join(ROOT, "docs", "machine_xeon_avx512.yaml"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--networks", default="unlimited,1gbit,200mbit,1gbit-2nodes",
                   help="unlimited (shared memory), a rate on one emulated node (1gbit), or on two (1gbit-2nodes)")
    p.add_argument("--top", type=int, default=5, help="the planner's first layouts measured (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="times each layout is measured, interleaved (default 2)")
    p.add_argument("--only", help="only the cases whose label contains this text")
    p.add_argument("--resume", action="store_true", help="keep the cases --out already holds, measure the rest")
    p.add_argument("--from_json", help="the table and plot of a saved run")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            run = json.load(f)
    else:
        run = drive(args)
    print(f"{run['host']}; pydtnn {run['commit']}; {len(run['cases'])} cases; {run['wall_s']:.0f} s")
    print(table(run))
    if args.plot:
        plot(run, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
