"""Data, model and hybrid parallelism side by side: the training step of each layout on the same global batch.

    python benchmarks/parallelism.py [--out docs/parallelism_benchmark.json] [--plot docs/benchmarks_parallelism.png]
                                     [--warmup 2] [--steps 5] [--only TEXT]        # 70 runs, about 10 minutes
    python benchmarks/parallelism.py --quick          # 3 small configurations, about 10 s (smoke test)
    python benchmarks/parallelism.py --from_json docs/parallelism_benchmark.json   # table and plot again, re-predicted
    python benchmarks/parallelism.py --pipelines [--out docs/pipeline_benchmark.json]  # pipelines beside data, 54 runs
    python benchmarks/parallelism.py --model_pipelines [--out docs/model_pipeline_benchmark.json]   # 12 runs

A configuration is a model, a global batch (samples per step over all processes), a process count, a
layout and a network. Layouts: `data` (each process a replica on global/np samples), `model` (every
Conv2D and Dense split by output channels over all np processes, which all see the whole batch) and, at
np 4, `hybrid` (two groups of two processes each split the model, data parallel across the groups, each
group on half the batch). Networks: "unlimited" (plain mpiexec: MPICH over shared memory) or a rate that
benchmarks/netem.py emulates in one-node mode (every rank in one network namespace whose loopback is
capped, MPICH over TCP; all ranks share the rate).

Measured: each configuration in fresh processes (`python -m pydtnn --parallel LAYOUT --global_batch_size B`
under `mpiexec -n NP`, under netem.py for an emulated rate), one thread per process, with --tracing:
WARMUP + STEPS steps of one epoch, on random images written as a small file dataset in the model's input
shape (CIFAR-10 binary files for 3x32x32, MNIST IDX files for 1x28x28): just the training samples the
steps use and TEST_SAMPLES test samples. --use_synthetic_data would do as well for the steps, but its
2,000 test samples, which the trainer evaluates at the end of every run, cost more than the steps (a
13 s run of the VGG at np 2 on shared memory spent 3 s in its 7 steps), and a model-parallel evaluation
gathers every test sample's activations over the emulated network. A step's time is its slowest rank's span; the
configuration's is the median over the timed steps (perfmodel_validation.py's trace reading). From the
same trace: the model-parallel collectives (the spans of the gathers and dx sums partition() inserts,
waiting included; per step, averaged over ranks) and the gradient reduction's exposed wait (the
reducer's wait and blocking spans, slowest rank). The run's start and end are not timed.

Predicted: pydtnn.perfmodel.predict on the same layout, process count and batch per replica (the bucketed
reducer, the trainer's default; algorithm "best", progress inside MPI calls; every rank on this one
machine, so an emulated rate becomes the intra-node link with rate / np per rank, as in
perfmodel_validation.py, its latency measured under the cap by calibrate's MPI probe). --from_json
predicts the saved configurations again with the checkout's performance model (--keep_predictions: the
saved ones).

--pipelines: pipelines (`--parallel pipeline`, one stage per process: S = 2 with M = 1, 4, 8 micro-batches
under 1F1B and M = 8 under GPipe; S = 4 with M = 4, 8 under 1F1B and M = 8 under GPipe) beside data
parallelism at np 2 and 4 on the same global batch (128), for the VGG and ResNet-20, on shared memory, at
1 Gbit/s and at 200 Mbit/s. Each run's peak resident memory per process (the largest over its ranks; GNU time's maximum
resident set size) is measured too. The predictions are predict()'s for the same cut, schedule and
micro-batches.

--model_pipelines: stages split over model-parallel groups (`--parallel hybrid --pipeline_stages 2
--model_parallel_size 2` at np 4: layout "pipeline_model", M = 4 and 8 micro-batches under 1F1B) beside data
parallelism and the hybrid 2x2 of model-parallel groups at np 4, for the VGG and ResNet-20 on the same global
batch (128), on shared memory and at 1 Gbit/s, with the model's predictions for the same cut and schedule.

Outputs: the JSON (every configuration with its measurement and its prediction),
the PNG (step time per layout, one panel per model and global batch, grouped by network) and the
markdown table on stdout.
"""

import argparse
import dataclasses
import json
import os
import struct
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import numpy as np
import perfmodel_validation as validation

