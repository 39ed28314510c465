"""Peak memory and time of a training step with and without activation recomputation (--recompute).

    python benchmarks/recompute_memory.py [--models resnet20_cifar10,vgg11bn_cifar10] [--batch 64] [--out t.md]

Peak: the most memory NumPy and Python held at once during one step (tracemalloc, which NumPy reports its
arrays to), above what was held before the step (the model, its gradients, the optimizer's state, the
batch). Time: median of --steps steps without tracing. One process, float32, one thread.
"""

import argparse
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(name, batch, mode, steps):
    from pydtnn import losses, models, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.randomness import SampleStreams
    from pydtnn.step import Step

    backend = CPUBackend(np.float32, seed=0)
    model = models.create(name, input_shape=(3, 32, 32), num_classes=10, backend=backend)
    step = Step(model, losses.create("categorical_cross_entropy"),
                optim.create("sgd", model.parameters(), backend=backend, lr=0.01, momentum=0.9), recompute=mode)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, batch)]
    streams = SampleStreams(0, 0, np.arange(batch))
    step.run(x, y, streams=streams)  # warm-up: buffers that live across steps are made here
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step.run(x, y, streams=streams)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    step.run(x, y, streams=streams)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak, statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet20_cifar10,vgg11bn_cifar10")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    from threadpoolctl import threadpool_limits

    from pydtnn.backends.cpu.isa import cpu_features

    cpu, flags = cpu_features()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    lines = [f"{cpu} ({isa}), batch {args.batch}, float32, one thread", "",
             "| model | --recompute | peak above the step's start (MiB) | vs none | step (ms) | vs none |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    with threadpool_limits(1):
        for name in args.models.split(","):
            base = None
            for mode in ("none", "segments", "all"):
                peak, t = measure(name, args.batch, mode, args.steps)
                base = base or (peak, t)
                lines.append(f"| {name} | {mode} | {peak / 2**20:.1f} | {peak / base[0]:.2f} | {t * 1e3:.0f} | "
                             f"{t / base[1]:.2f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
