"""Images per second of the ImageNet folder loader (JPEG decode, random-resized crop, flip, normalize) against
the number of --data_workers threads, each batch checked equal to the one-worker batch; and, with --train,
a model trained from the folder against the same model fed from memory.

    python benchmarks/loader.py [--images 512] [--batch 64] [--workers 1,2] [--folder DIR] [--out t.md] [--json f]
                                [--train resnet50_imagenet --gpu --train_workers 1,8 --train_steps 24]

The folder (written once, then reused): --images JPEGs in 8 class folders, 500x375 pixels (about the mean
ImageNet training image), quality 90, smooth colour fields with noise so they compress as photographs do.
The training view as pydtnn-train reads it (ImageFolder with per-sample streams, 224x224 float32) over
every image once per worker count, after one warm-up batch; the best of --repeats passes.

--train: pydtnn's Trainer (SGD with momentum, 1000 classes) over the folder with each of --train_workers,
then over the same number of images already decoded in memory (uint8, normalized per batch: what a step
costs when the loader costs almost nothing). images/s: batch x the steps after the first --train_warmup,
over the time between their ends, the device synchronized at both ends.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_folder(root, images, side=(500, 375), classes=8, seed=0):
    """`images` JPEGs under root/train/<class>/ (skipped where the folder already holds as many)."""
    from PIL import Image

    train = os.path.join(root, "train")
    have = sum(len(files) for _, _, files in os.walk(train)) if os.path.isdir(train) else 0
    if have == images:
        return train
    w, h = side
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)

    def one(i):
        rng = np.random.default_rng([seed, i])
        folder = os.path.join(train, f"n{i % classes:08d}")
        os.makedirs(folder, exist_ok=True)
        a, b = rng.uniform(0.005, 0.03, 2)
        phase = rng.uniform(0, 6.3, 3)
        img = np.stack([np.sin(a * xx + b * yy + p) * 90 + 128 for p in phase], axis=-1)
        img += rng.normal(0, 12, img.shape)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:06d}.JPEG"),
                                                                   quality=90)

    with ThreadPoolExecutor(os.cpu_count()) as pool:  # Pillow encodes without the GIL
        list(pool.map(one, range(images)))
    return train


def measure(dataset, batch, workers, repeats):
    """(images/s over the whole folder, the batches) with `workers` threads."""
    from pydtnn.data.workers import BatchWorkers
    from pydtnn.randomness import SampleStreams

    order = np.arange(len(dataset))
    slices = [order[a:a + batch] for a in range(0, len(order) - batch + 1, batch)]
    best, batches = None, []
    with BatchWorkers(workers) as pool:
        pool.get_batch(dataset, slices[0], np.float32, SampleStreams(0, 0, slices[0]))  # warm-up
        for _ in range(repeats):
            out = []
            t0 = time.perf_counter()
            for idx in slices:
                out.append(pool.get_batch(dataset, idx, np.float32, SampleStreams(0, 0, idx))[0])
            took = time.perf_counter() - t0
            best = took if best is None else min(best, took)
            batches = out
    return len(slices) * batch / best, batches


class Clock:
    """Trainer callback: the time each step ended, the device synchronized first."""

    def __init__(self):
        self.ends = []

    def on_batch_end(self, trainer, step, logs):
        trainer.model.backend.synchronize()
        self.ends.append(time.perf_counter())


def train_rate(model_name, dataset, batch, steps, warmup, workers, gpu):
    """Training images/s of `model_name` over `dataset` with `workers` data workers (see the module doc)."""
    from pydtnn import losses, models, optim
    from pydtnn.backends import get_backend
    from pydtnn.trainer import Trainer

    backend = get_backend("gpu" if gpu else "cpu", "float32", seed=0)
    model = models.create(model_name, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                          backend=backend)
    clock = Clock()
    trainer = Trainer(model, losses.create("categorical_cross_entropy"),
                      optim.create("sgd", model.parameters(), backend=backend, lr=0.01, momentum=0.9),
                      progress=False, callbacks=[clock], data_workers=workers)
    trainer.fit(dataset, epochs=1, batch_size=batch, steps_per_epoch=steps)
    ends = clock.ends[warmup - 1:]
    return (len(ends) - 1) * batch / (ends[-1] - ends[0])


def in_memory(folder_dataset, n):
    """The first n images of the folder's evaluation view, decoded once, as uint8 in memory."""
    from pydtnn.data.dataset import ArrayDataset
    from pydtnn.data.imagenet import IMAGENET_MEAN, IMAGENET_STD

    raw = folder_dataset._read(folder_dataset.rows[:n], None)
    return ArrayDataset(raw, folder_dataset.y[:n], 1000, scale=1 / 255, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                        name="in memory")


