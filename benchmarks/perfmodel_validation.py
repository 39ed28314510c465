"""The performance model against measured training steps: predicted vs measured step and per-layer times.

    python benchmarks/perfmodel_validation.py [--machine docs/machine_vm.yaml] [--out docs/perfmodel_validation]
                                              [--warmup 3] [--steps 8] [--wait_idle 10] [--only TEXT]
    python benchmarks/perfmodel_validation.py --quick          # 3 configurations, under a minute (smoke test)
    python benchmarks/perfmodel_validation.py --from_json docs/perfmodel_validation.json   # predict again, report

A configuration is a model, a batch size per process, threads per process, a process count, a reducer
(blocking, per_layer, bucketed, and topk at its default density 0.01; np > 1) and a network: "unlimited"
(plain mpiexec: MPICH over shared memory, the machine file's intra-node link) or a rate emulated by
benchmarks/netem.py (1gbit, 200mbit).

Measured: each configuration in a fresh process (`python -m pydtnn`, under `mpiexec -n NP` when NP > 1,
under netem.py for an emulated rate) on synthetic data with --tracing: WARMUP + STEPS steps of one epoch.
The trace gives the trainer's step spans (data, forward, loss, backward, reduction, update) and every
layer's forward and backward spans. A step's time is its slowest rank's; the configuration's is the
median over the timed steps (the warm-up steps, which load the compiled kernels, left out). A layer's
time is the median over the timed steps of its span, averaged over the ranks. Configurations whose
predicted step passes LONG_STEP_S run LONG_WARMUP + LONG_STEPS steps. Before each run the driver waits
(up to --wait_idle s) for other processes to leave the cores, and it records the cores other processes
used during the run (/proc/stat minus its children's CPU time).

Predicted: pydtnn.perfmodel.predict on the same model, batch, np, threads and reducer (MPICH's allreduce
algorithm choice modelled by "best", the cheapest of the textbook algorithms; SGD with momentum, as the
trainer's default; progress only inside MPI calls, as MPICH over shared memory here, but on an emulated
TCP link the kernel moves a posted message's bytes on its own: Link.background). Every rank runs on this one
machine, so the machine file's processes_per_node is set to NP: the flat collectives use the intra-node link,
and compute slows by NP x threads / cores when the ranks ask for more threads than there are cores
(predict's oversubscription factor).

An emulated rate replaces the intra-node link. netem.py's one-node mode puts every rank in one network
namespace whose loopback is capped by one tbf qdisc and forces MPICH onto TCP: every byte any rank sends
crosses that one queue. Ring and Rabenseifner allreduces have all NP ranks send at once in every step, so
each gets rate / NP: bandwidth = rate / NP. docs/distributed.md's check confirms it at NP = 2: a 2-rank
8 MiB allreduce (8 MiB sent by each rank) took 0.136 s at 1 Gbit/s and 0.672 s at 200 Mbit/s, against
16 MiB / rate = 0.134 s and 0.671 s. The link's latency is measured once per rate under the cap (the
median one-way time of an 8-byte ping-pong over TCP), and the allreduce of 1 MiB at NP = 2 and 4 is timed
next to its prediction, as a check of the bandwidth rule. The two-namespace mode (--nodes 2) is not
used here: its NP = 4 runs mix shared memory and TCP, where MPICH composes its allreduce over the nodes
(Machine.node_aware_collectives); benchmarks/planner.py's two-node cases measure that.

--from_json FILE keeps FILE's measurements (steps, layers, the emulated links' latencies) and predicts every
configuration again with the code and the --machine file at hand, so a change to the model is judged
without measuring again; --keep_predictions reports FILE's own predictions instead.

Outputs: OUT.json (every point: configuration, prediction with its split, measurement with its phases
and layers), OUT.png (predicted vs measured, steps and layers, log-log) and the markdown report on
stdout (and in --md FILE): the table, the step errors, the per-layer errors by kind, the link check.
"""

import argparse
import bisect
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from netem import parse_rate
from train_step import busy_seconds, own_seconds, wait_idle

from pydtnn.perfmodel.calibrate import cores, cpu_model
from pydtnn.perfmodel.mpi_links import mpiexec_path

