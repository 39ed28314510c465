"""Forward and backward time of each layer type, pydtnn against PyTorch CPU, side by side.

    python benchmarks/layers.py [--threads 1] [--repeats 20] [--cases pool,depthwise] [--out FILE]
    python benchmarks/layers.py --threads 1,2      # a table per count, then each library's speed-up

Several thread counts run one fresh process each (the thread split is set once per process); a last
table gives each library's speed-up from the first count to each other one per layer, beside the
ratios ours / PyTorch, so that a layer that does not scale shows at a glance.

Same dtype (float32), same thread count (pydtnn's set_threads, which splits every kernel over its own
pool with one BLAS thread inside each chunk; torch.set_num_threads for PyTorch), inputs rotated among
three sets so caches flatter neither side. Forward and backward are timed separately (each backward
after an untimed forward). Reports the median times, the ratio ours / PyTorch, and our achieved
GFLOP/s as a fraction of this machine's sgemm peak, measured by the script itself before the first
layer and after each (each layer against the mean of the two around it). For convolution
(one group) and Dense layers it also times the three GEMMs of their GEMM formulation alone (forward,
weight gradient, input gradient, on ready contiguous operands): BLAS's own speed at those shapes,
and ours as a fraction of it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from threadpoolctl import threadpool_limits

from pydtnn.backends.cpu.autotune import describe_cpu
from pydtnn.layers import AvgPool2D, BatchNorm, Conv2D, Dense, MaxPool2D, ReLU
from pydtnn.runtime import GOMP_SPINCOUNT, configure

# torch loads its libgomp, which Numba's threads then use: the spin count pydtnn sets must be in the
# environment before (pydtnn.runtime.configure; set later, two threads ran no faster than one)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# name, layer factory, input shape (N, C, H, W) or (N, F), torch function(x, params)
CASES = [
    ("conv 3x3 64->64 32x32", lambda: Conv2D(64, 3, padding=1), (32, 64, 32, 32),
     lambda x, p: F.conv2d(x, p["weight"], p["bias"], padding=1)),
    ("conv 3x3 s2 64->128 32x32", lambda: Conv2D(128, 3, stride=2, padding=1), (32, 64, 32, 32),
     lambda x, p: F.conv2d(x, p["weight"], p["bias"], stride=2, padding=1)),
    ("conv 1x1 256->64 16x16", lambda: Conv2D(64, 1), (32, 256, 16, 16),
     lambda x, p: F.conv2d(x, p["weight"], p["bias"])),
    ("conv 3x3 16->16 32x32 (ResNet-20)", lambda: Conv2D(16, 3, padding=1), (64, 16, 32, 32),
     lambda x, p: F.conv2d(x, p["weight"], p["bias"], padding=1)),
    ("depthwise 3x3 128 16x16", lambda: Conv2D(128, 3, padding=1, groups=128), (32, 128, 16, 16),
     lambda x, p: F.conv2d(x, p["weight"], p["bias"], padding=1, groups=128)),
    ("dense 4096->1024", lambda: Dense(1024), (64, 4096), lambda x, p: F.linear(x, p["weight"], p["bias"])),
    ("maxpool 2x2 64 32x32", lambda: MaxPool2D(2), (32, 64, 32, 32), lambda x, p: F.max_pool2d(x, 2)),
    ("maxpool 3x3 s1 192 28x28 (Inception)", lambda: MaxPool2D(3, stride=1, padding=1), (32, 192, 28, 28),
     lambda x, p: F.max_pool2d(x, 3, 1, 1)),
    ("maxpool 3x3 s2 64 56x56 (ResNet stem)", lambda: MaxPool2D(3, stride=2, padding=1), (32, 64, 56, 56),
     lambda x, p: F.max_pool2d(x, 3, 2, 1)),
    ("avgpool 2x2 64 32x32", lambda: AvgPool2D(2), (32, 64, 32, 32), lambda x, p: F.avg_pool2d(x, 2)),
    ("batchnorm 64 32x32", lambda: BatchNorm(), (32, 64, 32, 32),
     lambda x, p: F.batch_norm(x, None, None, p["weight"], p["bias"], True)),
    ("relu 64 32x32", lambda: ReLU(), (32, 64, 32, 32), lambda x, p: F.relu(x)),
]


def median_time(fn, repeats, before=None):
    """Median seconds of fn(i) over i = 0..repeats-1; before(i), if given, runs first, untimed, and its
    result is passed to fn."""
    times = []
    for i in range(repeats):
        arg = before(i) if before is not None else i
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sgemm_peak(threads, n=2048, repeats=5):
    """GFLOP/s of a large float32 matrix product through NumPy's BLAS (the ceiling for conv/dense)."""
    a, b = (np.random.default_rng(i).standard_normal((n, n), np.float32) for i in (0, 1))
    with threadpool_limits(threads):
        a @ b
        t = median_time(lambda i: a @ b, repeats)
    # OpenBLAS's own threads keep spinning after a threaded call (about 0.1 s), on the cores the next
    # measurement needs: a Dense forward right after this ran no faster on two threads than on one
    time.sleep(0.5)
    return 2 * n**3 / t / 1e9