from pydtnn.perfmodel.mpi_links import mpiexec_path

MODELS = ("vgg11bn_cifar10", "resnet20_cifar10", "simplecnn")
NETWORKS = ("unlimited", "1gbit", "200mbit")
LAYOUTS = ((2, "data"), (2, "model"), (4, "data"), (4, "model"), (4, "hybrid"))  # (np, layout), in table order
HYBRID_GROUP = 2  # processes per model replica in the hybrid layout (2x2 at np 4)
MP_COMM = (":allgather", ":sum_dx")  # names of the layers model_parallel.partition() inserts end so
RUN_TIMEOUT_S = 300
BUSY = 0.25  # cores other processes used during a run above which the report names it and the plot hatches it
TEST_SAMPLES = 8  # the test set the trainer evaluates at the end of a run: small, so that it costs nothing


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration; `batch` is the global batch of a step."""

    model: str
    batch: int
    np: int
    layout: str  # data, model, hybrid, pipeline or pipeline_model (stages of HYBRID_GROUP processes each)
    network: str = "unlimited"
    micro_batches: int = 1
    schedule: str = "1f1b"  # a pipeline's

    @property
    def group(self):
        """Processes per model replica."""
        return {"data": 1, "model": self.np, "hybrid": HYBRID_GROUP, "pipeline": self.np,
                "pipeline_model": self.np}[self.layout]

    @property
    def replica_batch(self):
        """Samples each model replica (a process in `data`, a group otherwise) computes per step."""
        return self.batch // (self.np // self.group)

    @property
    def label(self):
        return f"{self.model} B{self.batch} np{self.np} {self.name} {self.network}"

    @property
    def stages(self):
        """A pipeline's stages (pipeline_model: each stage split over HYBRID_GROUP processes); 1 otherwise."""
        return {"pipeline": self.np, "pipeline_model": self.np // HYBRID_GROUP}.get(self.layout, 1)

    @property
    def name(self):
        """The layout in words: data, model, hybrid 2x2, pipeline 4 x M8 1f1b."""
        if self.layout == "pipeline":
            return f"pipeline {self.np} x M{self.micro_batches} {self.schedule}"
        if self.layout == "pipeline_model":
            return f"pipeline {self.stages} of model {HYBRID_GROUP} x M{self.micro_batches} {self.schedule}"
        return layout_name(self.np, self.layout)


def layout_name(np_, layout):
    return f"hybrid {HYBRID_GROUP}x{np_ // HYBRID_GROUP}" if layout == "hybrid" else layout


PIPELINES = ((2, 1, "1f1b"), (2, 4, "1f1b"), (2, 8, "1f1b"), (2, 8, "gpipe"), (4, 4, "1f1b"), (4, 8, "1f1b"),
             (4, 8, "gpipe"))  # (stages, micro-batches, schedule)


def pipeline_configs(models=("vgg11bn_cifar10", "resnet20_cifar10"), batch=128, networks=NETWORKS):
    """Data parallelism at np 2 and 4 and every PIPELINES layout, for each model and network, on one global batch."""
    out = []
    for network in networks:
        for model in models:
            out += [Config(model, batch, n, "data", network) for n in (2, 4)]
            out += [Config(model, batch, s, "pipeline", network, m, kind) for s, m, kind in PIPELINES]
    return out


# global batches measured on an emulated network where not every batch is: the others' steps take seconds
EMULATED_BATCHES = {("1gbit", "vgg11bn_cifar10"): (32,), ("200mbit", "vgg11bn_cifar10"): (),
                    ("200mbit", "resnet20_cifar10"): (32,)}


def model_pipeline_configs(models=("vgg11bn_cifar10", "resnet20_cifar10"), batch=128, networks=NETWORKS[:2]):
    """Data parallelism, hybrid 2x2 and pipelines of 2 stages each split over 2 processes (M = 4, 8; 1F1B), at
    np 4, for each model and network, on one global batch."""
    out = []
    for network in networks:
        for model in models:
            out += [Config(model, batch, 4, "data", network), Config(model, batch, 4, "hybrid", network)]
            out += [Config(model, batch, 4, "pipeline_model", network, m, "1f1b") for m in (4, 8)]
    return out


def full_configs(batches=(32, 128)):
    """Every model, both global batches and every layout on shared memory; on the emulated networks the same
    but for EMULATED_BATCHES: the VGG at global batch 32 only at 1 Gbit/s (at 128 its np 4 steps take 5 s)
    and not at all at 200 Mbit/s (112.6 MB of gradients: about 9 s a data-parallel step at np 2), ResNet-20 at
    batch 32 only at 200 Mbit/s (at 128 its model-parallel step at np 2 takes 11 s)."""
    out = []
    for network in NETWORKS:
        for model in MODELS:
            for batch in EMULATED_BATCHES.get((network, model), batches):
                out += [Config(model, batch, np_, layout, network) for np_, layout in LAYOUTS]
    return out


def quick_configs(emulate):
    """Three small configurations: data and model at np 2 on shared memory, hybrid 2x2 at 1 Gbit/s (where
    netem may run)."""
    return [Config("simplecnn", 32, 2, "data"), Config("simplecnn", 32, 2, "model"),
            Config("simplecnn", 32, 4, "hybrid", "1gbit" if emulate else "unlimited")]


# ----------------------------------------------------------------------------------------------
# measurement and prediction
# ----------------------------------------------------------------------------------------------
def write_dataset(directory, input_shape, num_classes, train_samples, test_samples=TEST_SAMPLES, seed=0):
    """Random uint8 images and labels as a dataset pydtnn reads: CIFAR-10 binary files for (3, 32, 32), MNIST IDX
    files for (1, 28, 28). Returns the flags that select it (--dataset NAME --dataset_train_path directory)."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    images = rng.integers(0, 256, (train_samples + test_samples, *input_shape), dtype=np.uint8)
    labels = rng.integers(0, num_classes, train_samples + test_samples, dtype=np.uint8)
    splits = {"train": (images[:train_samples], labels[:train_samples]),
              "test": (images[train_samples:], labels[train_samples:])}
    if tuple(input_shape) == (3, 32, 32) and num_classes <= 256:
        files = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
        for split, (x, y) in splits.items():
            records = np.concatenate([y[:, None], x.reshape(len(x), -1)], axis=1)
            for name, part in zip(files[split], np.array_split(records, len(files[split]))):
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(part.tobytes())
        return ["--dataset", "cifar10", "--dataset_train_path", directory]
    if len(input_shape) == 3 and input_shape[0] == 1 and num_classes <= 256:
        for split, stem in (("train", "train"), ("test", "t10k")):
            x, y = splits[split]
            with open(os.path.join(directory, f"{stem}-images-idx3-ubyte"), "wb") as f:
                f.write(struct.pack(">4B3I", 0, 0, 8, 3, *x.shape[:1], *x.shape[2:]) + x.tobytes())
            with open(os.path.join(directory, f"{stem}-labels-idx1-ubyte"), "wb") as f:
                f.write(struct.pack(">4BI", 0, 0, 8, 1, len(y)) + y.tobytes())
        return ["--dataset", "mnist", "--dataset_train_path", directory]
    raise ValueError(f"no file layout for input shape {tuple(input_shape)} with {num_classes} classes; expected "
                     f"(3, 32, 32) (CIFAR-10 files) or (1, H, W) (MNIST IDX files), at most 256 classes")


def command(config, trace, warmup, steps, dataset, python=sys.executable, rss=None):
    """The argv that trains `config` for warmup + steps steps on `dataset` (write_dataset's flags), writing its
    traces to `trace` (and, rss given, each rank's peak resident set to that file, through GNU time)."""
    parallel = "hybrid" if config.layout == "pipeline_model" else config.layout
    train = [python, "-m", "pydtnn", "--model", config.model, "--global_batch_size", str(config.batch),
             "--parallel", parallel, *dataset, "--steps_per_epoch", str(warmup + steps),
             "--num_epochs", "1", "--learning_rate", validation.LR, "--tracing", "--tracer_output", trace,
             "--progress", "false", "--threads_per_process", "1"]
    if config.layout == "hybrid":
        train += ["--model_parallel_size", str(HYBRID_GROUP)]
    if config.layout in ("pipeline", "pipeline_model"):
        train += ["--pipeline_stages", str(config.stages), "--micro_batches", str(config.micro_batches),
                  "--pipeline_schedule", config.schedule]
    if config.layout == "pipeline_model":
        train += ["--model_parallel_size", str(HYBRID_GROUP)]
    if rss is not None:  # every rank appends its peak resident set (KiB) to this file
        train = ["/usr/bin/time", "-f", "%M", "-a", "-o", rss, *train]
    train = [mpiexec_path(), "-n", str(config.np), *train]
    if config.network != "unlimited":
        train = [python, validation.NETEM, "--rate", config.network, "--", *train]
    return train


def communication(measured):
    """(model-parallel collectives, exposed gradient reduction) in seconds per step, from combine_ranks' result:
    the inserted gather and dx-sum layers' forward + backward (rank-averaged medians), and the reducer's
    wait and blocking spans (slowest rank's median)."""
    mp = sum(t.get("forward_s", 0.0) + t.get("backward_s", 0.0) for name, t in measured["layers"].items()
             if name.endswith(MP_COMM))
    phases = measured["phases_s"]
    return mp, phases.get("wait", 0.0) + phases.get("blocking", 0.0)


def measure(config, warmup, steps, wait_s, tmp):
    """Train `config` once in fresh processes; the step, its phases, its communication and the cores other
    processes used meanwhile (None where /proc/stat is missing)."""
    from pydtnn import models

    trace = os.path.join(tmp, "trace.json")
    dataset = write_dataset(os.path.join(tmp, f"{config.model}-{config.batch}"), *models.defaults(config.model),
                            train_samples=(warmup + steps) * config.batch)
    rss = os.path.join(tmp, "rss.txt") if os.path.exists("/usr/bin/time") else None
    if rss and os.path.exists(rss):
        os.remove(rss)
    m, wall, foreign = validation.run_traced(command(config, trace, warmup, steps, dataset, rss=rss),
                                             validation.thread_env(1), tmp, trace, config.np, warmup, wait_s,
                                             config.label, RUN_TIMEOUT_S)
    mp_comm, reduce_wait = communication(m)
    peak = None
    if rss and os.path.exists(rss):
        with open(rss, encoding="utf-8") as f:
            peak = max(int(line) for line in f if line.strip().isdigit()) / 1024
    return {"step_s": m["step_s"], "steps_s": m["steps_s"], "phases_s": m["phases_s"], "mp_comm_s": mp_comm,
            "reduce_wait_s": reduce_wait, "warmup": warmup, "steps": steps, "wall_s": wall, "foreign_cores": foreign,
            "peak_rss_mb": peak}


def predicted(config, model, machine):
    """The performance model's step for `config` ({"step_s", "comm_s", "exposed_comm_s", "group_comm_s"}: the
    step, all communication, the part of it on the critical path, the model-parallel groups' collectives)."""
    from pydtnn.perfmodel.predict import predict

    split = {"hybrid": config.group, "pipeline_model": HYBRID_GROUP}.get(config.layout)
    p = predict(model, config.replica_batch, config.np, machine, reduction="bucketed", threads=1, algorithm="best",
                progress="test", optimizer="sgd_momentum",
                parallel="hybrid" if config.layout == "pipeline_model" else config.layout, model_parallel_size=split,
                pipeline_stages=config.stages if config.layout == "pipeline_model" else None,
                micro_batches=config.micro_batches, schedule=config.schedule)
    return {"step_s": p.step_s, "comm_s": p.comm_s, "exposed_comm_s": p.exposed_comm_s,
            "group_comm_s": p.group_comm_s, "bubble_s": p.bubble_s}


def predict_points(points, links, base):
    """Fill every point's "predicted" from its configuration on machine `base`, an emulated network's link taken
    from `links` (the run's link probes; no prediction where its network has none)."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend

    built = {}
    for p in points:
        config = Config(**p["config"])
        link = links.get(config.network)
        if config.network != "unlimited" and link is None:
            p["predicted"] = None
            continue
        if config.model not in built:
            built[config.model] = models.create(config.model, backend=CPUBackend(seed=0))
        p["predicted"] = predicted(config, built[config.model], validation.machine_for(base, config.np, link))


# ----------------------------------------------------------------------------------------------
# the table and the plot
# ----------------------------------------------------------------------------------------------
def speedups(points):
    """{label: data step / this step} at the same model, batch, np and network (None without a data point)."""
    data = {(c["model"], c["batch"], c["np"], c["network"]): p["measured"]["step_s"]
            for p in points for c in [p["config"]] if c["layout"] == "data"}
    out = {}
    for p in points:
        c = p["config"]
        ref = data.get((c["model"], c["batch"], c["np"], c["network"]))
        out[p["label"]] = None if ref is None else ref / p["measured"]["step_s"]
    return out


def table(points):
    """The markdown table of a run's points, in measuring order."""
    ms = lambda v: "" if v is None else (f"{1e3 * v:.1f}" if v >= 0.01 else f"{1e3 * v:.2f}")
    ratio = speedups(points)
    lines = [("| model | global batch | network | np | layout | batch per replica | step ms | samples/s | "
              "data step / this | model-parallel comm. ms | gradient wait ms | predicted ms | other cores |"),
             "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        c, m, pr = Config(**p["config"]), p["measured"], p["predicted"]
        foreign, r = m.get("foreign_cores"), ratio[p["label"]]
        lines.append(f"| {c.model} | {c.batch} | {c.network} | {c.np} | {c.name} | "
                     f"{c.replica_batch} | {ms(m['step_s'])} | {c.batch / m['step_s']:.1f} | "
                     f"{'' if r is None else f'{r:.2f}'} | {ms(m['mp_comm_s']) if c.group > 1 else ''} | "
                     f"{ms(m['reduce_wait_s']) if c.group < c.np else ''} | {ms(pr['step_s']) if pr else ''} | "
                     f"{'' if foreign is None else f'{foreign:.2f}'} |")
    return "\n".join(lines)


def pipeline_table(points):
    """The markdown table of a --pipelines run: step, throughput against data parallelism at the same np, the
    prediction, its bubble, and the peak memory per process."""
    ms = lambda v: "" if v is None else f"{1e3 * v:.0f}"
    ratio = speedups(points)
    lines = [("| model | network | np | layout | micro-batches | step ms | samples/s | data step / this | predicted ms "
              "| predicted bubble ms | peak MB per process | other cores |"),
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        c, m, pr = Config(**p["config"]), p["measured"], p["predicted"]
        r, peak, foreign = ratio[p["label"]], m.get("peak_rss_mb"), m.get("foreign_cores")
        piped = c.layout in ("pipeline", "pipeline_model")
        what = (f"pipeline {c.stages} of model {HYBRID_GROUP} ({c.schedule})" if c.layout == "pipeline_model" else
                f"pipeline ({c.schedule})" if piped else layout_name(c.np, c.layout))
        lines.append(f"| {c.model} | {c.network} | {c.np} | {what} | {c.micro_batches if piped else ''}"
                     f" | {ms(m['step_s'])} | {c.batch / m['step_s']:.1f} | {'' if r is None else f'{r:.2f}'} | "
                     f"{ms(pr['step_s']) if pr else ''} | {ms(pr.get('bubble_s')) if pr and piped else ''}"
                     f" | {'' if peak is None else f'{peak:.0f}'} | {'' if foreign is None else f'{foreign:.2f}'} |")
    return "\n".join(lines)


def report(run):
    """The markdown report: one line on the run, the table, the columns."""
    s = run["settings"]
    predicted_at = run.get("predicted_at", run["commit"])
    head = (f"{run['host']}; pydtnn {run['commit']}; {len(run['points'])} configurations, {s['warmup']} warm-up + "
            f"{s['steps']} timed steps each, 1 thread per process; script wall time {run['wall_s']:.0f} s"
            + (f"; predicted at {predicted_at} with {run.get('machine_file', '?')}" if predicted_at != run["commit"]
               else "") + ".")
    notes = ("step ms: median over the timed steps of the slowest rank's step. data step / this: the data layout's "
             "step at the same model, batch, np and network over this one (above 1: faster than data). "
             "model-parallel comm.: the inserted gathers and dx sums per step (waiting included). gradient wait: "
             "the reducer's exposed wait per step. predicted: pydtnn.perfmodel.predict on the same layout. "
             "other cores: CPU used by other processes during the run.")
    if any(p["config"].get("layout") in ("pipeline", "pipeline_model") for p in run["points"]):
        notes = ("step ms: median over the timed steps of the slowest rank's step. data step / this: data "
                 "parallelism's step at the same model, np and network over this one (above 1: faster than data). "
                 "predicted: pydtnn.perfmodel.predict on the same layout, cut, schedule and micro-batches; predicted "
                 "bubble: the part of it the busiest stage waits (fill, drain, messages). peak MB per process: "
                 "the largest maximum resident set over the run's ranks. other cores: CPU used by other processes "
                 "during the run.")
    busy = [p["label"] for p in run["points"] if (p["measured"].get("foreign_cores") or 0.0) > BUSY]
    disturbed = (f"{len(busy)} of {len(run['points'])} runs had other processes using more than {BUSY} cores "
                 f"(hatched in the plot){': ' + ', '.join(busy) if busy else ''}.")
    pipelined = any(p["config"].get("layout") in ("pipeline", "pipeline_model") for p in run["points"])
    return "\n".join([head, "", pipeline_table(run["points"]) if pipelined else table(run["points"]), "", notes, "",
                      disturbed])


LAYOUT_COLORS = {(2, "data"): "#9ecae1", (2, "model"): "#fdae6b", (4, "data"): "#3182bd", (4, "model"): "#e6550d",
                 (4, "hybrid"): "#31a354"}


def plot(run, path):
    """Step time (log scale) per layout: one panel per model (columns) and global batch (rows), bars grouped by
    network (every panel shows the run's networks; "not run" where a panel has none of a network's points);
    the prediction as a black tick over its bar; hatched: runs other processes disturbed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    points = run["points"]
    models = [m for m in MODELS if any(p["config"]["model"] == m for p in points)]
    models += sorted({p["config"]["model"] for p in points} - set(models))
    batches = sorted({p["config"]["batch"] for p in points})
    networks = [n for n in NETWORKS if any(p["config"]["network"] == n for p in points)]
    by_key = {(c["model"], c["batch"], c["network"], c["np"], c["layout"]): p for p in points for c in [p["config"]]}
    fig = Figure(figsize=(4.6 * len(models), 3.6 * len(batches)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(batches), len(models), squeeze=False)
    width = 0.8 / len(LAYOUTS)
    for row, batch in enumerate(batches):
        for col, model in enumerate(models):
            ax, heights = axes[row][col], []
            for g, network in enumerate(networks):
                for i, lay in enumerate(LAYOUTS):
                    p = by_key.get((model, batch, network, *lay))
                    if p is None:
                        continue
                    x, m = g + (i - (len(LAYOUTS) - 1) / 2) * width, p["measured"]
                    heights.append(1e3 * m["step_s"])
                    ax.bar(x, heights[-1], width, color=LAYOUT_COLORS[lay], edgecolor="black", linewidth=0.4,
                           hatch="///" if (m.get("foreign_cores") or 0.0) > BUSY else None)
                    if p["predicted"]:
                        ax.plot([x - width / 2, x + width / 2], [1e3 * p["predicted"]["step_s"]] * 2, color="black",
                                lw=1.6)
                if not any((model, batch, network, *lay) in by_key for lay in LAYOUTS):
                    ax.text(g, 0.5, "not run", transform=ax.get_xaxis_transform(), ha="center", color="gray")
            ax.set_yscale("log")
            if heights:  # bars on a log axis grow from its bottom: put it well below the lowest
                ax.set_ylim(min(heights) / 3, max(heights) * 1.6)
            ax.set_xlim(-0.5, len(networks) - 0.5)
            ax.set_xticks(range(len(networks)), [n if n != "unlimited" else "shared memory" for n in networks])
            ax.set_title(f"{model}, global batch {batch}", fontsize=10)
            ax.set_ylabel("step ms (log)")
            ax.grid(True, axis="y", which="both", alpha=0.25)
    handles = [Patch(color=LAYOUT_COLORS[lay], label=f"np {lay[0]} {layout_name(*lay)}") for lay in LAYOUTS]
    handles.append(Patch(color="black", label="predicted"))
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                         label=f"other processes used > {BUSY} cores"))
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=len(handles))
    fig.suptitle(f"Training step by parallel layout, same global batch ({run['host']}, one thread per process)",
                 fontsize=11)
    fig.savefig(path, dpi=100)


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def drive(args):
    from pydtnn.perfmodel import machine

    t_start = time.perf_counter()
    base = machine.load(args.machine)
    refusal = validation.netem_refusal()
    if refusal:
        print(f"parallelism: emulated networks skipped: {refusal}", file=sys.stderr)
    configs = (quick_configs(refusal is None) if args.quick else pipeline_configs() if args.pipelines
               else model_pipeline_configs() if args.model_pipelines else full_configs())
    configs = [c for c in configs if (refusal is None or c.network == "unlimited")
               and (not args.only or args.only in c.label)]
    links = {}
    for rate in sorted({c.network for c in configs if c.network != "unlimited"}, key=NETWORKS.index):
        print(f"link probe at {rate}", file=sys.stderr, flush=True)
        links[rate] = validation.probe_link(rate, nps=(2,))
    points = []
    with tempfile.TemporaryDirectory(prefix="parallelism-") as tmp:
        for i, config in enumerate(configs):
            meas = measure(config, args.warmup, args.steps, args.wait_idle, tmp)
            points.append({"label": config.label, "config": dataclasses.asdict(config), "measured": meas})
            predict_points(points[-1:], links, base)
            pred = points[-1]["predicted"]
            foreign = "?" if meas["foreign_cores"] is None else f"{meas['foreign_cores']:.2f}"
            print(f"[{i + 1}/{len(configs)}] {config.label}: {1e3 * meas['step_s']:.1f} ms"
                  + (f" (predicted {1e3 * pred['step_s']:.1f})" if pred else "")
                  + f", run {meas['wall_s']:.1f} s, other cores {foreign}", file=sys.stderr, flush=True)
    return {"host": validation.host(), "commit": validation.commit(),
            "machine_file": os.path.relpath(os.path.abspath(args.machine), ROOT), "netem": refusal or "used",
            "links": links, "points": points, "wall_s": time.perf_counter() - t_start,
            "settings": {"warmup": args.warmup, "steps": args.steps, "threads": 1, "learning_rate": validation.LR,
                         "data": f"random images in files, {TEST_SAMPLES} test samples",
                         "reduction": "bucketed (default)", "hybrid_group": HYBRID_GROUP}}


def output(run, out, plot_path):
    """Write the JSON and the PNG where asked; print the markdown report."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(validation.rounded(run), f, separators=(",", ":"))
            f.write("\n")
    if plot_path:
        plot(run, plot_path)
    print(report(run))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the JSON of every measurement (default docs/parallelism_benchmark.json; "
                                 "with --quick, none)")
    p.add_argument("--plot", help="the PNG (default docs/benchmarks_parallelism.png; with --quick, none)")
    p.add_argument("--machine", default=os.path.join(ROOT, "docs", "machine_vm.yaml"),
                   help="machine description the predictions use (default docs/machine_vm.yaml)")
    p.add_argument("--quick", action="store_true", help="3 small configurations (smoke test)")
    p.add_argument("--pipelines", action="store_true",
                   help="pipelines beside data parallelism (default output docs/pipeline_benchmark.json, no plot)")
    p.add_argument("--model_pipelines", action="store_true",
                   help="stages split over model-parallel groups beside data and hybrid parallelism at np 4 (default "
                        "output docs/model_pipeline_benchmark.json, no plot)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--wait_idle", type=float, default=0.0,
                   help="seconds to wait, before each run, for other processes to leave the cores (default 0)")
    p.add_argument("--only", help="only the configurations whose label contains this text")
    p.add_argument("--from_json", help="table and plot of a saved run instead of measuring; its configurations "
                                       "predicted again with this checkout's performance model and --machine")
    p.add_argument("--keep_predictions", action="store_true", help="with --from_json: the saved predictions")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            run = json.load(f)
        if not args.keep_predictions:
            from pydtnn.perfmodel import machine

            predict_points(run["points"], run.get("links", {}), machine.load(args.machine))
            run["machine_file"] = os.path.relpath(os.path.abspath(args.machine), ROOT)
            run["predicted_at"] = validation.commit()
        output(run, args.out, args.plot)
        return 0
    if args.pipelines or args.model_pipelines:
        args.out = args.out or os.path.join(ROOT, "docs", "pipeline_benchmark.json" if args.pipelines
                                            else "model_pipeline_benchmark.json")
    elif not args.quick:
        args.out = args.out or os.path.join(ROOT, "docs", "parallelism_benchmark.json")
        args.plot = args.plot or os.path.join(ROOT, "docs", "benchmarks_parallelism.png")
    output(drive(args), args.out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
