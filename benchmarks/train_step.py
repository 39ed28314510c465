"""One whole training step (forward, loss, backward, SGD update), pydtnn against PyTorch CPU, with peak memory.

    python benchmarks/train_step.py [--models simplecnn,vgg11_cifar10,resnet20_cifar10,mobilenetv1_cifar10]
                                    [--batches 32,64] [--threads 1,2] [--warmup 3] [--steps N] [--wait_idle 15] [--retries 1]
                                    [--rounds 1] [--conv_autotune] [--json FILE] [--out FILE] [--plot FILE.png]
    python benchmarks/train_step.py --quick                   # smoke run: batch 32, 1 thread, 1 + 2 steps
    python benchmarks/train_step.py --from_json FILE [FILE ...] [--out FILE] [--plot FILE.png]

pydtnn: `Trainer.train_step`, what `fit` runs per batch: forward with training=True, SoftmaxCrossEntropy,
backward, SGD(momentum=0.9).step() (or AdamW with --optimizer adamw). Token models (gpt_nano) take random
token ids and score every position. PyTorch: the same network built by torch_equivalent.to_torch from the
same pydtnn model (same layers, same initial weights), trained by the loop a PyTorch user writes:
opt.zero_grad(); loss = nn.CrossEntropyLoss()(net(x), y); loss.backward(); opt.step(); loss.item().
Both in float32 on synthetic data (three random batches, rotated, so caches flatter neither side).

Every (library, model, batch, threads) runs in a fresh process (this script with --worker), so its peak
resident memory (VmHWM, the high-water mark of its resident set) is its own: interpreter, imported libraries, model, optimizer state
and activations. The pydtnn worker never imports torch. Same initial weights: the driver builds the
pydtnn model from seed 0, saves its PyTorch twin with torch.save for the torch worker, and passes the
parameters' SHA-256; the pydtnn worker builds the model from seed 0 again and checks the hash.

Threads: pydtnn's set_threads sizes its pool (which splits every kernel, GEMMs included, and runs BLAS
with one thread inside each chunk), torch.set_num_threads PyTorch's pool, and the worker starts with
OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS set to the same count. A cell is the
median step time after the warm-up steps. Before each worker the driver waits (up to --wait_idle s) for
other processes to leave the cores; each worker measures how many cores other processes used during its
timed steps (/proc/stat minus its own CPU time), and the report shows it; a measurement during which they
used more than 0.25 cores is taken again (--retries times at most) and the least disturbed one kept.
With --rounds R, each configuration is measured R times, pydtnn and PyTorch alternating (each time in a
fresh process), so that both sides see the machine's slow and fast minutes alike: the table gives each
side's median round, and a column the ratio of each round's pair.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

MODELS = ("simplecnn", "vgg11_cifar10", "resnet20_cifar10", "mobilenetv1_cifar10")
# timed steps per model (after the warm-up): fewer for the slow ones, to keep a full run near 10 minutes
STEPS = {"simplecnn": 30, "vgg11_cifar10": 10, "resnet20_cifar10": 20, "mobilenetv1_cifar10": 12}
LIBS = ("pydtnn", "torch")
LR, MOMENTUM = 0.001, 0.9
BUSY = 0.25  # cores used by other processes above which a measurement is taken again (--retries) and hatched


# ----------------------------------------------------------------------------------------------
# measuring, inside a worker
# ----------------------------------------------------------------------------------------------
def busy_seconds():
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_seconds(who=resource.RUSAGE_SELF):
    """CPU-seconds of this process (all its threads), or of its finished children."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def peak_rss_mb():
    """Peak resident memory of this process so far, in MiB.

    VmHWM of /proc/self/status where there is one: on Linux, getrusage's ru_maxrss of a process started
    by fork + exec also counts the parent's peak before the exec (the driver's, here). Both are in KiB.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_batches(batch, shape, classes):
    """Three (x, y) batches: x float32 (batch, *shape) standard normal, y int64 labels in [0, classes); for a
    token model (shape (T,)), x token ids in [0, classes) (as float32) and y (batch, T) next tokens."""
    rng = np.random.default_rng([batch, 7])
    if len(shape) == 1:
        return [(rng.integers(0, classes, (batch, shape[0])).astype(np.float32), rng.integers(0, classes, (batch, shape[0])))
                for _ in range(3)]
    return [(rng.standard_normal((batch,) + tuple(shape), dtype=np.float32), rng.integers(0, classes, batch))
            for _ in range(3)]


def torch_optimizer(name, params):
    """The PyTorch optimizer the pydtnn worker's `optim.create(name, ...)` matches: SGD with momentum, or AdamW."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def time_steps(step, warmup, steps):
    """Run step(i) warmup + steps times; (times of the timed steps in s, cores other processes used meanwhile)."""
    for i in range(warmup):
        step(i)
    times = []
    t0, b0, o0 = time.perf_counter(), busy_seconds(), own_seconds()
    for i in range(steps):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    foreign = max(0.0, (busy_seconds() - b0 - (own_seconds() - o0)) / wall) if b0 is not None else None
    return times, foreign


