"""The memory model (pydtnn/perfmodel/memory.py) against the measured peak of real training steps, per process.

    python benchmarks/memory_validation.py [--out table.md] [--json docs/memory_validation.json]
                                           [--plot docs/perfmodel_memory.png] [--quick]

Each configuration (model, batch, optimizer, micro-batches, recompute) is measured in a fresh process: a
step of the same configuration at a small batch first (kernels compiled, untraced), then, under tracemalloc
from before the model is built, the model, its optimizer and three training steps (pydtnn.step.Step on
random images in the model's input shape); the measured peak is the largest traced memory during the steps.
Predicted: predict_memory's total for the same configuration, its activations and workspace probed at
batches 4 and 8 and extrapolated. Both count the training state above the interpreter, the libraries
and the batch itself.

Layouts of several processes (layers split over model-parallel groups, pipeline stages, both, and ZeRO's
sharded data parallelism) run under the venv's mpiexec (benchmarks/memory_worker.py), each process measured the same way; the busiest process's
measured peak is set against the prediction, which is of the process that holds the most.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

OPTIMIZERS = {"sgd_momentum": ("sgd", {"momentum": 0.9}), "adam": ("adam", {}), "sgd": ("sgd", {})}


def configs(quick=False):
    """One process's (model, batch, optimizer, micro-batches, recompute): 24 of them (3 with --quick)."""
    if quick:
        return [("simplecnn", 32, "sgd_momentum", 1, "none"), ("resnet20_cifar10", 16, "adam", 2, "none"),
                ("resnet20_cifar10", 16, "sgd", 1, "segments")]
    out = []
    for model in ("simplecnn", "resnet20_cifar10", "vgg11bn_cifar10", "mobilenetv1_cifar10"):
        out += [(model, 16, "sgd_momentum", 1, "none"), (model, 64, "sgd_momentum", 1, "none"),
                (model, 64, "adam", 1, "none"), (model, 64, "sgd", 4, "none"),
                (model, 64, "sgd_momentum", 1, "segments"), (model, 128, "sgd_momentum", 2, "all")]
    return out


def parallel_configs(quick=False):
    """(model, batch, optimizer, micro-batches, model_parallel_size, stages, schedule): 12 (2 with --quick)."""
    if quick:
        return [("resnet20_cifar10", 32, "sgd_momentum", 1, 2, 1, "1f1b"),
                ("resnet20_cifar10", 32, "sgd_momentum", 4, 2, 2, "1f1b")]
    return [("simplecnn", 64, "sgd_momentum", 1, 2, 1, "1f1b"), ("simplecnn", 64, "adam", 4, 1, 2, "gpipe"),
            ("resnet20_cifar10", 32, "sgd_momentum", 1, 2, 1, "1f1b"),
            ("resnet20_cifar10", 32, "sgd_momentum", 4, 1, 2, "1f1b"),
            ("resnet20_cifar10", 32, "sgd_momentum", 4, 1, 2, "gpipe"),
            ("resnet20_cifar10", 64, "sgd_momentum", 8, 1, 4, "1f1b"),
            ("resnet20_cifar10", 32, "adam", 4, 2, 2, "1f1b"),
            ("vgg11bn_cifar10", 32, "sgd_momentum", 1, 2, 1, "1f1b"),
            ("vgg11bn_cifar10", 32, "sgd_momentum", 4, 1, 2, "1f1b"),
            ("vgg11bn_cifar10", 32, "sgd_momentum", 4, 2, 2, "gpipe"),
            ("mobilenetv1_cifar10", 32, "adam", 1, 2, 1, "1f1b"),
            ("mobilenetv1_cifar10", 32, "adam", 4, 1, 2, "1f1b")]


