"""Transformers, pydtnn against the same models in PyTorch on the same cores: a training step of vit-tiny and
gpt-nano (time and peak memory at 1 and 2 threads), and loss curves of both libraries from the same initial
weights, data order and optimizer.

    python benchmarks/transformers.py [--steps 500] [--threads 1,2] [--rounds 2] [--skip_timing] [--skip_curves]
                                      [--out FILE.md] [--plot FILE.png] [--json FILE]

Step time and memory: benchmarks/train_step.py's workers (a fresh process per library, model and thread count,
AdamW, random inputs; PyTorch's twin built by torch_equivalent.to_torch, whose attention is
F.scaled_dot_product_attention as nanoGPT writes it), vit_tiny_cifar10 (3x32x32, batch 64) and gpt_nano
(context 128, 256 byte tokens, batch 32).

Loss curves, in this process at one thread: vit_tiny for the embedded digits (1x28x28: 49 patches, batch 64)
and gpt_nano on the fortunes text (characters, context 128, batch 32), each library from the pydtnn model's
initial weights (copied into the twin), the same batches in the same order (pydtnn's epoch order, windows
without random shifts), AdamW (lr 0.001, weight decay 0.01), float32, no dropout. The table compares the mean
training loss of the last 100 steps, and the loss of the trained models on the held-out set (the digits' 1,000
test images; the text's 2,000 test windows).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TAIL = 100  # steps whose mean training loss is compared
LR, DECAY = 0.001, 0.01


def curve_data(name):
    """(pydtnn model, its data: a function step -> (x, y), the held-out set) of one loss curve."""
    from pydtnn import data, models
    from pydtnn.backends import CPUBackend
    from pydtnn.data.dataset import batch_slices, epoch_order

    if name == "vit_tiny":
        train, test = data.load("mnist5k")
        model = models.create("vit_tiny_cifar10", input_shape=train.input_shape, num_classes=10,
                              backend=CPUBackend(seed=0))
        batch = 64
    else:
        train, test = data.load("text", context_length=128)
        model = models.create("gpt_nano", input_shape=train.input_shape, num_classes=train.num_classes,
                              backend=CPUBackend(seed=0))
        batch = 32
    slices = batch_slices(len(train), batch, drop_last=True)

    def get(step):
        epoch, i = divmod(step, len(slices))
        a, b = slices[i]
        return train.get_batch(epoch_order(len(train), 0, epoch)[a:b], np.float32)

    return model, get, test


def held_out_loss(forward, test, batch=250):
    """Mean cross-entropy (nats) of forward(x) -> logits over every sample of `test` (NumPy arrays in and out):
    pydtnn.metrics' bits per token, weighted by the batches' sizes."""
    from pydtnn import metrics

    total = 0.0
    for a in range(0, len(test), batch):
        x, y = test.get_batch(np.arange(a, min(a + batch, len(test))), np.float32)
        total += metrics.bits_per_token(forward(x).astype(np.float64), y) * len(x)
    return total / len(test) * math.log(2)


def curves(steps, say):
    """{model: {"pydtnn": [loss per step], "torch": [...], "seconds": {lib: s}}} at one thread."""
    import torch
    from torch_equivalent import to_torch

    from pydtnn import losses, optim, runtime
    from pydtnn.trainer import Trainer

    runtime.configure(threads=1)
    torch.set_num_threads(1)
    out = {}
    for name in ("vit_tiny", "gpt_nano"):
        model, get, test = curve_data(name)
        twin = to_torch(model).train()
        trainer = Trainer(model, losses.SoftmaxCrossEntropy(),
                          optim.create("adamw", model.parameters(), lr=LR, weight_decay=DECAY), progress=False)
        opt = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=DECAY)
        loss_fn = torch.nn.CrossEntropyLoss()
        ours, theirs, seconds = [], [], {}
        t0 = time.perf_counter()
        for step in range(steps):
            x, y = get(step)
            ours.append(float(trainer.train_step(x, y)[0]))
        seconds["pydtnn"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for step in range(steps):
            x, y = (torch.from_numpy(a) for a in get(step))
            opt.zero_grad()
            logits = twin(x)
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            theirs.append(loss.item())
        seconds["torch"] = time.perf_counter() - t0
        twin.eval()
        with torch.no_grad():
            held = {"pydtnn": held_out_loss(lambda x, m=model: m.forward(x, training=False), test),
                    "torch": held_out_loss(lambda x, t=twin: t(torch.from_numpy(x)).numpy(), test)}
        out[name] = {"pydtnn": ours, "torch": theirs, "seconds": seconds, "held_out": held}
        say(f"{name}: last {TAIL} steps' mean loss {np.mean(ours[-TAIL:]):.4f} (pydtnn), "
            f"{np.mean(theirs[-TAIL:]):.4f} (PyTorch); held-out loss {held['pydtnn']:.4f} and {held['torch']:.4f}; "
            f"{seconds['pydtnn']:.0f} s and {seconds['torch']:.0f} s")
    return out


def timing(args, tmp):
    """train_step.py's report (markdown) and records for both models."""
    script, paths = os.path.join(HERE, "train_step.py"), []
    for model, batch in (("vit_tiny_cifar10", 64), ("gpt_nano", 32)):
        paths.append(os.path.join(tmp, f"{model}.json"))
        subprocess.run([sys.executable, script, "--models", model, "--batches", str(batch), "--threads", args.threads,
                        "--optimizer", "adamw", "--rounds", str(args.rounds), "--json", paths[-1]],
                       check=True, stdout=subprocess.DEVNULL)
    return subprocess.run([sys.executable, script, "--from_json", *paths], check=True, capture_output=True,
                          text=True).stdout