def peaks_around(peaks):
    """Each case's sgemm peak from the peaks measured before the first case and after each one: the
    mean of the two around it. On a shared machine the peak moves by 10-20% within minutes, so one
    measurement at the start would misstate the later cases."""
    return [(a + b) / 2 for a, b in zip(peaks, peaks[1:])]


def gemms_alone(layer, shape, threads, repeats):
    """Seconds of the three GEMMs a GEMM formulation of this layer takes (forward, weight gradient,
    input gradient), through NumPy's BLAS on ready-made contiguous operands: the ceiling BLAS sets
    for its shapes, with no im2col, layout or bias work. None for layers that are not one GEMM."""
    rng = np.random.default_rng(1)
    if isinstance(layer, Dense):
        m, k, n = shape[0], shape[1], layer.units  # y (m, n) = x (m, k) @ W.T
    elif isinstance(layer, Conv2D) and layer.groups == 1:
        kh, kw = layer.kernel_size
        m, k, n = layer.filters, shape[1] * kh * kw, shape[0] * layer.output_shape[1] * layer.output_shape[2]
    else:
        return None
    a, b, d = (rng.standard_normal(s, np.float32) for s in ((m, k), (k, n), (m, n)))
    outs = [np.empty(s, np.float32) for s in ((m, n), (m, k), (k, n))]
    calls = [lambda: np.matmul(a, b, out=outs[0]), lambda: np.matmul(d, b.T, out=outs[1]),
             lambda: np.matmul(a.T, d, out=outs[2])]
    with threadpool_limits(threads):
        for c in calls:
            c()
        return sum(median_time(lambda i, c=c: c(), repeats) for c in calls)


def bench(name, make, shape, torch_fn, threads, repeats):
    layer = make()
    layer.build(shape[1:], np.float32)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(shape, np.float32) for _ in range(3)]
    dys = [rng.standard_normal((shape[0],) + layer.output_shape, np.float32) for _ in range(3)]
    # BLAS at one thread inside each of pydtnn's chunks; OpenMP left alone: Numba's threads share torch's
    # libgomp here, and limiting it to one thread would run every compiled kernel on one core
    with threadpool_limits(1, user_api="blas"):
        layer.forward(xs[0]), layer.backward(dys[0])  # warm-up
        fwd = median_time(lambda i: layer.forward(xs[i % 3]), repeats)

        def forward(i):  # untimed, before each timed backward
            layer.forward(xs[i % 3])
            return dys[i % 3]

        bwd = median_time(layer.backward, repeats, before=forward)
    torch.set_num_threads(threads)
    txs = [torch.tensor(x, requires_grad=True) for x in xs]
    tdys = [torch.tensor(d) for d in dys]
    params = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in layer.params.items()}
    with torch.no_grad():
        torch_fn(txs[0], params)
    t_fwd = median_time(lambda i: torch_fn(txs[i % 3], params), repeats)

    def t_forward(i):
        return torch_fn(txs[i % 3], params), tdys[i % 3]

    def t_backward(out_dy):
        out_dy[0].backward(out_dy[1])

    t_backward(t_forward(0))
    t_bwd = median_time(t_backward, repeats, before=t_forward)
    flops = layer.flops() * shape[0]
    both = fwd + bwd
    gemms = gemms_alone(layer, shape, threads, repeats)
    return {"name": name, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "torch_fwd_ms": t_fwd * 1e3,
            "torch_bwd_ms": t_bwd * 1e3, "ratio": both / (t_fwd + t_bwd),
            # backward of conv/dense costs about twice the forward
            "gflops": 3 * flops / both / 1e9 if isinstance(layer, (Conv2D, Dense)) else None,
            "gemm_gflops": 3 * flops / gemms / 1e9 if gemms else None}