def pydtnn_worker(args):
    from threadpoolctl import threadpool_limits

    import pydtnn
    from pydtnn import losses, models, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.trainer import Trainer

    import_mb = peak_rss_mb()
    backend = CPUBackend(seed=0, autotune=True) if args.conv_autotune else CPUBackend(seed=0)
    model = models.create(args.model, backend=backend)
    if model.params_sha256() != args.sha256:
        raise SystemExit(f"train_step.py: pydtnn {args.model} from seed 0 has parameters {model.params_sha256()[:12]}, "
                         f"the driver's had {args.sha256[:12]}: the two libraries would not start equal")
    options = {"lr": LR, "weight_decay": 0.01} if args.optimizer == "adamw" else {"lr": LR, "momentum": MOMENTUM}
    opt = optim.create(args.optimizer, model.parameters(), **options)
    trainer = Trainer(model, losses.SoftmaxCrossEntropy(), opt, progress=False)
    data = synthetic_batches(args.batch, model.input_shape, model.output_shape[-1])
    blas_threads = args.threads
    # pydtnn's thread pool, BLAS at one thread inside each chunk: runtime.configure, or in checkouts older
    # than pydtnn/runtime.py, backends/threads.py (asked by file: an editable install of another checkout
    # would otherwise lend its own pydtnn.runtime)
    package = os.path.dirname(os.path.abspath(pydtnn.__file__))
    if os.path.exists(os.path.join(package, "runtime.py")):
        from pydtnn import runtime

        blas_threads = runtime.configure(threads=args.threads)["blas_threads"]
    elif os.path.exists(os.path.join(package, "backends", "threads.py")):
        from pydtnn.backends import threads

        threads.set_threads(args.threads)
        blas_threads = getattr(threads, "BLAS_THREADS", blas_threads)
    with threadpool_limits(blas_threads):
        if args.conv_autotune:  # the measured algorithms, at this thread count, before the warm-up steps
            backend.tune_convolutions(say=lambda line: print(line, file=sys.stderr, flush=True))
        times, foreign = time_steps(lambda i: trainer.train_step(*data[i % 3]), args.warmup, args.steps)
    return record(args, times, foreign, import_mb)


def torch_worker(args):
    import torch
    from torch import nn

    torch.set_num_threads(args.threads)
    import_mb = peak_rss_mb()
    net = torch.load(args.twin, weights_only=False).train()
    opt = torch_optimizer(args.optimizer, net.parameters())
    loss_fn = nn.CrossEntropyLoss()
    shape = tuple(args.shape)
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in synthetic_batches(args.batch, shape, args.classes)]

    def step(i):
        x, y = data[i % 3]
        opt.zero_grad()
        out = net(x)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1))  # a token model: every position
        loss.backward()
        opt.step()
        return loss.item()

    times, foreign = time_steps(step, args.warmup, args.steps)
    return record(args, times, foreign, import_mb)


def record(args, times, foreign, import_mb):
    rec = {"lib": args.worker, "model": args.model, "batch": args.batch, "threads": args.threads,
           "step_ms": 1e3 * float(np.median(times)), "times_ms": [1e3 * t for t in times],
           "peak_rss_mb": peak_rss_mb(), "import_rss_mb": import_mb, "foreign_cores": foreign}
    with open(args.result, "w", encoding="utf-8") as f:
        json.dump(rec, f)


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def wait_idle(max_wait, threshold=0.15, window=1.0):
    """Wait (up to max_wait s) until other processes use less than `threshold` cores over `window` s."""
    t0 = time.perf_counter()
    while max_wait > 0 and busy_seconds() is not None:
        b0, o0 = busy_seconds(), own_seconds() + own_seconds(resource.RUSAGE_CHILDREN)
        time.sleep(window)
        load = (busy_seconds() - b0 - (own_seconds() + own_seconds(resource.RUSAGE_CHILDREN) - o0)) / window
        if load < threshold:
            return
        if time.perf_counter() - t0 > max_wait:
            print(f"  (machine still busy, {load:.2f} cores used by other processes; running anyway)",
                  file=sys.stderr, flush=True)
            return