NETEM = os.path.join(HERE, "netem.py")
MODELS = ("simplecnn", "resnet20_cifar10", "vgg11bn_cifar10", "mobilenetv1_cifar10")
REDUCERS = ("blocking", "per_layer", "bucketed")
NETWORKS = ("unlimited", "1gbit", "200mbit")
LONG_STEP_S, LONG_WARMUP, LONG_STEPS = 0.6, 2, 5  # fewer steps where one step is long
COMMUNICATING = ("Gather", "SumGrad")  # layers model parallelism inserts: their spans are collectives
MIN_LAYER_SHARE = 0.01  # layers below this share of the measured step are left out of the headline layer error
TARGETS = {"median_step": 10.0, "worst_step": 25.0, "median_layer": 20.0}  # % (issue 22)
BUSY = 0.25  # cores used by other processes above which a run is measured again (--retries)
RUN_TIMEOUT_S = 600
LINK_BYTES = 1 << 20  # the allreduce the link probe times under each emulated rate
LR = "0.001"  # small enough that no model diverges on random data in a few steps; the rate costs no time


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration."""

    model: str
    batch: int
    threads: int
    np: int
    reduction: str | None  # None when np == 1
    network: str = "unlimited"
    parallel: str = "data"  # model and hybrid: batch is per replica (docs/parallelism.md)
    model_parallel_size: int | None = None  # hybrid: processes per replica

    @property
    def label(self):
        parts = [self.model, f"b{self.batch}", f"t{self.threads}", f"np{self.np}"]
        if self.parallel != "data":
            parts.append(self.parallel if self.parallel == "model" else f"hybrid{self.model_parallel_size}")
        if self.np > 1:
            parts += [self.reduction, self.network]
        return " ".join(parts)


def full_configs():
    """The validation set: every model at batch 16/64 and 1/2 threads alone; at np 2 and 4 each reducer on
    the plain machine; network-bound runs at 1 Gbit/s and 200 Mbit/s (the VGG's 113 MB of gradients at
    200 Mbit/s would take 9 s a step, so it is emulated at 1 Gbit/s only)."""
    c = []
    for model in MODELS:
        for batch in (16, 64):
            for threads in (1, 2):
                c.append(Config(model, batch, threads, 1, None))
    for model, batch in (("simplecnn", 64), ("resnet20_cifar10", 16), ("mobilenetv1_cifar10", 16),
                         ("vgg11bn_cifar10", 16)):
        c += [Config(model, batch, 1, 2, r) for r in REDUCERS]
    c += [Config("resnet20_cifar10", 64, 2, 2, "bucketed"), Config("vgg11bn_cifar10", 64, 1, 2, "blocking")]
    c += [Config("simplecnn", 16, 1, 4, r) for r in REDUCERS]
    c += [Config("resnet20_cifar10", 16, 1, 4, "bucketed"), Config("resnet20_cifar10", 16, 1, 4, "per_layer"),
          Config("mobilenetv1_cifar10", 16, 1, 4, "blocking"), Config("vgg11bn_cifar10", 16, 1, 4, "bucketed")]
    g = "1gbit"
    c += [Config("simplecnn", 64, 1, 2, r, g) for r in REDUCERS]
    c += [Config("resnet20_cifar10", 16, 1, 2, r, g) for r in REDUCERS]
    c += [Config("mobilenetv1_cifar10", 16, 1, 2, r, g) for r in REDUCERS]
    c += [Config("mobilenetv1_cifar10", 16, 1, 4, "per_layer", g), Config("resnet20_cifar10", 64, 1, 4, "bucketed", g),
          Config("vgg11bn_cifar10", 16, 1, 2, "blocking", g)]
    c += [Config("vgg11bn_cifar10", 16, 1, 2, "topk", g), Config("resnet20_cifar10", 16, 1, 2, "topk", g)]  # density 0.01
    m = "200mbit"
    c += [Config("simplecnn", 16, 1, 2, "blocking", m), Config("simplecnn", 16, 1, 2, "per_layer", m),
          Config("simplecnn", 64, 1, 4, "bucketed", m)]
    c += [Config("resnet20_cifar10", 16, 1, 2, r, m) for r in REDUCERS]
    c += [Config("resnet20_cifar10", 16, 1, 4, "blocking", m)]
    c += [Config("mobilenetv1_cifar10", 16, 1, 2, r, m) for r in REDUCERS]
    return c + split_configs()


def split_configs():
    """Model and hybrid parallelism (the batch per replica): at np 2 and 4 on the plain machine, np 2 at
    1 Gbit/s and 200 Mbit/s (activations cross the link, where data parallelism sends gradients)."""
    c = []
    for model, batch in (("simplecnn", 64), ("resnet20_cifar10", 32), ("vgg11bn_cifar10", 32),
                         ("mobilenetv1_cifar10", 32)):
        c += [Config(model, batch, 1, 2, "bucketed", parallel="model"),
              Config(model, batch, 1, 4, "bucketed", parallel="model"),
              Config(model, batch, 1, 4, "bucketed", parallel="hybrid", model_parallel_size=2)]
    for network in ("1gbit", "200mbit"):
        c += [Config("simplecnn", 64, 1, 2, "bucketed", network, parallel="model"),
              Config("resnet20_cifar10", 32, 1, 2, "bucketed", network, parallel="model"),
              Config("vgg11bn_cifar10", 32, 1, 2, "bucketed", network, parallel="model")]
    return c


def quick_configs(emulate):
    """Three small configurations: one process, two on shared memory, two at 1 Gbit/s (where netem may run)."""
    third = Config("simplecnn", 16, 1, 2, "bucketed", "1gbit" if emulate else "unlimited")
    return [Config("simplecnn", 16, 1, 1, None), Config("simplecnn", 16, 1, 2, "per_layer"), third]


# ----------------------------------------------------------------------------------------------
# the prediction
# ----------------------------------------------------------------------------------------------
def machine_for(base, np_, link=None):
    """The machine a configuration runs on: `base` with every rank on its one node, and with `link`
    ({"latency_s", "bandwidth_bytes_per_s" of the whole emulated loopback}) as the intra-node link
    when the network is emulated, each rank getting 1/np of the rate (see the module docstring): TCP, whose
    kernel sends a posted message's bytes while the ranks compute (Link.background)."""
    m = dataclasses.replace(base, processes_per_node=np_)
    if link is not None:
        m = m.with_link("intra", bandwidth=link["bandwidth_bytes_per_s"] / np_, latency=link["latency_s"],
                        background=True)
    return m


