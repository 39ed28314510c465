"""Training throughput on one GPU: pydtnn's GPU backend against PyTorch eager, ImageNet shapes, synthetic data.

    python benchmarks/gpu_train.py [--models resnet50,vgg16,resnet20] [--batches 64,128] [--steps 20] [--out t.md]
                                   [--json t.json]

One training step = forward, cross-entropy, backward, SGD with momentum, on a batch already on the
GPU (rotated among three, so caches do not flatter either side). Timing: the GPU is synchronized
before and after each timed step; median over --steps steps after --warmup steps. PyTorch runs
torchvision's architecture of the same name in float32 (TF32 as PyTorch's default for convolutions)
and, for reference, in bf16 autocast; pydtnn computes in float32 (its bf16 mode is not written yet).
resnet20 is the CIFAR-10 network (3x32x32, 10 classes), which torchvision lacks: PyTorch runs the same
network converted from pydtnn's (benchmarks/torch_equivalent.py). The table is written again after
every row, so a run cut short still reports what it measured.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# benchmark name: (pydtnn model, input shape, classes, torchvision architecture or None)
MODELS = {"resnet50": ("resnet50_imagenet", (3, 224, 224), 1000, "resnet50"),
          "vgg16": ("vgg16_imagenet", (3, 224, 224), 1000, "vgg16"),
          "resnet20": ("resnet20_cifar10", (3, 32, 32), 10, None)}


def time_steps(step, sync, warmup, steps):
    for _ in range(warmup):
        step(0)
    sync()
    times = []
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        step(i + 1)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_pydtnn(name, batch, args):
    from pydtnn import losses, models, optim
    from pydtnn.backends import get_backend
    from pydtnn.trainer import Trainer

    model_name, shape, classes, _ = MODELS[name]
    backend = get_backend("gpu", "float32", seed=0)
    model = models.create(model_name, input_shape=shape, num_classes=classes, backend=backend)
    trainer = Trainer(model, losses.create("categorical_cross_entropy"),  # the backend's fused update kernels
                      optim.create("sgd", model.parameters(), backend=backend, lr=0.01, momentum=0.9), progress=False)
    rng = np.random.default_rng(0)
    xs = [backend.asarray(rng.standard_normal((batch,) + shape).astype(np.float32)) for _ in range(3)]
    ys = [backend.asarray(np.eye(classes, dtype=np.float32)[rng.integers(0, classes, batch)]) for _ in range(3)]
    # read=False: the loss stays on the GPU, as PyTorch's loop never calls .item(); no host wait per step
    return time_steps(lambda i: trainer.train_step(xs[i % 3], ys[i % 3], read=False), backend.synchronize,
                      args.warmup, args.steps)


def torch_model(name):
    """(torch.nn.Module on the GPU, input shape, classes): torchvision's architecture, or pydtnn's converted."""
    import torch
    import torchvision

    model_name, shape, classes, architecture = MODELS[name]
    if architecture is not None:
        model = getattr(torchvision.models, architecture)(num_classes=classes)
    else:
        from torch_equivalent import to_torch

        from pydtnn import models
        from pydtnn.backends import get_backend

        model = to_torch(models.create(model_name, input_shape=shape, num_classes=classes,
                                       backend=get_backend("cpu", "float32", seed=0)))
    return model.to(torch.device("cuda")), shape, classes


def bench_torch(name, batch, args, bf16=False):
    import torch

    model, shape, classes = torch_model(name)
    dev = torch.device("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.randn((batch,) + shape, generator=g).to(dev) for _ in range(3)]
    ys = [torch.randint(0, classes, (batch,), generator=g).to(dev) for _ in range(3)]

    def step(i):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(xs[i % 3]), ys[i % 3])
        loss.backward()
        opt.step()

    return time_steps(step, torch.cuda.synchronize, args.warmup, args.steps)


def _free_gpu_memory():
    import cupy
    import torch

    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,vgg16,resnet20", help=f"of {', '.join(MODELS)}")
    p.add_argument("--batches", default="64,128")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args()
    import torch

    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = {"model": name, "batch": batch}
            for key, fn, options in (("pydtnn_fp32", bench_pydtnn, {}), ("torch_fp32", bench_torch, {}),
                                     ("torch_bf16", bench_torch, {"bf16": True})):
                try:
                    row[key] = batch / fn(name, batch, args, **options)
                except Exception as e:  # noqa: BLE001 (one failing configuration must not hide the others)
                    row[key] = None
                    row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{name} batch {batch} {key}: {row[f'{key}_error']}", file=sys.stderr, flush=True)
                gc.collect()  # the previous configuration's arrays go before the next one allocates
                _free_gpu_memory()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            write_outputs(rows, args, torch)  # after every row: a run cut short still leaves what it measured
    print(table(rows, args, torch))


def table(rows, args, torch):
    def cell(v):
        return "failed" if v is None else f"{v:.0f}"

    head = (f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}, median of {args.steps} steps after "
            f"{args.warmup} warm-up, synthetic data (resnet50 and vgg16: 3x224x224, 1000 classes; resnet20: "
            f"3x32x32, 10 classes), SGD momentum 0.9")
    lines = [head, "",
             "| model | batch | pydtnn fp32 img/s | PyTorch fp32 img/s | pydtnn/PyTorch fp32 | PyTorch bf16 img/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = (f"{r['pydtnn_fp32'] / r['torch_fp32']:.2f}" if r.get("pydtnn_fp32") and r.get("torch_fp32")
                 else "")
        lines.append(f"| {r['model']} | {r['batch']} | {cell(r['pydtnn_fp32'])} | {cell(r['torch_fp32'])} | {ratio} | "
                     f"{cell(r['torch_bf16'])} |")
    return "\n".join(lines) + "\n"


def write_outputs(rows, args, torch):
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table(rows, args, torch))


if __name__ == "__main__":
    main()