def run_worker(lib, name, batch, threads, steps, args, prepared, tmp):
    """One fresh process measuring one configuration; returns its record."""
    result = os.path.join(tmp, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", lib, "--model", name, "--batch", str(batch),
           "--threads", str(threads), "--warmup", str(args.warmup), "--steps", str(steps), "--result", result,
           "--optimizer", getattr(args, "optimizer", "sgd")]  # ab_step.py passes its own args (SGD)
    if lib == "pydtnn":
        cmd += ["--sha256", prepared["sha256"]] + (["--conv_autotune"] if args.conv_autotune else [])
    else:
        cmd += ["--twin", prepared["twin"], "--classes", str(prepared["classes"]),
                "--shape", *map(str, prepared["shape"])]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    best = None
    for attempt in range(1 + args.retries):
        wait_idle(args.wait_idle)
        proc = subprocess.run(cmd, check=False, env=env, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"train_step.py: worker failed with exit code {proc.returncode}: {' '.join(cmd)}")
        with open(result, encoding="utf-8") as f:
            rec = json.load(f)
        rec["steps"], rec["attempts"] = steps, attempt + 1
        if best is None or (rec["foreign_cores"] or 0.0) < (best["foreign_cores"] or 0.0):
            best = rec
        if (rec["foreign_cores"] or 0.0) <= BUSY:
            break
        print(f"  ({lib} {name} batch {batch}, {threads} thread(s): other processes used "
              f"{_cores(rec['foreign_cores'])} cores{'; measuring again' if attempt < args.retries else ''})",
              file=sys.stderr, flush=True)
    rec = best
    print(f"  {lib:6s} {name} batch {batch}, {threads} thread(s): {rec['step_ms']:.1f} ms/step, peak RSS "
          f"{rec['peak_rss_mb']:.0f} MB, other processes {_cores(rec['foreign_cores'])} cores",
          file=sys.stderr, flush=True)
    return rec