def predicted(config, model, machine):
    """The prediction of one configuration as plain data; layers by name, backward = data + weights."""
    from pydtnn.perfmodel.predict import predict

    p = predict(model, config.batch, config.np, machine, reduction=config.reduction or "blocking",
                threads=config.threads, algorithm="best", progress="test", optimizer="sgd_momentum",
                parallel=config.parallel, model_parallel_size=config.model_parallel_size)
    return {"step_s": p.step_s, "compute_s": p.compute_s, "memory_s": p.memory_s, "update_s": p.update_s,
            "comm_s": p.comm_s, "exposed_comm_s": p.exposed_comm_s, "messages": p.messages,
            "link": {"latency_s": machine.links["intra"].latency_s,
                     "bandwidth_bytes_per_s": machine.links["intra"].bandwidth_bytes_per_s},
            "layers": {t.name: {"kind": t.kind, "algorithm": t.algorithm, "forward_s": t.forward_s,
                                "backward_s": t.backward_data_s + t.backward_weights_s, "bound": t.bound}
                       for t in p.layers}}


# ----------------------------------------------------------------------------------------------
# the measurement
# ----------------------------------------------------------------------------------------------
PHASES = ("data", "forward", "loss", "backward", "reduce", "optimizer")
WAITS = ("wait", "blocking")  # the reducers' spans of exposed communication (inside backward or reduce)


def rank_timings(events, warmup):
    """One rank's trace (Chrome-trace events) after `warmup` steps: (step seconds per timed step,
    {(layer, "forward" | "backward"): seconds per timed step}, {phase: seconds per timed step}).
    Layer spans are the model's (tid 0, category forward/backward), phases the trainer's (tid 1)."""
    steps = sorted((e for e in events if e.get("cat") == "step"), key=lambda e: e["ts"])
    if len(steps) <= warmup:
        raise ValueError(f"the trace holds {len(steps)} steps; expected more than the {warmup} warm-up steps")
    timed = steps[warmup:]
    starts = [e["ts"] for e in timed]
    layers, phases = defaultdict(lambda: [0.0] * len(timed)), defaultdict(lambda: [0.0] * len(timed))
    for e in events:
        if e.get("ph") != "X" or e.get("cat") == "step":
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] + e["dur"] > timed[i]["ts"] + timed[i]["dur"] + 1e-3:
            continue  # a warm-up step's, or outside any step
        if e["tid"] == 0 and e["cat"] in ("forward", "backward"):
            layers[(e["name"], e["cat"])][i] += e["dur"] / 1e6
        elif e["tid"] == 1 and (e["cat"] in PHASES or e["cat"] in WAITS):
            phases[e["cat"]][i] += e["dur"] / 1e6
    return [e["dur"] / 1e6 for e in timed], dict(layers), dict(phases)


def combine_ranks(per_rank):
    """The configuration's measurement from each rank's rank_timings: step and phases per step taken from
    the slowest rank, then the median over the steps; layers: each rank's median, averaged over ranks."""
    steps = [max(r[0][i] for r in per_rank) for i in range(min(len(r[0]) for r in per_rank))]
    phases = {}
    for cat in sorted({c for r in per_rank for c in r[2]}):
        rows = [r[2].get(cat, [0.0] * len(steps)) for r in per_rank]
        phases[cat] = statistics.median(max(row[i] for row in rows) for i in range(len(steps)))
    layers = defaultdict(dict)
    for key in sorted({k for r in per_rank for k in r[1]}):
        name, phase = key
        layers[name][f"{phase}_s"] = statistics.mean(statistics.median(r[1][key]) for r in per_rank if key in r[1])
    return {"step_s": statistics.median(steps), "steps_s": steps, "phases_s": phases, "layers": dict(layers)}


def command(config, trace, warmup, steps, python=sys.executable):
    """The argv that measures `config`, writing its trace(s) to `trace`."""
    train = [python, "-m", "pydtnn", "--model", config.model, "--batch_size", str(config.batch),
             "--use_synthetic_data", "--steps_per_epoch", str(warmup + steps), "--num_epochs", "1",
             "--learning_rate", LR, "--tracing", "--tracer_output", trace, "--progress", "false",
             "--threads_per_process", str(config.threads)]
    if config.np > 1:
        train = [mpiexec_path(), "-n", str(config.np), *train, "--reduction", config.reduction]
        if config.parallel != "data":
            train += ["--parallel", config.parallel]
        if config.model_parallel_size:
            train += ["--model_parallel_size", str(config.model_parallel_size)]
    if config.network != "unlimited":
        train = [python, NETEM, "--rate", config.network, "--", *train]
    return train


