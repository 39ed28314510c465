"""Where a GPU training step's time goes: each layer's forward and backward, and the step's phases, timed by
CUDA events, beside the host's time to queue the step.

    python benchmarks/gpu_profile.py [--models resnet50,vgg16] [--batch 64] [--out profile.md]

The events go in through the trainer's tracer hooks (the spans `--tracing` writes), so nothing is timed
that a run does not do. An event pair measures the GPU time between two points of the stream: while the
host queues work faster than the GPU runs it, that is the kernels' time; where the host falls behind,
the GPU's idle wait is counted too, and the host's queueing time per step (no synchronization) says
which of the two it is.
"""

import argparse
import contextlib
import os
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_train import MODELS  # noqa: E402


class EventTracer:
    """The Tracer interface (span, add) with CUDA events beside the host's clock: each span's GPU time and the
    host's time to queue it."""

    def __init__(self, cp):
        self.cp, self.spans, self.on = cp, [], False

    @contextlib.contextmanager
    def span(self, name, cat, tid=0, **args):
        if not self.on:
            yield
            return
        start = self.cp.cuda.Event()
        start.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            host = time.perf_counter() - t0
            end = self.cp.cuda.Event()
            end.record()
            self.spans.append((name, cat, tid, start, end, host))

    def add(self, *args, **kwargs):
        pass


def profile(name, batch, steps):
    from pydtnn import losses, models, optim
    from pydtnn.backends import get_backend
    from pydtnn.trainer import Trainer

    model_name, shape, classes, _ = MODELS[name]
    backend = get_backend("gpu", "float32", seed=0)
    cp = backend.cupy
    model = models.create(model_name, input_shape=shape, num_classes=classes, backend=backend)
    tracer = EventTracer(cp)
    trainer = Trainer(model, losses.create("categorical_cross_entropy"),
                      optim.create("sgd", model.parameters(), backend=backend, lr=0.01, momentum=0.9),
                      progress=False, tracer=tracer)
    model.set_tracer(tracer)
    kinds = {path: type(layer).__name__ for path, layer in model.layers()}
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((batch,) + shape).astype(np.float32))
    y = backend.asarray(np.eye(classes, dtype=np.float32)[rng.integers(0, classes, batch)])
    for _ in range(3):
        trainer.train_step(x, y, read=False)
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(x, y, read=False)
    host = (time.perf_counter() - t0) / steps  # the host's time to queue a step (no wait unless a queue is full)
    backend.synchronize()
    gpu = (time.perf_counter() - t0) / steps
    tracer.on = True
    trainer.train_step(x, y, read=False)
    backend.synchronize()
    by_kind, phases = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0]), defaultdict(lambda: [0.0, 0.0])
    for span_name, cat, tid, start, end, host_s in tracer.spans:
        ms = cp.cuda.get_elapsed_time(start, end)
        if tid == 1:
            phases[cat][0] += ms
            phases[cat][1] += host_s * 1e3
        else:
            row = by_kind[kinds.get(span_name, span_name)]
            at = 0 if cat == "forward" else 1
            row[at] += ms
            row[2 + at] += host_s * 1e3
            row[4] += cat == "forward"
    return host, gpu, dict(phases), dict(by_kind)


def torch_profile(name, batch):
    """PyTorch's own step of the same network, its CUDA time per operator (torch.profiler), top 15."""
    import torch
    from gpu_train import torch_model

    model, shape, classes = torch_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn((batch,) + shape, device="cuda")
    y = torch.randint(0, classes, (batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,vgg16,resnet20")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--torch", action="store_true", help="also PyTorch's CUDA time per operator, same network")
    p.add_argument("--out")
    args = p.parse_args()
    import cupy

    lines = [f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, batch {args.batch}, float32", ""]
    for name in args.models.split(","):
        host, gpu, phases, by_kind = profile(name, args.batch, args.steps)
        lines += [f"## {name}: {gpu * 1e3:.1f} ms a step ({args.batch / gpu:.0f} img/s); the host queues a step in "
                  f"{host * 1e3:.1f} ms", "",
                  "phases, GPU ms / host ms: " + ", ".join(f"{k} {v[0]:.1f} / {v[1]:.1f}" for k, v in phases.items()),
                  "", "| layer | count | forward GPU ms | backward GPU ms | forward host ms | backward host ms |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for kind, (f, b, fh, bh, n) in sorted(by_kind.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
            lines.append(f"| {kind} | {n} | {f:.2f} | {b:.2f} | {fh:.2f} | {bh:.2f} |")
        lines.append("")
        if args.torch:
            try:
                lines += [f"PyTorch, {name}:", "```", torch_profile(name, args.batch), "```", ""]
            except Exception as e:  # noqa: BLE001 (the profile of pydtnn stands without it)
                lines.append(f"PyTorch profile failed: {type(e).__name__}: {e}")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
