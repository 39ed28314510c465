"""Images per second of the ImageNet folder loader (JPEG decode, random-resized crop, flip, normalize) against
the number of --data_workers threads, each batch checked equal to the one-worker batch.

    python benchmarks/loader.py [--images 512] [--batch 64] [--workers 1,2] [--folder DIR] [--out t.md] [--json f]

The folder (written once, then reused): --images JPEGs in 8 class folders, 500x375 pixels (about the mean
ImageNet training image), quality 90, smooth colour fields with noise so they compress as photographs do.
The training view as pydtnn-train reads it (ImageFolder with per-sample streams, 224x224 float32) over
every image once per worker count, after one warm-up batch; the best of --repeats passes.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_folder(root, images, side=(500, 375), classes=8, seed=0):
    """`images` JPEGs under root/train/<class>/ (skipped where the folder already holds as many)."""
    from PIL import Image

    train = os.path.join(root, "train")
    have = sum(len(files) for _, _, files in os.walk(train)) if os.path.isdir(train) else 0
    if have == images:
        return train
    rng = np.random.default_rng(seed)
    w, h = side
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(images):
        folder = os.path.join(train, f"n{i % classes:08d}")
        os.makedirs(folder, exist_ok=True)
        a, b = rng.uniform(0.005, 0.03, 2)
        phase = rng.uniform(0, 6.3, 3)
        img = np.stack([np.sin(a * xx + b * yy + p) * 90 + 128 for p in phase], axis=-1)
        img += rng.normal(0, 12, img.shape)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:06d}.JPEG"),
                                                                   quality=90)
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


def main():
    from pydtnn.data.imagenet import ImageFolder

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", default="1,2", help="comma-separated thread counts")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "pydtnn-loader-bench"))
    p.add_argument("--out", default=None, help="Markdown table")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    train = write_folder(args.folder, args.images)
    print(f"{args.images} JPEGs in {train} ({time.perf_counter() - t0:.1f} s to make or find)", flush=True)
    dataset = ImageFolder(train)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "batch": args.batch, "images": args.images, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