def zero_configs(quick=False):
    """(model, batch per replica, optimizer, micro-batches, ZeRO stage, replicas): 10 (1 with --quick)."""
    if quick:
        return [("resnet20_cifar10", 32, "adam", 1, 2, 2)]
    return [("resnet20_cifar10", 32, "adam", 1, 1, 4), ("resnet20_cifar10", 32, "adam", 2, 2, 2),
            ("vgg11bn_cifar10", 32, "adam", 1, 1, 2), ("vgg11bn_cifar10", 32, "adam", 1, 1, 4),
            ("vgg11bn_cifar10", 32, "adam", 1, 2, 4), ("mobilenetv1_cifar10", 32, "sgd_momentum", 1, 2, 4),
            ("resnet20_cifar10", 32, "adam", 1, 3, 4), ("vgg11bn_cifar10", 32, "adam", 1, 3, 2),
            ("vgg11bn_cifar10", 32, "adam", 1, 3, 4), ("mobilenetv1_cifar10", 32, "sgd_momentum", 2, 3, 4)]


def reducer_configs(quick=False):
    """(model, batch per replica, optimizer, reducer SPEC (memory_worker.reduction_of), replicas): the reducers
    that keep state across steps, and the bucketed one beside them: 9 (2 with --quick)."""
    if quick:
        return [("simplecnn", 8, "sgd_momentum", "topk:density=0.01", 2), ("simplecnn", 8, "sgd_momentum", "stale", 2)]
    return [("simplecnn", 8, "sgd_momentum", spec, 2) for spec in
            ("bucketed", "bucketed:compression=fp16", "topk:density=0.01", "topk:density=0.01,momentum=0.9",
             "oktopk:density=0.01", "powersgd:rank=4", "stale", "local_sgd:every=2")] + [
            ("vgg11bn_cifar10", 8, "sgd_momentum", "powersgd:rank=4", 2)]


def measure_parallel(model, batch, optimizer, micro_batches, m, stages, schedule, env, zero=0, replicas=1,
                     reduction="bucketed", steps=2):
    """[each process's measured peak bytes] of a layout of m x stages processes, or of `replicas` data-parallel
    ones (sharded by ZeRO stage `zero`, where given; else reduced by the reducer SPEC `reduction`), over `steps`
    traced steps (benchmarks/memory_worker.py)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    n = replicas if zero or replicas > 1 else m * stages
    r = subprocess.run([mpiexec, "-n", str(n), sys.executable, os.path.join(HERE, "memory_worker.py"),
                        model, str(batch), "--optimizer", optimizer, "--micro_batches", str(micro_batches),
                        "--model_parallel_size", str(m), "--stages", str(stages), "--schedule", schedule,
                        "--zero", str(zero), "--replicas", str(replicas), "--reduction", reduction,
                        "--steps", str(steps)],
                       capture_output=True, text=True, env=env, timeout=900, check=True)
    peaks = {}
    for line in r.stdout.split("peak ")[1:]:  # ranks' lines may interleave
        rank, nbytes = line.split()[:2]
        peaks[int(rank)] = int(nbytes)
    return [peaks[r] for r in range(n)]


def measure(model_name, batch, optimizer, micro_batches, recompute):
    """Peak traced bytes of three training steps, in this process (called in a fresh one)."""
    import tracemalloc

    import numpy as np

    from pydtnn import losses, models, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.randomness import SampleStreams
    from pydtnn.step import Step

    shape, classes = models.defaults(model_name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = np.eye(classes, dtype=np.float32)[rng.integers(0, classes, batch)]
    name, hyper = OPTIMIZERS[optimizer]

    def step(n):
        model = models.create(model_name, input_shape=shape, num_classes=classes, backend=CPUBackend(np.float32, seed=0))
        return Step(model, losses.create("categorical_cross_entropy"),
                    optim.create(name, model.parameters(), backend=model.backend, **hyper),
                    accumulation_steps=micro_batches, recompute=recompute)

    step(2 * micro_batches).run(x[:2 * micro_batches], y[:2 * micro_batches])  # compiled, untraced
    tracemalloc.start()
    s = step(batch)
    tracemalloc.reset_peak()
    for _ in range(3):
        s.run(x, y, streams=SampleStreams(0, 0, np.arange(batch)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def predicted(model_name, batch, optimizer, micro_batches, recompute, m=1, stages=1, schedule="1f1b", zero=0,
              replicas=1, reduction=None):
    """predict_memory's Memory of a configuration; reduction: a reducer SPEC over the replicas (None: none)."""
    import numpy as np

    from memory_worker import reduction_of
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel.memory import predict_memory
    from pydtnn.plan import Reduction

    shape, classes = models.defaults(model_name)
    model = models.create(model_name, input_shape=shape, num_classes=classes, backend=CPUBackend(np.float32, seed=0))
    if reduction is not None:
        name, options = reduction_of(reduction)
        reduction = Reduction(name, options.pop("compression", "none"), "test", options)
    return predict_memory(model, batch, OPTIMIZERS[optimizer], micro_batches, recompute, pipeline_stages=stages,
                          schedule=schedule, model_parallel_size=m, zero=zero, replicas=replicas, reduction=reduction)