def main():
    from pydtnn.data.imagenet import ImageFolder

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", default="1,2", help="comma-separated thread counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "pydtnn-loader-bench"))
    p.add_argument("--out", default=None, help="Markdown table")
    p.add_argument("--json", default=None)
    p.add_argument("--train", default=None, help="also train this model from the folder (e.g. resnet50_imagenet)")
    p.add_argument("--gpu", action="store_true", help="--train on the GPU")
    p.add_argument("--train_workers", default="1,2")
    p.add_argument("--train_steps", type=int, default=24)
    p.add_argument("--train_warmup", type=int, default=6)
    args = p.parse_args()
    t0 = time.perf_counter()
    train = write_folder(args.folder, args.images)
    print(f"{args.images} JPEGs in {train} ({time.perf_counter() - t0:.1f} s to make or find)", flush=True)
    dataset = ImageFolder(train, classes=[f"n{c:08d}" for c in range(1000)])  # 1000 classes, 8 of them used
    rows, first = [], None
    for n in (int(w) for w in args.workers.split(",")):
        rate, batches = measure(dataset, args.batch, n, args.repeats)
        if first is None:
            first = batches
        same = all(np.array_equal(a, b) for a, b in zip(first, batches))
        rows.append({"workers": n, "images_per_s": round(rate, 1), "speedup": round(rate / rows[0]["images_per_s"], 2)
                     if rows else 1.0, "batches_equal_to_1_worker": same})
        print(f"workers {n:3d}: {rate:8.1f} images/s  x{rows[-1]['speedup']:.2f}  batches equal: {same}", flush=True)
        if not same:
            sys.exit(f"the batches with {n} workers differ from those with {rows[0]['workers']}")
    table = ["| data_workers | images/s | speed-up | batches equal |", "| ---: | ---: | ---: | :---: |"]
    table += [f"| {r['workers']} | {r['images_per_s']:.0f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['batches_equal_to_1_worker'] else 'NO'} |" for r in rows]
    print("\n".join(table))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(table) + "\n")
    trained = []
    if args.train:
        images = args.train_steps * args.batch
        if images > len(dataset):
            sys.exit(f"--train_steps {args.train_steps} x --batch {args.batch} needs {images} images; "
                     f"the folder has {len(dataset)} (--images)")
        sources = [("JPEG folder", int(n), dataset) for n in args.train_workers.split(",")]
        sources.append(("in memory (uint8)", 1, in_memory(dataset, images)))
        for source, n, data in sources:
            rate = train_rate(args.train, data, args.batch, args.train_steps, args.train_warmup, n, args.gpu)
            trained.append({"source": source, "workers": n, "images_per_s": round(rate, 1)})
            print(f"{args.train} from {source}, data_workers {n}: {rate:.1f} images/s", flush=True)
        where = f"{args.train} ({'GPU' if args.gpu else 'CPU'}, batch {args.batch})"
        table += ["", f"| {where} fed from | data_workers | images/s |", "| --- | ---: | ---: |"]
        table += [f"| {r['source']} | {r['workers']} | {r['images_per_s']:.0f} |" for r in trained]
        print("\n".join(table[-len(trained) - 3:]))
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(table) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "batch": args.batch, "images": args.images, "rows": rows,
                       "train": trained}, f, indent=1)


if __name__ == "__main__":
    main()