def measure(threads, cases, repeats):
    """{"threads", "peaks", "rows"}: every case at one thread count, in this process."""
    configure(threads=threads)  # pydtnn's pool; BLAS runs one thread inside each of its chunks
    peaks, rows = [sgemm_peak(threads)], []
    for case in cases:
        rows.append(bench(*case, threads, repeats))
        peaks.append(sgemm_peak(threads))
    return {"threads": threads, "peaks": peaks, "rows": rows}


def table(run):
    """The markdown table and machine line of one thread count's run."""
    n, peaks = run["threads"], run["peaks"]
    head = (f"| layer (batch, float32, {n} thread{'s' * (n > 1)}) | ours fwd ms | ours bwd ms "
            f"| torch fwd ms | torch bwd ms | ours/torch (fwd+bwd) | ours GFLOP/s (% of sgemm peak) "
            f"| its GEMMs alone GFLOP/s (ours as %) |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, peak in zip(run["rows"], peaks_around(peaks)):
        g = f"{r['gflops']:.1f} ({100 * r['gflops'] / peak:.0f}%)" if r["gflops"] else ""
        ga = f"{r['gemm_gflops']:.1f} ({100 * r['gflops'] / r['gemm_gflops']:.0f}%)" if r["gemm_gflops"] else ""
        lines.append(f"| {r['name']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['torch_fwd_ms']:.2f} | "
                     f"{r['torch_bwd_ms']:.2f} | {r['ratio']:.2f} | {g} | {ga} |")
    machine = (f"{describe_cpu()}, NumPy {np.__version__}, PyTorch {torch.__version__}, "
               f"sgemm peak measured {min(peaks):.0f}-{max(peaks):.0f} GFLOP/s on {n} thread(s), before "
               f"the first layer and after each; a row's % is against the mean of the two around it")
    return f"{machine}\n\n" + "\n".join(lines) + "\n"


def speedups(runs):
    """Markdown: per layer, each library's speed-up (fwd+bwd) from the first thread count to each other one,
    beside the ratio ours / torch at both counts."""
    base, out = runs[0], []
    for run in runs[1:]:
        a, b = base["threads"], run["threads"]
        out += [f"| layer | ours {a} -> {b} threads | torch {a} -> {b} threads | ours/torch at {a} | "
                f"ours/torch at {b} |", "| --- | ---: | ---: | ---: | ---: |"]
        for r1, rn in zip(base["rows"], run["rows"]):
            ours = (r1["fwd_ms"] + r1["bwd_ms"]) / (rn["fwd_ms"] + rn["bwd_ms"])
            theirs = (r1["torch_fwd_ms"] + r1["torch_bwd_ms"]) / (rn["torch_fwd_ms"] + rn["torch_bwd_ms"])
            out.append(f"| {r1['name']} | {ours:.2f}x | {theirs:.2f}x | {r1['ratio']:.2f} | {rn['ratio']:.2f} |")
        out.append("")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1", help="thread count, or a comma list (1,2): one process each")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--cases", help="comma-separated substrings: run only the cases whose name contains one")
    p.add_argument("--out", help="write the tables as markdown to this file")
    p.add_argument("--json", help=argparse.SUPPRESS)  # one count's measurements, for the parent process
    args = p.parse_args()
    try:
        counts = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        p.error(f"--threads {args.threads!r}: expected a thread count or a comma list of them (1,2)")
    cases = CASES
    if args.cases:
        wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
        cases = [c for c in CASES if any(w in c[0] for w in wanted)]
        if not cases:
            p.error(f"--cases {args.cases!r} matches none of: {', '.join(c[0] for c in CASES)}")
    if len(counts) == 1:
        runs = [measure(counts[0], cases, args.repeats)]
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(runs[0], f)
            return
    else:
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for n in counts:  # a fresh process per count: the thread split is process-wide
                path = os.path.join(tmp, f"{n}.json")
                cmd = [sys.executable, __file__, "--threads", str(n), "--repeats", str(args.repeats), "--json", path]
                subprocess.run(cmd + (["--cases", args.cases] if args.cases else []), check=True)
                with open(path, encoding="utf-8") as f:
                    runs.append(json.load(f))
    text = "\n".join(table(r) for r in runs)
    if len(runs) > 1:
        text += "\nSpeed-up with more threads, forward + backward (each library against itself):\n\n" + speedups(runs)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