def plot(rows, path, host):
    from parity import parity_plot

    groups = {m: [(r["measured_mib"], r["predicted_mib"]) for r in rows if r["model"] == m]
              for m in sorted({r["model"] for r in rows})}
    parity_plot(path, groups, 1.1, "measured peak of a training step (MiB, traced)", "predicted (MiB)",
                f"Memory model, the busiest process of each layout ({host})", size=(6.2, 5.2))


def key(r):
    """What names a row's configuration: (model, batch, optimizer, micro-batches, recompute, layout)."""
    return r["model"], r["batch"], r["optimizer"], r["micro_batches"], r["recompute"], r["layout"]


def layout_name(m, stages, schedule, zero=0, replicas=1, reduction=None):
    """'one process', 'model 2', 'pipeline 2 (1f1b)', 'pipeline 2 (gpipe) x model 2', 'data 4, ZeRO 2',
    'data 2, topk:density=0.01'."""
    if zero:
        return f"data {replicas}, ZeRO {zero}"
    if reduction is not None:
        return f"data {replicas}, {reduction}"
    parts = ([f"pipeline {stages} ({schedule})"] if stages > 1 else []) + ([f"model {m}"] if m > 1 else [])
    return " x ".join(parts) or "one process"


def row(model, batch, opt, k, rc, m, stages, schedule, peaks, pred, zero=0, reduction=None):
    """One configuration's JSON row (peaks: each process's measured bytes), printed as it is made."""
    meas = max(peaks)
    out = {"model": model, "batch": batch, "optimizer": opt, "micro_batches": k, "recompute": rc,
           "np": len(peaks), "model_parallel_size": m, "pipeline_stages": stages, "schedule": schedule, "zero": zero,
           "layout": layout_name(m, stages, schedule, zero, len(peaks), reduction), "measured_mib": meas / 2**20,
           "per_process_mib": [v / 2**20 for v in peaks], "predicted_mib": pred.total / 2**20,
           "error": pred.total / meas - 1, "parts_mib": {n: v / 2**20 for n, v in pred.parts.items()}}
    print(f"{model} b{batch} {opt} M{k} {rc} {out['layout']}: measured {meas / 2**20:.1f} MiB, predicted "
          f"{pred.total / 2**20:.1f} MiB ({100 * out['error']:+.1f}%)", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 configurations")
    p.add_argument("--only", choices=("one", "split", "zero", "reducers"), action="append",
                   help="measure only these sets (repeatable): one process, split layers and pipelines, ZeRO, the "
                        "data-parallel reducers (default: all)")
    p.add_argument("--out", help="the markdown table")
    p.add_argument("--json", help="every configuration, as JSON")
    p.add_argument("--plot", help="predicted against measured, a PNG")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of --json's file (an earlier run) and measure only the configurations it lacks")
    p.add_argument("--measure", nargs=5, metavar=("MODEL", "BATCH", "OPT", "M", "RECOMPUTE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        m, b, o, k, r = args.measure
        print(measure(m, int(b), o, int(k), r))
        return 0
    import perfmodel_validation as validation

    rows, kept = [], {}
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as f:
            kept = {key(r): r for r in json.load(f)["rows"]}

    def measured(config_key):
        """The kept row of that configuration, put in `rows`, if any."""
        if config_key in kept:
            rows.append(kept[config_key])
            return True
        return False

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    sets = set(args.only or ("one", "split", "zero", "reducers"))
    for config in configs(args.quick) if "one" in sets else ():
        if measured((*config, "one process")):
            continue
        pred = predicted(*config)
        r = subprocess.run([sys.executable, __file__, "--measure", *map(str, config)], capture_output=True, text=True,
                           env=env, timeout=600, check=True)
        model, batch, opt, k, rc = config
        rows.append(row(model, batch, opt, k, rc, 1, 1, None, [int(r.stdout.strip().splitlines()[-1])], pred))
    for model, batch, opt, k, m, stages, schedule in parallel_configs(args.quick) if "split" in sets else ():
        if measured((model, batch, opt, k, "none", layout_name(m, stages, schedule if stages > 1 else None))):
            continue
        pred = predicted(model, batch, opt, k, "none", m, stages, schedule)
        peaks = measure_parallel(model, batch, opt, k, m, stages, schedule, env)
        rows.append(row(model, batch, opt, k, "none", m, stages, schedule if stages > 1 else None, peaks, pred))
    for model, batch, opt, k, z, replicas in zero_configs(args.quick) if "zero" in sets else ():
        if measured((model, batch, opt, k, "none", layout_name(1, 1, None, z, replicas))):
            continue
        pred = predicted(model, batch, opt, k, "none", zero=z, replicas=replicas)
        peaks = measure_parallel(model, batch, opt, k, 1, 1, "1f1b", env, z, replicas)
        rows.append(row(model, batch, opt, k, "none", 1, 1, None, peaks, pred, z))
    for model, batch, opt, spec, replicas in reducer_configs(args.quick) if "reducers" in sets else ():
        if measured((model, batch, opt, 1, "none", layout_name(1, 1, None, 0, replicas, spec))):
            continue
        pred = predicted(model, batch, opt, 1, "none", replicas=replicas, reduction=spec)
        peaks = measure_parallel(model, batch, opt, 1, 1, 1, "1f1b", env, replicas=replicas, reduction=spec,
                                 steps=3)  # what a reducer makes in a step (local SGD's average) meets the next peak
        rows.append(row(model, batch, opt, 1, "none", 1, 1, None, peaks, pred, reduction=spec))
    errors = [abs(r["error"]) for r in rows]
    host = validation.host()
    header = ("| model | batch | optimizer | micro-batches | recompute | layout | measured MiB | predicted MiB | error | "
              "activations MiB | workspace MiB | reducer MiB |")
    lines = [f"{host}; float32, one thread per process, {len(rows)} configurations (measured: the busiest process)",
             "", header, "| --- | ---: | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['batch']} | {r['optimizer']} | {r['micro_batches']} | {r['recompute']} | "
              f"{r['layout']} | {r['measured_mib']:.1f} | {r['predicted_mib']:.1f} | {100 * r['error']:+.1f}% | "
              f"{r['parts_mib']['activations']:.1f} | {r['parts_mib']['workspace']:.1f} | "
              f"{r['parts_mib'].get('reducer', 0):.1f} |" for r in rows]  # rows before the reducer part: none
    several = [abs(r["error"]) for r in rows if r["np"] > 1]
    lines += ["", f"median |error| {100 * statistics.median(errors):.1f}%, worst {100 * max(errors):.1f}%"
              + (f"; {len(several)} layouts of several processes: median {100 * statistics.median(several):.1f}%, "
                 f"worst {100 * max(several):.1f}%" if several else "")]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"host": host, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
