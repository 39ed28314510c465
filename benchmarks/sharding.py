"""ZeRO's stages against plain data parallelism: per-process peak memory and step time, with the models'
predictions beside them.

    python benchmarks/sharding.py [--out docs/sharding_benchmark.json] [--plot docs/benchmarks_sharding.png]
                                  [--machine docs/machine_xeon_avx512.yaml] [--quick] [--only TEXT]

For each model (vgg16_cifar10, 33.6 M parameters, 32 samples per process; resnet50_imagenet, 25.6 M, 2 per
process; resnet20_cifar10, 0.27 M, 32 per process), Adam, np 1 and --zero 0, 1, 2, 3 at np 2 and 4, on shared
memory, and VGG-16 and ResNet-20 at np 2 and 4 on the emulated 1 Gbit/s link too (benchmarks/netem.py),
every convolution with its threshold algorithm (--conv_autotune false, as the model costs it):

- step: pydtnn-train on random images (--use_synthetic_data), traced; the median over the timed steps of
  the slowest rank's step (perfmodel_validation.run_traced), predicted by pydtnn.perfmodel.predict on
  --machine (the emulated link from a probe of it, shared by the processes);
- memory: each process's traced peak over training steps (benchmarks/memory_worker.py, network-independent,
  measured once per model, stage and np), the busiest process's, predicted by
  pydtnn.perfmodel.memory.predict_memory; and pydtnn-train's peak resident set (GNU time), which adds the
  interpreter, the libraries, the data and MPI's buffers, set against the traced prediction plus a process
  baseline at the same process count and network (measure_baseline: a small model's run, less its prediction);
  --rss_only measures the resident sets and the baselines of a saved run again.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import memory_validation  # noqa: E402
import perfmodel_validation as validation  # noqa: E402

from pydtnn.perfmodel.mpi_links import mpiexec_path  # noqa: E402

MODELS = {"vgg16_cifar10": 32, "resnet50_imagenet": 2, "resnet20_cifar10": 32}  # batch per process
NETWORKS = ("unlimited", "1gbit")
EMULATED = ("vgg16_cifar10", "resnet20_cifar10")
RUN_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    batch: int  # per process
    np: int
    zero: int
    network: str = "unlimited"

    @property
    def label(self):
        return f"{self.model} B{self.batch} np{self.np} zero{self.zero} {self.network}"


def configs(quick=False):
    if quick:
        return [Config("resnet20_cifar10", 16, 2, z) for z in (0, 1, 2)]
    out = []
    for network in NETWORKS:
        for model, batch in MODELS.items():
            out.append(Config(model, batch, 1, 0, network))
            out += [Config(model, batch, n, z, network) for n in (2, 4) for z in (0, 1, 2, 3)]
    # the emulated link: the models whose steps there take seconds, not tens of seconds
    return [c for c in out if c.network == "unlimited" or (c.np > 1 and c.model in EMULATED)]


def command(config, trace, warmup, steps, rss):
    train = [sys.executable, "-m", "pydtnn", "--model", config.model, "--batch_size", str(config.batch),
             "--use_synthetic_data", "true", "--optimizer", "adam", "--zero", str(config.zero),
             "--steps_per_epoch", str(warmup + steps), "--num_epochs", "1", "--tracing", "--tracer_output", trace,
             "--progress", "false", "--threads_per_process", "1", "--learning_rate_scaling", "false",
             "--conv_autotune", "false"]
    if os.path.exists("/usr/bin/time"):
        train = ["/usr/bin/time", "-f", "%M", "-a", "-o", rss, *train]
    train = [mpiexec_path(), "-n", str(config.np), *train]
    if config.network != "unlimited":
        train = [sys.executable, validation.NETEM, "--rate", config.network, "--", *train]
    return train


def measure_step(config, warmup, steps, wait_s, tmp):
    trace, rss = os.path.join(tmp, "trace.json"), os.path.join(tmp, "rss.txt")
    if os.path.exists(rss):
        os.remove(rss)
    m, wall, foreign = validation.run_traced(command(config, trace, warmup, steps, rss), validation.thread_env(1),
                                             tmp, trace, config.np, warmup, wait_s, config.label, RUN_TIMEOUT_S)
    peak = None
    if os.path.exists(rss):
        with open(rss, encoding="utf-8") as f:
            peak = max(int(line) for line in f if line.strip().isdigit()) / 1024
    return {"step_s": m["step_s"], "phases_s": m["phases_s"], "wall_s": wall, "foreign_cores": foreign,
            "peak_rss_mb": peak}


def predicted(config, model, base, link):
    from pydtnn.perfmodel.memory import predict_memory
    from pydtnn.perfmodel.predict import predict

    machine = validation.machine_for(base, config.np, link)
    p = predict(model, config.batch, config.np, machine, reduction="bucketed", algorithm="best", optimizer="adam",
                zero=config.zero)
    mem = predict_memory(model, config.batch, ("adam", {}), zero=config.zero, replicas=config.np)
    return {"step_s": p.step_s, "exposed_comm_s": p.exposed_comm_s, "update_s": p.update_s,
            "memory_mib": mem.total / 2**20, "memory_parts_mib": {k: v / 2**20 for k, v in mem.parts.items()}}


def peak_rss(argv, env, cwd, label):
    """The largest process's peak resident set (MiB, GNU time's %M) of pydtnn-train command `argv` (command())."""
    import subprocess

    out = os.path.join(cwd, "rss.txt")
    if os.path.exists(out):
        os.remove(out)
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    if r.returncode:
        raise RuntimeError(f"{label}: exit status {r.returncode}\n{r.stderr[-2000:]}")
    with open(out, encoding="utf-8") as f:
        return max(int(line) for line in f if line.strip().isdigit()) / 1024


def measure_baseline(np_=1, network="unlimited"):
    """MiB a training process holds beside its training state at np_ processes on `network`: the peak resident
    set (GNU time) of pydtnn-train on simplecnn (0.1 M parameters), random images, Adam, batch 32, as command()
    runs a configuration, less the memory model's traced peak of its step: the interpreter, the libraries,
    their compiled kernels, the data, and MPI's buffers for np_ - 1 peers."""
    from pydtnn import models
    from pydtnn.perfmodel.memory import predict_memory

    c = Config("simplecnn", 32, np_, 0, network)
    with tempfile.TemporaryDirectory(prefix="sharding-rss-") as tmp:
        rss = peak_rss(command(c, os.path.join(tmp, "trace.json"), 1, 1, os.path.join(tmp, "rss.txt")),
                       validation.thread_env(1), tmp, c.label)
    return rss - predict_memory(models.create("simplecnn"), 32, ("adam", {})).total / 2**20