def curve_table(result, steps):
    lines = [(f"| model | steps | training loss, mean of the last {TAIL} steps: pydtnn / PyTorch | difference | "
              "held-out loss after the last step: pydtnn / PyTorch | difference | seconds: pydtnn / PyTorch |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result.items():
        a, b = np.mean(r["pydtnn"][-TAIL:]), np.mean(r["torch"][-TAIL:])
        ha, hb = r["held_out"]["pydtnn"], r["held_out"]["torch"]
        lines.append(f"| {name} | {steps} | {a:.4f} / {b:.4f} | {100 * (a - b) / b:+.2f}% | {ha:.4f} / {hb:.4f} | "
                     f"{100 * (ha - hb) / hb:+.2f}% | {r['seconds']['pydtnn']:.0f} / {r['seconds']['torch']:.0f} |")
    return "\n".join(lines)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(5 * len(result), 3.6))
    for ax, (name, r) in zip(np.atleast_1d(axes), result.items()):
        for lib, style in (("pydtnn", "-"), ("torch", "--")):
            ax.plot(np.arange(1, len(r[lib]) + 1), r[lib], style, lw=1, label="PyTorch" if lib == "torch" else lib)
        ax.set_title(f"{name}: training loss, same weights, data and AdamW")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500, help="steps of each loss curve (default 500)")
    p.add_argument("--threads", default="1,2", help="thread counts of the step timing")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the step timing, the libraries alternating")
    p.add_argument("--skip_timing", action="store_true")
    p.add_argument("--skip_curves", action="store_true")
    p.add_argument("--out", help="write the report (markdown) here")
    p.add_argument("--plot", metavar="FILE.png", help="the loss curves")
    p.add_argument("--json", help="the curves, as numbers")
    args = p.parse_args()
    sys.path.insert(0, HERE)

    def say(line):
        print(line, file=sys.stderr, flush=True)

    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_timing:
            parts.append(timing(args, tmp))
    if not args.skip_curves:
        result = curves(args.steps, say)
        parts.append(curve_table(result, args.steps))
        if args.plot:
            plot(result, args.plot)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f)
    text = "\n\n".join(parts) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
