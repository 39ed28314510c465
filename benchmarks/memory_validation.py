"""The memory model (pydtnn/perfmodel/memory.py) against the measured peak of real training steps, one process.

    python benchmarks/memory_validation.py [--out table.md] [--json docs/memory_validation.json]
                                           [--plot docs/perfmodel_memory.png] [--quick]

Each configuration (model, batch, optimizer, micro-batches, recompute) is measured in a fresh process: a
step of the same configuration at a small batch first (kernels compiled, untraced), then, under tracemalloc
from before the model is built, the model, its optimizer and three training steps (pydtnn.step.Step on
random images in the model's input shape); the measured peak is the largest traced memory during the steps.
Predicted: predict_memory's total for the same configuration, its activations and workspace probed at
batches 4 and 8 and extrapolated. Both count the training state above the interpreter, the libraries
and the batch itself.
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
    """(model, batch, optimizer, micro-batches, recompute): 24 of them (3 with --quick)."""
    if quick:
        return [("simplecnn", 32, "sgd_momentum", 1, "none"), ("resnet20_cifar10", 16, "adam", 2, "none"),
                ("resnet20_cifar10", 16, "sgd", 1, "segments")]
    out = []
    for model in ("simplecnn", "resnet20_cifar10", "vgg11bn_cifar10", "mobilenetv1_cifar10"):
        out += [(model, 16, "sgd_momentum", 1, "none"), (model, 64, "sgd_momentum", 1, "none"),
                (model, 64, "adam", 1, "none"), (model, 64, "sgd", 4, "none"),
                (model, 64, "sgd_momentum", 1, "segments"), (model, 128, "sgd_momentum", 2, "all")]
    return out


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


def predicted(model_name, batch, optimizer, micro_batches, recompute):
    import numpy as np

    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel.memory import predict_memory

    shape, classes = models.defaults(model_name)
    model = models.create(model_name, input_shape=shape, num_classes=classes, backend=CPUBackend(np.float32, seed=0))
    return predict_memory(model, batch, OPTIMIZERS[optimizer], micro_batches, recompute)


def plot(rows, path, host):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.2, 5.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    models = sorted({r["model"] for r in rows})
    for i, m in enumerate(models):
        mine = [r for r in rows if r["model"] == m]
        ax.scatter([r["measured_mib"] for r in mine], [r["predicted_mib"] for r in mine], label=m, s=28,
                   color=f"C{i}", edgecolor="black", linewidth=0.4)
    lo = min(min(r["measured_mib"], r["predicted_mib"]) for r in rows) / 1.5
    hi = max(max(r["measured_mib"], r["predicted_mib"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo / 1.1, hi / 1.1], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15, label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured peak of a training step (MiB, traced)")
    ax.set_ylabel("predicted (MiB)")
    ax.set_title(f"Memory model, one process ({host})", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 configurations")
    p.add_argument("--out", help="the markdown table")
    p.add_argument("--json", help="every configuration, as JSON")
    p.add_argument("--plot", help="predicted against measured, a PNG")
    p.add_argument("--measure", nargs=5, metavar=("MODEL", "BATCH", "OPT", "M", "RECOMPUTE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        m, b, o, k, r = args.measure
        print(measure(m, int(b), o, int(k), r))
        return 0
    import perfmodel_validation as validation

    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    for config in configs(args.quick):
        pred = predicted(*config)
        r = subprocess.run([sys.executable, __file__, "--measure", *map(str, config)], capture_output=True, text=True,
                           env=env, timeout=600, check=True)
        meas = int(r.stdout.strip().splitlines()[-1])
        model, batch, opt, k, rc = config
        rows.append({"model": model, "batch": batch, "optimizer": opt, "micro_batches": k, "recompute": rc,
                     "measured_mib": meas / 2**20, "predicted_mib": pred.total / 2**20,
                     "error": pred.total / meas - 1, "parts_mib": {n: v / 2**20 for n, v in pred.parts.items()}})
        print(f"{model} b{batch} {opt} M{k} {rc}: measured {meas / 2**20:.1f} MiB, predicted "
              f"{pred.total / 2**20:.1f} MiB ({100 * rows[-1]['error']:+.1f}%)", flush=True)
    errors = [abs(r["error"]) for r in rows]
    host = validation.host()
    header = ("| model | batch | optimizer | micro-batches | recompute | measured MiB | predicted MiB | error | "
              "activations MiB | workspace MiB |")
    lines = [f"{host}; float32, one thread, {len(rows)} configurations", "", header,
             "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['batch']} | {r['optimizer']} | {r['micro_batches']} | {r['recompute']} | "
              f"{r['measured_mib']:.1f} | {r['predicted_mib']:.1f} | {100 * r['error']:+.1f}% | "
              f"{r['parts_mib']['activations']:.1f} | {r['parts_mib']['workspace']:.1f} |" for r in rows]
    lines += ["", f"median |error| {100 * statistics.median(errors):.1f}%, worst {100 * max(errors):.1f}%"]
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
