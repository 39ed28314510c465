"""Every convolution algorithm the CPU backend could run on a layer shape, timed side by side.

    python benchmarks/conv_algorithms.py [--threads 1] [--batch 32] [--rounds 5] [--out FILE]
                                         [--shapes 64x32,128x16]    # C x H: C -> C, 3x3 same padding

Each shape is a one-group 3x3 stride-1 same-padded convolution C -> C on H x H images. For each, the
candidates the measured choice considers (`autotune.candidates`: the compiled direct kernels, Winograd
F(2x2, 3x3), im2col + GEMM) are timed by `autotune.measure` itself, forward plus backward (dx and dw),
float32, on a backend of its own: one untimed call each, then interleaved rounds (the median is kept),
as the autotuner times them before it picks. Prints which one the autotuner would pick (the threshold
choice unless another is at least 5% faster) and writes the table as markdown with --out.
"""

import argparse

import numpy as np

from pydtnn.backends.cpu import Tuning, autotune, conv_plan
from pydtnn.backends.cpu.autotune import describe_cpu
from pydtnn.backends.geometry import ConvGeometry
from pydtnn.runtime import configure

SHAPES = "16x32,64x32,128x16,256x8,512x4"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", default=SHAPES, help=f"C x H pairs (default {SHAPES})")
    p.add_argument("--out", help="write the table as markdown to this file")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        p.error(f"--shapes {args.shapes!r}: expected C x H pairs such as 64x32,128x16")
    configure(threads=args.threads)
    tuning = Tuning()
    lines = [f"CPU: {describe_cpu()}; {args.threads} thread(s), batch {args.batch}, float32, forward + backward "
             f"(median of {args.rounds} interleaved rounds)", "",
             "| layer | direct | winograd | gemm | autotune picks |", "|---|---:|---:|---:|---|"]
    print(lines[0], flush=True)
    for c, h in shapes:
        g = ConvGeometry(c, h, h, 3, 3, pt=1, pb=1, pl=1, pr=1)
        found = autotune.candidates(g, c, "numba", tuning)
        times = autotune.measure(g, c, found, np.float32, "numba", tuning, args.batch, args.rounds, slow=1e9)
        pick = autotune.pick(times, conv_plan.choose(g, c, "numba", tuning).algorithm, 0.05)
        cells = [f"{1e3 * times[a]:.1f} ms" if a in times else "-" for a in ("direct", "winograd", "gemm")]
        row = f"| {c} -> {c}, {h}x{h} | " + " | ".join(cells) + f" | {pick} |"
        lines.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