def thread_env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                MKL_NUM_THREADS=str(threads))


def measure(config, warmup, steps, wait_s, retries, tmp):
    """Run `config` in fresh processes (again, up to `retries` times, while other processes used more than
    BUSY cores); the least disturbed run's measurement."""

    best = None
    for attempt in range(1 + retries):
        trace = os.path.join(tmp, f"trace{attempt}.json")
        timings, wall, foreign = run_traced(command(config, trace, warmup, steps), thread_env(config.threads), tmp,
                                            trace, config.np, warmup, wait_s, config.label)
        rec = {**timings, "warmup": warmup, "steps": steps, "wall_s": wall, "foreign_cores": foreign,
               "attempts": attempt + 1}
        if best is None or (rec["foreign_cores"] or 0.0) < (best["foreign_cores"] or 0.0):
            best = rec
        if (rec["foreign_cores"] or 0.0) <= BUSY:
            break
    return best


def run_traced(argv, env, cwd, trace, np_, warmup, wait_s, label, timeout=RUN_TIMEOUT_S):
    """Run a traced training command once the machine is quiet: (combine_ranks of its np_ traces, wall seconds,
    cores other processes used meanwhile, or None where /proc/stat cannot tell). RuntimeError on a failure."""
    from pydtnn.profiling.tracer import trace_paths

    wait_idle(wait_s)
    t0, b0, c0 = time.perf_counter(), busy_seconds(), own_seconds(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{label}: exit status {proc.returncode}\n{tail}")
    foreign = None
    if b0 is not None:
        foreign = max(0.0, (busy_seconds() - b0 - (own_seconds(resource.RUSAGE_CHILDREN) - c0)) / wall)
    per_rank = []
    for path in trace_paths(trace, np_):
        with open(path, encoding="utf-8") as f:
            per_rank.append(rank_timings(json.load(f)["traceEvents"], warmup))
    return combine_ranks(per_rank), wall, foreign


def under_netem(rate, np_, nodes=1):
    """The argv that runs a command of np_ ranks under netem.py at `rate`: every rank in one namespace, or with
    nodes=2 np_/2 ranks in each of two (--nodes 2)."""
    two = ["--nodes", "2", "--procs-per-node", str(np_ // 2)] if nodes == 2 else []
    return [sys.executable, NETEM, "--rate", rate, *two, "--"]


def probe_link(rate, nps=(2, 4), nodes=1):
    """Under netem at `rate`: {"rate", "bandwidth_bytes_per_s" (the whole loopback's, from the rate),
    "latency_s" (an 8-byte ping-pong's one-way time, np 2), "allreduce": [{np, bytes, seconds}] (1 MiB)},
    measured by calibrate's own MPI probe (pydtnn/perfmodel/mpi_probe.py). nodes=2: between two emulated nodes
    of np/2 ranks each (netem.py --nodes 2; the rate is each node's end's own), with "nodes": 2, and the allreduce
    through pydtnn's communicator (the probe's collectives), as the trainer runs it."""
    out = {"rate": rate, **({"nodes": 2} if nodes == 2 else {}), "bandwidth_bytes_per_s": parse_rate(rate) / 8,
           "allreduce": []}
    for n in nps:
        proc = subprocess.run([*under_netem(rate, n, nodes), mpiexec_path(), "-n", str(n), sys.executable, "-m",
                               "pydtnn.perfmodel.mpi_probe", "--max_bytes", str(LINK_BYTES)],
                              capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode:
            raise RuntimeError(f"link probe at {rate}{' on two nodes' if nodes == 2 else ''}, np {n}: exit status "
                               f"{proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}")
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        out.setdefault("latency_s", rec["pingpong"][0][1])
        size, seconds = (rec["collectives"]["allreduce"] if nodes == 2 else rec["allreduce"])[-1]
        out["allreduce"].append({"np": n, "bytes": size, "seconds": seconds})
    return out


def netem_refusal():
    """None where netem.py can run here, else its one-line reason."""
    proc = subprocess.run([sys.executable, NETEM, "--rate", "1gbit", "--", "true"], capture_output=True, text=True,
                          timeout=60, check=False)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit status {proc.returncode}")


# ----------------------------------------------------------------------------------------------
# errors and the report
# ----------------------------------------------------------------------------------------------
def error_pct(predicted_s, measured_s):
    """Signed relative error of a prediction, in % of the measurement (positive: predicted too slow)."""
    return 100.0 * (predicted_s - measured_s) / measured_s


def layer_points(point):
    """[(layer, kind, measured fwd+bwd s, predicted fwd+bwd s, share of the measured step, phase errors)] of
    one point: every traced layer the prediction also has (blocks' combining steps are not traced). The
    gathers and sums model parallelism inserts are left out: their spans hold their collectives (and the
    wait for the slowest rank), which the prediction counts as communication, not as layer time."""
    out = []
    pred, meas, step = point["predicted"]["layers"], point["measured"]["layers"], point["measured"]["step_s"]
    for name, m in meas.items():
        if name not in pred or pred[name]["kind"] in COMMUNICATING:
            continue
        p = pred[name]
        mt = m.get("forward_s", 0.0) + m.get("backward_s", 0.0)
        pt = p["forward_s"] + p["backward_s"]
        if mt <= 0:
            continue
        phase = {ph: error_pct(p[f"{ph}_s"], m[f"{ph}_s"]) for ph in ("forward", "backward")
                 if m.get(f"{ph}_s", 0.0) > 0}
        out.append({"layer": name, "kind": p["kind"], "measured_s": mt, "predicted_s": pt, "share": mt / step,
                    "error_pct": error_pct(pt, mt), "phase_error_pct": phase})
    return out


def summarize(points, min_share=MIN_LAYER_SHARE):
    """Step errors (median and worst absolute, bias, counts within the targets) and layer errors (headline:
    layers with at least `min_share` of their step; also every layer, per phase, per kind)."""
    errs = [p["error_pct"] for p in points]
    absolute = [abs(e) for e in errs]
    worst = max(points, key=lambda p: abs(p["error_pct"]))
    s = {"configurations": len(points), "median_abs_step_error_pct": statistics.median(absolute),
         "worst_step_error_pct": worst["error_pct"], "worst_config": worst["label"],
         "mean_step_error_pct": statistics.mean(errs),
         "within_10pct": sum(a <= 10 for a in absolute), "within_25pct": sum(a <= 25 for a in absolute)}
    for key in ("network", "model", "np", "parallel"):
        groups = defaultdict(list)
        for p in points:
            groups[p["config"].get(key, "data")].append(p["error_pct"])
        s[f"by_{key}"] = {str(k): {"n": len(v), "median_abs_pct": statistics.median(map(abs, v)),
                                   "median_pct": statistics.median(v)} for k, v in groups.items()}
    layers = [lp for p in points for lp in layer_points(p)]
    big = [lp for lp in layers if lp["share"] >= min_share]
    if big:
        s["median_abs_layer_error_pct"] = statistics.median(abs(lp["error_pct"]) for lp in big)
        s["layer_points"], s["layer_min_share"] = len(big), min_share
        s["weighted_layer_error_pct"] = (100 * sum(abs(lp["predicted_s"] - lp["measured_s"]) for lp in big)
                                         / sum(lp["measured_s"] for lp in big))
        for ph in ("forward", "backward"):
            e = [abs(lp["phase_error_pct"][ph]) for lp in big if ph in lp["phase_error_pct"]]
            s[f"median_abs_layer_{ph}_error_pct"] = statistics.median(e) if e else None
        kinds = defaultdict(list)
        for lp in big:
            kinds[lp["kind"]].append(lp)
        s["by_kind"] = {k: {"n": len(v), "median_pct": statistics.median(lp["error_pct"] for lp in v),
                            "median_abs_pct": statistics.median(abs(lp["error_pct"]) for lp in v),
                            "time_share": sum(lp["measured_s"] for lp in v) / sum(lp["measured_s"] for lp in big)}
                        for k, v in sorted(kinds.items())}
    if layers:
        s["median_abs_layer_error_all_pct"] = statistics.median(abs(lp["error_pct"]) for lp in layers)
        s["layer_points_all"] = len(layers)
    s["met"] = {"median_step": s["median_abs_step_error_pct"] <= TARGETS["median_step"],
                "worst_step": abs(s["worst_step_error_pct"]) <= TARGETS["worst_step"],
                "median_layer": s.get("median_abs_layer_error_pct", float("inf")) <= TARGETS["median_layer"]}
    return s


def make_point(config, prediction, measurement):
    return {"label": config.label, "config": dataclasses.asdict(config), "predicted": prediction,
            "measured": measurement, "error_pct": error_pct(prediction["step_s"], measurement["step_s"])}


def fits_the_cores(points, cores):
    """Report lines: the step error where the processes x threads fit the machine's cores, and apart where they
    outnumber them (oversubscribed)."""
    out = []
    for name, keep in (("fit the cores", lambda c: c["np"] * c["threads"] <= cores),
                       ("outnumber the cores", lambda c: c["np"] * c["threads"] > cores)):
        errs = [p["error_pct"] for p in points if keep(p["config"])]
        if errs:
            worst = max(errs, key=abs)
            out.append(f"Where the processes x threads {name} ({cores}): median absolute step error "
                       f"{statistics.median(map(abs, errs)):.1f}%, worst {worst:+.1f}%, "
                       f"{sum(abs(e) <= 15 for e in errs)} of {len(errs)} within 15%.")
    return out


def report(run):
    """The markdown report of a run (the JSON's layout)."""
    points, s = run["points"], run["summary"]
    ms = lambda v: f"{1e3 * v:.1f}" if v >= 0.01 else f"{1e3 * v:.2f}"
    lines = [(f"Machine: {run['machine']['name']} (`{run['machine_file']}`); {run['host']}; "
             f"pydtnn {run['commit']}"
             + (f" (predicted again at {run['predicted_at']})" if run.get("predicted_at") else "")
             + f"; {len(points)} configurations, script wall time {run['wall_s']:.0f} s."), "",
             ("| model | batch | threads | np | parallel | reduction | network | predicted ms | of which comm. "
              "| measured ms | error % | other cores |"),
             "| --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        c, pr, me = p["config"], p["predicted"], p["measured"]
        foreign = me.get("foreign_cores")
        par = c.get("parallel", "data")
        par = f"hybrid {c['np'] // c['model_parallel_size']}x{c['model_parallel_size']}" if par == "hybrid" else par
        lines.append(f"| {c['model']} | {c['batch']} | {c['threads']} | {c['np']} | {par if c['np'] > 1 else '-'} | "
                     f"{c['reduction'] or '-'} | "
                     f"{c['network'] if c['np'] > 1 else '-'} | {ms(pr['step_s'])} | "
                     f"{ms(pr['exposed_comm_s']) if c['np'] > 1 else '-'} | {ms(me['step_s'])} | "
                     f"{p['error_pct']:+.1f} | {'' if foreign is None else f'{foreign:.2f}'} |")
    yes = lambda ok: "met" if ok else "not met"
    lines += ["", "| target | reached | |", "| --- | --- | --- |",
              (f"| median absolute step error <= {TARGETS['median_step']:.0f}% | "
              f"{s['median_abs_step_error_pct']:.1f}% | {yes(s['met']['median_step'])} |"),
              (f"| no step error worse than {TARGETS['worst_step']:.0f}% | {s['worst_step_error_pct']:+.1f}% "
              f"({s['worst_config']}); {s['within_25pct']} of {s['configurations']} within 25% | "
              f"{yes(s['met']['worst_step'])} |")]
    if "median_abs_layer_error_pct" in s:
        lines.append(f"| per-layer median absolute error <= {TARGETS['median_layer']:.0f}% | "
                     f"{s['median_abs_layer_error_pct']:.1f}% ({s['layer_points']} layer times of at least "
                     f"{100 * s['layer_min_share']:.0f}% of their step) | {yes(s['met']['median_layer'])} |")
    lines += ["", (f"Step error: mean {s['mean_step_error_pct']:+.1f}% (signed; positive = predicted slower), "
                  f"{s['within_10pct']} of {s['configurations']} within 10%.")]
    lines += fits_the_cores(points, run["machine"]["cores"])
    for key in ("network", "np", "model", "parallel"):
        parts = [f"{k}: {v['median_abs_pct']:.1f}% (signed {v['median_pct']:+.1f}%, n={v['n']})"
                 for k, v in s.get(f"by_{key}", {}).items()]
        lines.append(f"Median absolute step error by {key}: " + "; ".join(parts) + ".")
    if "by_kind" in s:
        pct = lambda v: "-" if v is None else f"{v:.1f}%"
        lines += ["", (f"Per-layer times (forward + backward, rank-averaged medians): median absolute error "
                      f"{s['median_abs_layer_error_pct']:.1f}% over layers of at least "
                      f"{100 * s['layer_min_share']:.0f}% of their step; forward "
                      f"{pct(s['median_abs_layer_forward_error_pct'])}, backward "
                      f"{pct(s['median_abs_layer_backward_error_pct'])}; time-weighted "
                      f"{s['weighted_layer_error_pct']:.1f}%; every traced layer ({s['layer_points_all']}): "
                      f"{s['median_abs_layer_error_all_pct']:.1f}%."), "",
                  "| layer kind | layer times | share of layer time | median error % (signed) | median abs. error % |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for k, v in sorted(s["by_kind"].items(), key=lambda kv: -kv[1]["time_share"]):
            lines.append(f"| {k} | {v['n']} | {100 * v['time_share']:.1f}% | {v['median_pct']:+.1f} | "
                         f"{v['median_abs_pct']:.1f} |")
    if run.get("links"):
        lines += ["", "Emulated links (one shared loopback; bandwidth per rank = rate / np; latency measured):", "",
                  "| rate | latency us | np | 1 MiB allreduce measured ms | predicted ms |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for link in run["links"].values():
            for a in link["allreduce"]:
                lines.append(f"| {link['rate']} | {1e6 * link['latency_s']:.0f} | {a['np']} | "
                             f"{1e3 * a['seconds']:.1f} | {1e3 * a.get('predicted_s', float('nan')):.1f} |")
    return "\n".join(lines)


COLORS = {"simplecnn": "tab:blue", "resnet20_cifar10": "tab:orange", "vgg11bn_cifar10": "tab:green",
          "mobilenetv1_cifar10": "tab:red"}
MARKERS = {"unlimited": "o", "1gbit": "^", "200mbit": "s"}


def plot(run, path, min_share=MIN_LAYER_SHARE):
    """Two log-log panels, predicted against measured: the steps (colour: model, marker: network) and the
    layers of at least `min_share` of their step; y = x and the 25% band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(12.5, 5.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    points = run["points"]
    for p in points:
        c = p["config"]
        left.scatter(1e3 * p["measured"]["step_s"], 1e3 * p["predicted"]["step_s"], s=36,
                     color=COLORS.get(c["model"], "gray"), marker=MARKERS.get(c["network"] if c["np"] > 1 else
                                                                               "unlimited", "x"),
                     edgecolors="black", linewidths=0.4, zorder=3)
    for p in points:
        for lp in layer_points(p):
            if lp["share"] >= min_share:
                right.scatter(1e3 * lp["measured_s"], 1e3 * lp["predicted_s"], s=10, alpha=0.55,
                              color=COLORS.get(p["config"]["model"], "gray"), zorder=3)
    for ax, title in ((left, "training step"), (right, (f"layers (forward + backward, >= {100 * min_share:.0f}% of "
                                                        "their step)"))):
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ax.get_xlim()
        lo2, hi2 = ax.get_ylim()
        lo, hi = min(lo, lo2), max(hi, hi2)
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, zorder=2)
        ax.fill_between([lo, hi], [0.75 * lo, 0.75 * hi], [1.25 * lo, 1.25 * hi], color="gray", alpha=0.15, lw=0,
                        zorder=1)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured ms")
        ax.set_ylabel("predicted ms")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
    s = run["summary"]
    left.text(0.03, 0.97, f"median |error| {s['median_abs_step_error_pct']:.1f}%\nworst "
                          f"{s['worst_step_error_pct']:+.1f}%\nshaded: within 25%", transform=left.transAxes,
              va="top", fontsize=9)
    if "median_abs_layer_error_pct" in s:
        right.text(0.03, 0.97, f"median |error| {s['median_abs_layer_error_pct']:.1f}%\n"
                               f"{s['layer_points']} layer times", transform=right.transAxes, va="top", fontsize=9)
    handles = [Line2D([], [], color=col, marker="o", ls="", label=m) for m, col in COLORS.items()]
    handles += [Line2D([], [], color="gray", marker=mk, ls="", label=n if n != "unlimited" else "shared memory / np 1")
                for n, mk in MARKERS.items()]
    left.legend(handles=handles, loc="lower right", fontsize=8)
    fig.suptitle(f"Performance model against measured pydtnn steps ({run['machine']['name']})", fontsize=11)
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def commit():
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def host():
    return f"{cpu_model() or os.uname().machine}, {cores()} cores"


def load_machine(path, quick):
    from pydtnn.perfmodel import machine

    if not os.path.exists(path) and quick:
        print(f"perfmodel_validation: {path} does not exist; --quick predicts with the built-in machine",
              file=sys.stderr)
        return machine.DEFAULT
    return machine.load(path)


def repredict(run, base, machine_file):
    """`run` (a saved run's layout) with every prediction made again on machine `base`: the configurations'
    steps and layers, and the emulated links' allreduces, from the links' measured latencies."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel import collectives
    from pydtnn.perfmodel.machine import to_dict

    links = run.get("links") or {}
    for link in links.values():
        for a in link["allreduce"]:
            a["predicted_s"] = collectives.best("allreduce", a["bytes"], a["np"], machine_for(base, a["np"], link))[1]
    built, points = {}, []
    for point in run["points"]:
        config = Config(**point["config"])
        if config.model not in built:
            built[config.model] = models.create(config.model, backend=CPUBackend(seed=0))
        pred = predicted(config, built[config.model], machine_for(base, config.np, links.get(config.network)))
        points.append(make_point(config, pred, point["measured"]))
    return {**run, "points": points, "machine": to_dict(base), "machine_file": machine_file,
            "predicted_at": commit(), "summary": summarize(points)}


def drive(args):
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel import collectives
    from pydtnn.perfmodel.machine import to_dict

    t_start = time.perf_counter()
    base = load_machine(args.machine, args.quick)
    refusal = netem_refusal()
    if refusal:
        print(f"perfmodel_validation: emulated networks skipped: {refusal}", file=sys.stderr)
    configs = quick_configs(refusal is None) if args.quick else full_configs()
    configs = [c for c in configs if (refusal is None or c.network == "unlimited")
               and (not args.only or args.only in c.label) and (not args.parallel or c.parallel in args.parallel)]
    links = {}
    for rate in sorted({c.network for c in configs if c.network != "unlimited"}, key=NETWORKS.index):
        print(f"link probe at {rate}", file=sys.stderr, flush=True)
        links[rate] = probe_link(rate, nps=sorted({2} | {c.np for c in configs if c.network == rate}))
        for a in links[rate]["allreduce"]:
            m = machine_for(base, a["np"], links[rate])
            a["predicted_s"] = collectives.best("allreduce", a["bytes"], a["np"], m)[1]
    built, points = {}, []
    with tempfile.TemporaryDirectory(prefix="perfmodel-validation-") as tmp:
        for i, config in enumerate(configs):
            if config.model not in built:
                built[config.model] = models.create(config.model, backend=CPUBackend(seed=0))
            pred = predicted(config, built[config.model], machine_for(base, config.np, links.get(config.network)))
            warmup, steps = ((LONG_WARMUP, LONG_STEPS) if pred["step_s"] > LONG_STEP_S and not args.quick
                             else (args.warmup, args.steps))
            meas = measure(config, warmup, steps, args.wait_idle, args.retries, tmp)
            point = make_point(config, pred, meas)
            points.append(point)
            print(f"[{i + 1}/{len(configs)}] {config.label}: predicted {1e3 * pred['step_s']:.1f} ms, measured "
                  f"{1e3 * meas['step_s']:.1f} ms ({point['error_pct']:+.1f}%), other cores "
                  f"{meas['foreign_cores'] if meas['foreign_cores'] is None else round(meas['foreign_cores'], 2)}",
                  file=sys.stderr, flush=True)
    return {"machine_file": os.path.relpath(os.path.abspath(args.machine), ROOT), "machine": to_dict(base), "host": host(), "commit": commit(),
            "netem": refusal or "used", "links": links, "points": points, "summary": summarize(points),
            "wall_s": time.perf_counter() - t_start,
            "settings": {"warmup": args.warmup, "steps": args.steps, "long_step_s": LONG_STEP_S,
                         "long_warmup": LONG_WARMUP, "long_steps": LONG_STEPS, "algorithm": "best",
                         "progress": "test", "learning_rate": LR}}


def rounded(value, digits=5):
    """`value` with every float rounded to `digits` significant digits (timings are not more precise)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def output(run, out, md=None):
    """Write OUT.json and OUT.png (and the markdown to `md`), print the markdown."""
    text = report(run)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".json", "w", encoding="utf-8") as f:
            json.dump(rounded(run), f, separators=(",", ":"))
            f.write("\n")
        plot(run, out + ".png")
    if md:
        with open(md, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", default=os.path.join(ROOT, "docs", "machine_vm.yaml"),
                   help="machine description (default docs/machine_vm.yaml)")
    p.add_argument("--out", help="prefix of OUT.json and OUT.png (default docs/perfmodel_validation; with --quick, "
                                 "a temporary directory's)")
    p.add_argument("--md", help="also write the markdown report to this file")
    p.add_argument("--quick", action="store_true", help="3 small configurations (smoke test)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    p.add_argument("--wait_idle", type=float, default=10.0, help="seconds to wait for a quiet machine before a run")
    p.add_argument("--retries", type=int, default=1, help="runs again while other processes used > 0.25 cores")
    p.add_argument("--only", help="only the configurations whose label contains this text")
    p.add_argument("--parallel", choices=("data", "model", "hybrid"), action="append",
                   help="only configurations of this parallelism (repeatable)")
    p.add_argument("--merge", help="a saved run (JSON) whose points the new measurements join, replacing those "
                                   "of the same configuration; the result goes to --out")
    p.add_argument("--from_json", help="predict a saved run's configurations again (its measurements kept), report "
                                       "and plot, instead of measuring")
    p.add_argument("--keep_predictions", action="store_true", help="with --from_json: report the saved predictions")
    args = p.parse_args(argv)
    if args.quick and args.steps == 8 and args.warmup == 3:
        args.warmup, args.steps = 2, 4
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "perfmodel_validation_quick") if args.quick
                    else os.path.join(ROOT, "docs", "perfmodel_validation"))
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            run = json.load(f)
        if args.keep_predictions:
            run["summary"] = summarize(run["points"])
        else:
            run = repredict(run, load_machine(args.machine, False),
                            os.path.relpath(os.path.abspath(args.machine), ROOT))
        output(run, args.out, args.md)
        return 0
    run = drive(args)
    if args.merge:
        run = merged(run, args.merge)
    output(run, args.out, args.md)
    return 0


def merged(run, path):
    """The saved run at `path` with `run`'s points added (a point of the same configuration replaced),
    its links joined (the saved probe of a rate kept), every point in the order of full_configs(); the new
    run's machine and commit."""
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    new = {p["label"]: p for p in run["points"]}
    points = [p for p in old["points"] if p["label"] not in new] + run["points"]
    order = {c.label: i for i, c in enumerate(full_configs())}
    points.sort(key=lambda p: order.get(p["label"], len(order)))
    return {**old, **{k: run[k] for k in ("machine_file", "machine", "host", "commit", "netem")},
            "links": {**run["links"], **old.get("links", {})}, "points": points, "summary": summarize(points),
            "wall_s": old.get("wall_s", 0.0) + run["wall_s"]}


if __name__ == "__main__":
    sys.exit(main())