def baseline_key(config):
    return f"np{config.np} {config.network}"


def measure_baselines(configs_):
    """{baseline_key: measure_baseline} for every process count and network among configs_."""
    keys = {baseline_key(c): (c.np, c.network) for c in configs_}
    return {k: measure_baseline(n, network) for k, (n, network) in sorted(keys.items())}


def remeasure_rss(path, warmup, steps, only=None, resume=False):
    """Measure again the peak resident set of the points of the run saved at `path` whose label contains `only`
    (pydtnn-train, as the timed run, its steps not timed) and the process baselines, and save them (the steps
    and the traced peaks kept). resume: the points and baselines measured by an earlier call kept."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    cs = [Config(**p["config"]) for p in run["points"]]
    if not (resume and isinstance(run.get("baseline_rss_mib"), dict)):
        run["baseline_rss_mib"] = measure_baselines(cs)
    print(f"baselines: {run['baseline_rss_mib']}", file=sys.stderr, flush=True)
    commit = validation.commit()
    with tempfile.TemporaryDirectory(prefix="sharding-rss-") as tmp:
        for i, (c, p) in enumerate(zip(cs, run["points"])):
            if (only and only not in c.label) or (resume and "rss_commit" in p["measured"]):
                continue
            argv = command(c, os.path.join(tmp, "trace.json"), warmup, steps, os.path.join(tmp, "rss.txt"))
            p["measured"]["peak_rss_mb"] = peak_rss(argv, validation.thread_env(1), tmp, c.label)
            p["measured"]["rss_commit"] = commit
            with open(path, "w", encoding="utf-8") as f:
                json.dump(run, f, indent=1)
            print(f"[{i + 1}/{len(cs)}] {c.label}: RSS {p['measured']['peak_rss_mb']:.0f} MiB", file=sys.stderr,
                  flush=True)
    return run


def rss_errors(run):
    """[(label, predicted peak RSS MiB: the traced prediction plus the run's process baseline at the point's
    process count and network, measured)]."""
    base = run.get("baseline_rss_mib")
    if base is None:
        return []
    def at(p):
        return base if isinstance(base, (int, float)) else base[baseline_key(Config(**p["config"]))]

    return [(p["label"], p["predicted"]["memory_mib"] + at(p), p["measured"]["peak_rss_mb"]) for p in with_rss(run)]


def with_rss(run):
    return [p for p in run["points"] if p["measured"].get("peak_rss_mb")]


def rss_table(run):
    """Markdown: each point's measured peak resident set against the traced prediction plus the baseline."""
    base = run["baseline_rss_mib"]
    lines = ["| model | network | np | ZeRO | process baseline MiB | traced prediction MiB | predicted RSS MiB | "
             "measured RSS MiB | error |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (_, pred, meas), p in zip(rss_errors(run), with_rss(run)):
        c = p["config"]
        b = base if isinstance(base, (int, float)) else base[baseline_key(Config(**c))]
        lines.append(f"| {c['model']} | {c['network']} | {c['np']} | {c['zero']} | {b:.0f} | "
                     f"{p['predicted']['memory_mib']:.0f} | {pred:.0f} | {meas:.0f} | {100 * (pred / meas - 1):+.1f}% |")
    return "\n".join(lines)


def rss_plot(run, path):
    """Predicted against measured peak resident set, one marker per model, one colour per ZeRO stage."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 5.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    rows = list(zip(rss_errors(run), with_rss(run)))
    for model, marker in zip(MODELS, "osD"):
        for z in (0, 1, 2, 3):
            pts = [(meas, pred, p["config"]["network"]) for (_, pred, meas), p in rows
                   if p["config"]["model"] == model and p["config"]["zero"] == z]
            for network, fill in (("unlimited", f"C{z}"), ("1gbit", "none")):
                xy = [(a, b) for a, b, n in pts if n == network]
                if xy:
                    ax.scatter([a for a, _ in xy], [b for _, b in xy], marker=marker, facecolors=fill,
                               edgecolors=f"C{z}", label=f"{model}, ZeRO {z}" if network == "unlimited" else None)
    top = 1.05 * max(max(a, b) for (_, b, a), _ in rows)
    low = 0.8 * min(min(a, b) for (_, b, a), _ in rows)
    for f, style in ((1.0, "-"), (0.9, ":"), (1.1, ":"), (0.8, "--"), (1.2, "--")):
        ax.plot([low, top], [f * low, f * top], color="k", lw=0.8 if f == 1.0 else 0.5, ls=style)
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured peak RSS per process (MiB)")
    ax.set_ylabel("predicted: traced prediction + process baseline (MiB)")
    ax.set_title(f"Peak resident set ({run['host']}; hollow: 1 Gbit/s)\ndotted: +-10%, dashed: +-20%", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    fig.savefig(path, dpi=100)


def drive(args):
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel import machine

    t_start = time.perf_counter()
    base = machine.load(args.machine)
    refusal = validation.netem_refusal()
    if refusal:
        print(f"sharding: the emulated network skipped: {refusal}", file=sys.stderr)
    todo = [c for c in configs(args.quick) if (refusal is None or c.network == "unlimited")
            and (not args.only or args.only in c.label)]
    links = {rate: validation.probe_link(rate, nps=(2,)) for rate in {c.network for c in todo} - {"unlimited"}}
    env = validation.thread_env(1)
    memory, built, points = {}, {}, []
    done, saved = {}, {}
    if args.resume and os.path.exists(args.out):  # a run cut short goes on where it stopped
        with open(args.out, encoding="utf-8") as f:
            saved = json.load(f)
        done = {p["label"]: p for p in saved["points"]}
    run = {**({"notes": saved["notes"]} if "notes" in saved else {}),"host": validation.host(), "commit": validation.commit(),
           "machine_file": os.path.relpath(os.path.abspath(args.machine), ROOT), "netem": refusal or "used",
           "links": links, "points": points, "wall_s": 0.0,
           "baseline_rss_mib": saved.get("baseline_rss_mib") or (measure_baselines(todo)
                                                                if os.path.exists("/usr/bin/time") else None),
           "settings": {"warmup": args.warmup, "steps": args.steps, "threads": 1, "optimizer": "adam",
                        "data": "random images (--use_synthetic_data)", "reduction": "bucketed (default)",
                        "conv_autotune": False}}
    with tempfile.TemporaryDirectory(prefix="sharding-") as tmp:
        for i, c in enumerate(todo):
            if c.label in done:
                points.append(done[c.label])
                continue
            key = (c.model, c.batch, c.np, c.zero)
            if key not in memory:
                memory[key] = _peaks(c, env)
            meas = measure_step(c, args.warmup, args.steps, args.wait_idle, tmp)
            meas["memory_mib"] = max(memory[key]) / 2**20
            meas["per_process_mib"] = [v / 2**20 for v in memory[key]]
            if c.model not in built:
                built[c.model] = models.create(c.model, backend=CPUBackend(seed=0))
            pred = predicted(c, built[c.model], base, links.get(c.network))
            points.append({"label": c.label, "commit": run["commit"], "config": dataclasses.asdict(c), "measured": meas,
                           "predicted": pred})
            run["wall_s"] = time.perf_counter() - t_start
            if not args.quick:  # every point saved as it is measured
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(run, f, indent=1)
            print(f"[{i + 1}/{len(todo)}] {c.label}: step {1e3 * meas['step_s']:.0f} ms (predicted "
                  f"{1e3 * pred['step_s']:.0f}), memory {meas['memory_mib']:.1f} MiB (predicted "
                  f"{pred['memory_mib']:.1f}), RSS {meas['peak_rss_mb'] or 0:.0f} MB", file=sys.stderr, flush=True)
    run["wall_s"] = time.perf_counter() - t_start
    if not args.quick:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(run, f, indent=1)
    return run


def _peaks(c, env):
    """Each process's traced peak bytes of configuration c (benchmarks/memory_worker.py; one process:
    memory_validation's one-process measurement)."""
    if c.np > 1:
        return memory_validation.measure_parallel(c.model, c.batch, "adam", 1, 1, 1, "1f1b", env, c.zero, c.np)
    return [_one_process_peak(c.model, c.batch, env)]


def remeasure_memory(path):
    """Measure again the memory of the points of the run saved at `path` that lack a peak per process (the steps
    kept), and save it."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    env, cache = validation.thread_env(1), {}
    for p in run["points"]:
        c = Config(**p["config"])
        key = (c.model, c.batch, c.np, c.zero)
        if len(p["measured"].get("per_process_mib", [])) == c.np:
            continue
        if key not in cache:
            cache[key] = _peaks(c, env)
            print(f"{c.label}: {max(cache[key]) / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        p["measured"]["memory_mib"] = max(cache[key]) / 2**20
        p["measured"]["per_process_mib"] = [v / 2**20 for v in cache[key]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=1)
    return run


def _one_process_peak(model, batch, env):
    """One process's traced peak (memory_validation's one-process measurement), for np 1."""
    import subprocess

    r = subprocess.run([sys.executable, os.path.join(HERE, "memory_validation.py"), "--measure", model, str(batch),
                        "adam", "1", "none"], capture_output=True, text=True, env=env, timeout=900, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def table(run):
    ms = lambda v: f"{1e3 * v:.0f}"
    lines = ["| model | network | np | ZeRO | step ms | predicted ms | peak MiB (traced) | predicted MiB | "
             "optimizer MiB (predicted) | peak RSS MB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in run["points"]:
        c, m, pr = p["config"], p["measured"], p["predicted"]
        rss = "" if m["peak_rss_mb"] is None else f"{m['peak_rss_mb']:.0f}"
        lines.append(f"| {c['model']} | {c['network']} | {c['np']} | {c['zero']} | {ms(m['step_s'])} | "
                     f"{ms(pr['step_s'])} | {m['memory_mib']:.1f} | {pr['memory_mib']:.1f} | "
                     f"{pr['memory_parts_mib']['optimizer']:.1f} | {rss} |")
    return "\n".join(lines)


def plot(run, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(p["config"]["model"] for p in run["points"]))
    fig = Figure(figsize=(4.2 * len(models), 6.4), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(models), squeeze=False)
    for j, model in enumerate(models):
        mine = [p for p in run["points"] if p["config"]["model"] == model]
        for z, marker in zip((0, 1, 2, 3), "osD^"):
            pts = sorted((p for p in mine if p["config"]["zero"] == z or p["config"]["np"] == 1),
                         key=lambda p: p["config"]["np"])
            mem = [(p["config"]["np"], p["measured"]["memory_mib"], p["predicted"]["memory_mib"]) for p in pts
                   if p["config"]["network"] == "unlimited"]
            ax = axes[0][j]
            ax.plot([a for a, _, _ in mem], [b for _, b, _ in mem], marker=marker, color=f"C{z}", label=f"ZeRO {z}")
            ax.plot([a for a, _, _ in mem], [c for _, _, c in mem], ls="--", color=f"C{z}", lw=0.8)
            for k, network in enumerate(NETWORKS):
                steps = [(p["config"]["np"], p["measured"]["step_s"]) for p in pts
                         if p["config"]["network"] == network or p["config"]["np"] == 1]
                axes[1][j].plot([a for a, _ in steps], [1e3 * b for _, b in steps], marker=marker, color=f"C{z}",
                                ls="-" if k == 0 else ":", label=f"ZeRO {z}, {network}")
        axes[0][j].set_title(model, fontsize=10)
        axes[0][j].set_ylabel("peak per process (MiB, traced)")
        axes[1][j].set_ylabel("step (ms)")
        for ax in axes[:, j]:
            ax.set_xlabel("processes")
            ax.set_xticks([1, 2, 4])
    axes[0][0].legend(fontsize=8, title="measured (dashed: predicted)", title_fontsize=8)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(f"ZeRO stages, Adam ({run['host']}, one thread per process)", fontsize=11)
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "sharding_benchmark.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "benchmarks_sharding.png"))
    p.add_argument("--rss_plot", default=os.path.join(ROOT, "docs", "perfmodel_rss.png"))
    p.add_argument("--machine", default=os.path.join(ROOT, "docs", "machine_xeon_avx512.yaml"))
    p.add_argument("--quick", action="store_true", help="3 small configurations, nothing written")
    p.add_argument("--only", help="only the configurations whose label contains this text")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--wait_idle", type=float, default=0.0, help="seconds to wait for a quiet machine before a run")
    p.add_argument("--from_json", help="the table and plot of a saved run")
    p.add_argument("--resume", action="store_true", help="keep the points --out already holds, measure the rest")
    p.add_argument("--memory_only", action="store_true", help="measure the memory of --out's points again, and save")
    p.add_argument("--rss_only", action="store_true",
                   help="measure the peak RSS of --out's points and the process baselines again, and save")
    args = p.parse_args(argv)
    if args.memory_only:
        run = remeasure_memory(args.out)
    elif args.rss_only:
        run = remeasure_rss(args.out, args.warmup, args.steps, args.only, args.resume)
    elif args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            run = json.load(f)
    else:
        run = drive(args)
    print(f"{run['host']}; pydtnn {run['commit']}; {len(run['points'])} configurations, "
          f"{run['settings']['warmup']} warm-up + {run['settings']['steps']} timed steps; {run['wall_s']:.0f} s")
    print(table(run))
    rss = rss_errors(run)
    if rss:
        import statistics

        errors = sorted(((pred / meas - 1, label) for label, pred, meas in rss), key=lambda e: -abs(e[0]))
        print(f"peak RSS predicted as the traced prediction + the process baseline at its process count and "
              f"network: median |error| {100 * statistics.median(abs(e) for e, _ in errors):.1f}%, worst "
              f"{100 * abs(errors[0][0]):.1f}% ({errors[0][1]}: {100 * errors[0][0]:+.1f}%), "
              f"{len(errors)} points")
        print(rss_table(run))
    if not args.quick and args.plot:
        plot(run, args.plot)
    if not args.quick and rss and args.rss_plot:
        rss_plot(run, args.rss_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