def median_round(recs):
    """One configuration's record from its rounds (in the order measured): the round with the median step
    time (the lower of the two middle ones for an even count), with every round's step time and
    other-process load added."""
    rec = dict(sorted(recs, key=lambda r: r["step_ms"])[(len(recs) - 1) // 2])
    rec["rounds_ms"] = [r["step_ms"] for r in recs]
    rec["rounds_foreign_cores"] = [r["foreign_cores"] for r in recs]
    return rec


def prepare(name, tmp):
    """Build the pydtnn model from seed 0 and save its PyTorch twin; what the workers need to start equal."""
    import torch
    from torch_equivalent import to_torch

    from pydtnn import models
    from pydtnn.backends import CPUBackend

    model = models.create(name, backend=CPUBackend(seed=0))
    twin = os.path.join(tmp, f"{name}.pt")
    torch.save(to_torch(model), twin)
    return {"sha256": model.params_sha256(), "twin": twin, "shape": list(model.input_shape),
            "classes": model.output_shape[-1], "params": model.count_params()}


def drive(args):
    names = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    records, params = [], {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            prepared = prepare(name, tmp)
            params[name] = prepared["params"]
            steps = args.steps or STEPS.get(name, 10)
            for batch in batches:
                for t in threads:
                    rounds = {lib: [] for lib in LIBS}
                    for _ in range(args.rounds):
                        for lib in LIBS:
                            rounds[lib].append(run_worker(lib, name, batch, t, steps, args, prepared, tmp))
                    records += [median_round(rounds[lib]) for lib in LIBS]
    run = {"machine": machine_info(), "pydtnn": pydtnn_source(), "args": vars(args), "params": params,
           "wall_s": time.perf_counter() - t0, "records": records}
    output(run, args)


def output(run, args):
    text = report(run)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(run, f, indent=1)
    if args.plot:
        plot(run, args.plot)


def machine_info():
    import torch
    from threadpoolctl import threadpool_info

    try:
        from pydtnn.backends.cpu.autotune import cpu_info

        cpu, isa = cpu_info()
    except ImportError:  # a pydtnn older than autotune.py
        cpu, isa = "unknown", None
    if cpu == "unknown":
        cpu = platform.processor() or platform.machine()
    blas = next((f"{i['internal_api']} {i['version']} ({i.get('architecture') or '?'} kernels)"
                 for i in threadpool_info() if i["user_api"] == "blas"), "unknown BLAS")
    return {"cpu": cpu, "isa": isa, "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "blas": blas, "torch": torch.__version__}


def pydtnn_source():
    """Where the imported pydtnn comes from: path, git commit, and whether pydtnn/ has uncommitted changes."""
    import pydtnn

    root = os.path.dirname(os.path.dirname(os.path.abspath(pydtnn.__file__)))
    info = {"path": root, "commit": None, "dirty": None}
    try:
        git = ["git", "-C", root]
        info["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True, timeout=30).stdout.strip()
        info["dirty"] = bool(subprocess.run(git + ["status", "--porcelain", "--", "pydtnn"], capture_output=True,
                                            text=True, check=True, timeout=30).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def merge(runs):
    """One run from several saved ones: records of a later run replace those of the same configuration."""
    out = dict(runs[0])
    records = {}
    for run in runs:
        for r in run["records"]:
            records[(r["lib"], r["model"], r["batch"], r["threads"])] = r
    out["records"] = list(records.values())
    out["remeasured"] = runs[0].get("remeasured", []) + [
        {"pydtnn": run["pydtnn"], "args": run["args"], "wall_s": run["wall_s"],
         "configs": sorted({(r["model"], r["batch"], r["threads"]) for r in run["records"]})} for run in runs[1:]]
    return out


def _cores(v):
    return "?" if v is None else f"{v:.2f}"


def _find(records, lib, model, batch, threads):
    for r in records:
        if (r["lib"], r["model"], r["batch"], r["threads"]) == (lib, model, batch, threads):
            return r
    return None


def rows(run):
    """(model, batch, threads, ours record, torch record) for every configuration measured by both."""
    out = []
    for r in run["records"]:
        if r["lib"] == "pydtnn":
            t = _find(run["records"], "torch", r["model"], r["batch"], r["threads"])
            if t is not None:
                out.append((r["model"], r["batch"], r["threads"], r, t))
    return out


def report(run):
    m, src, a = run["machine"], run["pydtnn"], run["args"]
    commit = src["commit"] or "unknown commit"
    if src["dirty"]:
        commit += " plus uncommitted changes in pydtnn/"
    steps = ", ".join(f"{n} {a['steps'] or STEPS.get(n, 10)}" for n in a["models"].split(","))
    rounds = any(len(r.get("rounds_ms", ())) > 1 for r in run["records"])
    isa = f" ({m['isa']})" if m.get("isa") else ""  # records written before the ISA was recorded have none
    lines = [(f"{m['cpu']}{isa}, {m['cpus']} cores; Python {m['python']}, NumPy {m['numpy']} with {m['blas']}, "
             f"PyTorch {m['torch']}"), "",
             (f"pydtnn at {commit} ({src['path']}). float32, "
             f"{'AdamW(lr=' + str(LR) + ', weight_decay=0.01)' if a.get('optimizer') == 'adamw' else f'SGD(lr={LR}, momentum={MOMENTUM})'}, softmax "
             f"cross-entropy; {a['warmup']} warm-up step(s), then the median of {steps} timed steps; "
             f"script wall time {run['wall_s']:.0f} s."
             + (" Convolution algorithms measured per layer shape (autotune)." if a.get("conv_autotune") else "")),
             "",
             ("| model | batch | threads | ours ms/step | torch ms/step | ours/torch | ours peak RSS MB "
             "| torch peak RSS MB | RSS ratio | above imports MB (ours / torch) "
             "| other processes, cores (ours / torch) |" + (" ours/torch per round |" if rounds else "")),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if rounds else "")]
    for model, batch, threads, r, t in rows(run):
        lines.append(f"| {model} | {batch} | {threads} | {r['step_ms']:.1f} | {t['step_ms']:.1f} | "
                     f"{r['step_ms'] / t['step_ms']:.2f} | {r['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | "
                     f"{r['peak_rss_mb'] / t['peak_rss_mb']:.2f} | {r['peak_rss_mb'] - r['import_rss_mb']:.0f} / "
                     f"{t['peak_rss_mb'] - t['import_rss_mb']:.0f} | {_cores(r['foreign_cores'])} / "
                     f"{_cores(t['foreign_cores'])} |" + (f" {_pairs(r, t)} |" if rounds else ""))
    lines += speedup_table(run)
    for again in run.get("remeasured", []):
        b = again["args"]
        names = ", ".join(dict.fromkeys(c[0] for c in again["configs"]))
        lines += ["", (f"Measured again in a later run and replaced above: {names} (`--models {b['models']} "
                       f"--batches {b['batches']} --threads {b['threads']}`, {b['warmup']} warm-up step(s), "
                       f"{b['steps'] or 'default'} timed steps, pydtnn at {again['pydtnn']['commit']}"
                       f"{' plus uncommitted changes' if again['pydtnn']['dirty'] else ''}).")]
    if rounds:
        lines += ["", ("Measured in rounds, pydtnn and PyTorch alternating, each round in fresh processes: a "
                       "side's ms/step, memory and load are its median round's; the last column is each round's "
                       "ours / torch, in the order measured.")]
    foreign = [r["foreign_cores"] for r in run["records"] if r["foreign_cores"] is not None]
    imports = {lib: [r["import_rss_mb"] for r in run["records"] if r["lib"] == lib] for lib in LIBS}
    spread = [1 - min(r["times_ms"]) / r["step_ms"] for r in run["records"] if r["times_ms"]]
    if spread:
        lines += ["", (f"Step-to-step spread: the fastest timed step of a configuration was {np.median(spread):.0%} "
                       f"below its median (median over configurations; at most {max(spread):.0%}).")]
    lines += ["", (f"Other processes on the machine used {min(foreign):.2f} to {max(foreign):.2f} cores "
                   f"(median {np.median(foreign):.2f}) during the timed steps of the runs (column 'other processes')."
                   if foreign else "CPU use of other processes not measured (no /proc/stat)."),
              "", ("Peak RSS is the whole worker process. After its imports, before building the model, the "
                   "pydtnn worker held " + _range(imports["pydtnn"]) + " MB and the PyTorch worker "
                   + _range(imports["torch"]) + " MB; 'above imports' is the peak minus that: model, optimizer "
                   "state, activations and workspace.")]
    return "\n".join(lines) + "\n"


def speedup_table(run):
    """Markdown lines: per model and batch, each library's speed-up from 1 thread to each larger count measured,
    beside the ratio ours / torch at each count, so that a scaling loss shows at a glance ([] with one count)."""
    by = {(m, b, t): (r, q) for m, b, t, r, q in rows(run)}
    pairs = sorted({(m, b) for m, b, _ in by}, key=lambda mb: list(dict.fromkeys(k[0] for k in by)).index(mb[0]))
    counts = sorted({t for _, _, t in by if t > 1})
    out = []
    for n in counts:
        body = []
        for m, b in pairs:
            if (m, b, 1) in by and (m, b, n) in by:
                (r1, q1), (rn, qn) = by[(m, b, 1)], by[(m, b, n)]
                body.append(f"| {m} | {b} | {r1['step_ms'] / rn['step_ms']:.2f}x | "
                            f"{q1['step_ms'] / qn['step_ms']:.2f}x | {r1['step_ms'] / q1['step_ms']:.2f} | "
                            f"{rn['step_ms'] / qn['step_ms']:.2f} |")
        if body:
            out += ["", f"Speed-up from 1 to {n} threads (median step times above):", "",
                    f"| model | batch | ours 1 -> {n} threads | torch 1 -> {n} threads | ours/torch at 1 | "
                    f"ours/torch at {n} |", "| --- | ---: | ---: | ---: | ---: | ---: |", *body]
    return out


def _pairs(ours, torch):
    """Each round's ratio ours / torch, in the order measured ('' when either side has no rounds)."""
    a, b = ours.get("rounds_ms", []), torch.get("rounds_ms", [])
    return ", ".join(f"{x / y:.2f}" for x, y in zip(a, b)) if len(a) == len(b) > 1 else ""


def _range(values):
    return f"{min(values):.0f}" if max(values) - min(values) < 1 else f"{min(values):.0f}-{max(values):.0f}"


def plot(run, path, busy=BUSY):
    """Bars of ours / PyTorch (time per step, peak RSS) per model, one per (batch, threads); hatched where
    other processes used more than `busy` cores while either side was timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator

    table = rows(run)
    models = list(dict.fromkeys(row[0] for row in table))
    configs = list(dict.fromkeys((row[1], row[2]) for row in table))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    width = 0.8 / max(len(configs), 1)
    panels = ((axes[0], "step_ms", "time per step, ours / PyTorch", ((1.0, "red", "1.0: as fast as PyTorch"),)),
              (axes[1], "peak_rss_mb", "peak RSS, ours / PyTorch",
               ((1.0, "red", "1.0: as much as PyTorch"), (1.2, "orange", "1.2: target"))))
    for ax, key, title, marks in panels:
        top = 1.0
        for k, (batch, threads) in enumerate(configs):
            vals, hatches = [], []
            for model in models:
                row = next((row for row in table if row[:3] == (model, batch, threads)), None)
                vals.append(row[3][key] / row[4][key] if row else np.nan)
                foreign = [r["foreign_cores"] or 0.0 for r in row[3:]] if row else [0.0]
                hatches.append("///" if max(foreign) > busy else "")
            top = max(top, np.nanmax(vals))
            bars = ax.bar(np.arange(len(models)) + k * width, vals, width, color=f"C{k}")
            for bar, hatch in zip(bars, hatches):
                bar.set_hatch(hatch)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        for mark, color, label in marks:
            ax.axhline(mark, color=color, lw=0.9, ls="--", label=label)
        ax.set_xticks(np.arange(len(models)) + width * (len(configs) - 1) / 2, models, fontsize=8)
        if top > 4:  # a log scale keeps 0.5 and 2 equally far from 1
            ax.set_yscale("log", base=2)
            ax.set_ylim(0.2, 1.6 * top)
            ax.yaxis.set_major_locator(FixedLocator([t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64) if t <= top * 1.6]))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        else:
            ax.set_ylim(0, 1.12 * max(top, max(m for m, _, _ in marks)))
        ax.set_title(title)
        ax.set_ylabel("ratio (below 1: pydtnn better)")
        ax.grid(alpha=0.3, axis="y")
        handles = [Patch(color=f"C{k}", label=f"batch {b}, {t} thread{'s' * (t > 1)}") for k, (b, t) in enumerate(configs)]
        handles += ax.get_lines()
        if any(bar.get_hatch() for c in ax.containers for bar in c):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                                 label=f"other processes used > {busy} cores"))
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3)
    src = run["pydtnn"]
    fig.suptitle(f"Training step, pydtnn ({src['commit'] or '?'}{'+' if src['dirty'] else ''}) against PyTorch "
                 f"{run['machine']['torch']}, {run['machine']['cpus']} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="pydtnn zoo names, comma-separated")
    p.add_argument("--batches", default="32,64", help="batch sizes, comma-separated")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--steps", type=int, help="timed steps of every model (default: per model, " +
                   ", ".join(f"{k} {v}" for k, v in STEPS.items()) + ")")
    p.add_argument("--wait_idle", type=float, default=15,
                   help="before each worker, wait up to this many seconds for other processes to leave the cores")
    p.add_argument("--retries", type=int, default=1,
                   help=f"measure a configuration again (up to this many times) when other processes used more than "
                        f"{BUSY} cores meanwhile; the least disturbed measurement is kept")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each configuration this many times, pydtnn and PyTorch alternating; report each "
                        "side's median round and every round's ratio")
    p.add_argument("--conv_autotune", action="store_true",
                   help="pydtnn measures each convolution shape's algorithm (CPUBackend(autotune=True), its cache "
                        "in ~/.cache/pydtnn) instead of the threshold choice")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="SGD with momentum 0.9 (default), or AdamW (weight decay 0.01), lr 0.001 both")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 32, 1 thread, 1 warm-up + 2 timed steps")
    p.add_argument("--out", help="also write the report (markdown) here")
    p.add_argument("--json", help="also write every record here")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of the ratios ours / PyTorch")
    p.add_argument("--from_json", metavar="FILE", nargs="+",
                   help="report (and --out, --plot) a run saved with --json; with several, a configuration "
                        "measured again in a later file takes that file's numbers")
    p.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--sha256", help=argparse.SUPPRESS)
    p.add_argument("--twin", help=argparse.SUPPRESS)
    p.add_argument("--classes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shape", type=int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        return pydtnn_worker(args) if args.worker == "pydtnn" else torch_worker(args)
    if args.from_json:
        runs = []
        for path in args.from_json:
            with open(path, encoding="utf-8") as f:
                runs.append(json.load(f))
        return output(merge(runs), args)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.quick:
        args.batches, args.threads, args.warmup, args.steps, args.wait_idle, args.retries = "32", "1", 1, 2, 0, 0
    return drive(args)


if __name__ == "__main__":
    main()
