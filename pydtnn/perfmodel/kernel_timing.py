"""The arithmetic side of calibrate.py: real layers timed forward plus backward, the kernel classes' rates,
their speed-up at more threads, and the memory and reduction bandwidths of one thread.

    probes = [Probe(s) for s in shapes(quick=True)]
    timings = kernel_timings(probes, threads=[1, 2])   # {threads: [Timing]}, one per probe
    rates = class_rates(timings[1])                    # {kernel class: FLOP/s}

calibrate.py's docstring says how each figure is measured and why it agrees with costs.py.
"""

import dataclasses
import statistics
import time

import numpy as np

from pydtnn.perfmodel.machine import KERNEL_CLASSES

STREAM_BYTES = 64 << 20  # each of the two arrays of the copy and of the reduction
WARM_UP = 2  # untimed runs of a shape each time it is visited (the first visit loads the compiled kernels)
ROUNDS = 3  # visits of every (shape, thread count), interleaved, so that a load that comes and goes on a
            # shared machine falls on every thread count alike (2 with quick)
REPEATS = 3  # timed runs per visit at least, more for shapes under MIN_VISIT_S
MIN_VISIT_S = 0.25  # a visit times a shape for about this long at least (0.05 s with quick)
STREAM_REPEATS = 10  # timed copies and additions (5 with quick)
SMALL_DIVISOR = 16  # small_shapes(): the large shapes' batch over this


@dataclasses.dataclass(frozen=True)
class Shape:
    """One layer to time: label, a factory for the (unbuilt) layer, input shape (C, H, W), batch size."""

    label: str
    make: object
    input_shape: tuple
    batch: int


def shapes(quick=False):
    """The layers timed, each expected to fall in a kernel class (the comment): one per class with quick."""
    from pydtnn.layers import BatchNorm, Conv2D, Dense, ReLU

    every = [
        Shape("conv 3x3 s2 32->64 32x32", lambda: Conv2D(64, 3, stride=2, padding=1), (32, 32, 32), 32),  # gemm
        Shape("conv 1x1 64->128 16x16", lambda: Conv2D(128, 1), (64, 16, 16), 32),  # gemm (pointwise)
        Shape("conv 3x3 128->128 4x4", lambda: Conv2D(128, 3, padding=1), (128, 4, 4), 64),  # gemm
        Shape("dense 1024->512", lambda: Dense(512), (1024,), 64),  # gemm
        Shape("conv 3x3 16->16 32x32", lambda: Conv2D(16, 3, padding=1), (16, 32, 32), 32),  # direct3x3
        Shape("conv 3x3 32->32 16x16", lambda: Conv2D(32, 3, padding=1), (32, 16, 16), 32),  # direct3x3
        Shape("conv 3x3 64->64 16x16", lambda: Conv2D(64, 3, padding=1), (64, 16, 16), 16),  # direct3x3
        Shape("depthwise 3x3 64 32x32", lambda: Conv2D(64, 3, padding=1, groups=64), (64, 32, 32), 32),  # depthwise
        Shape("depthwise 3x3 s2 128 16x16", lambda: Conv2D(128, 3, stride=2, padding=1, groups=128),
              (128, 16, 16), 32),  # depthwise (direct_stride2)
        Shape("relu 16x32x32", lambda: ReLU(), (16, 32, 32), 64),  # elementwise
        Shape("batchnorm 16x32x32", lambda: BatchNorm(), (16, 32, 32), 64),  # elementwise
    ]
    if quick:
        keep = ("conv 3x3 s2 32->64 32x32", "conv 3x3 32->32 16x16", "depthwise 3x3 64 32x32", "relu 16x32x32")
        return [s for s in every if s.label in keep]
    return every


@dataclasses.dataclass(frozen=True)
class Timing:
    """One shape timed: its kernel class and algorithm (from costs.py), FLOPs and bytes of forward +
    backward, the median seconds of one forward + backward, and the fixed seconds of those two calls
    (the machine's layer_forward_s + layer_backward_s), which the rate leaves out."""

    label: str
    kernel_class: str
    algorithm: object
    flops: int
    bytes: int
    seconds: float
    call_s: float = 0.0
    phases: int = 3  # kernel calls in a forward + backward: forward, backward-data, backward-weights where they work

    @property
    def arithmetic_s(self):
        """The median seconds less the calls' fixed cost."""
        return self.seconds - self.call_s

    def __post_init__(self):
        if not self.seconds > self.call_s:
            raise RuntimeError(f"calibrate: {self.label} took {self.seconds * 1e6:.1f} us, no more than the fixed "
                               f"cost of its calls ({self.call_s * 1e6:.1f} us); expected a shape large enough to time "
                               "its arithmetic: enlarge it in kernel_timing.shapes()")

    @property
    def rate(self):
        return self.flops / self.arithmetic_s

    @property
    def bandwidth(self):
        return self.bytes / self.arithmetic_s


class Probe:
    """A layer built alone on a float32 CPUBackend, ready to be timed forward and backward."""

    def __init__(self, shape):
        from pydtnn.backends import CPUBackend
        from pydtnn.model import Model
        from pydtnn.perfmodel.costs import layer_costs

        self.shape = shape
        model = Model([shape.make()], shape.input_shape, backend=CPUBackend(np.float32, seed=0))
        (_, self.layer), = model.root.children
        self.layer.need_dx = True  # as every layer but a model's first: dx is computed and counted
        cost, = layer_costs(model, shape.batch)
        self.cost = cost
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((shape.batch,) + shape.input_shape).astype(np.float32)
        self.dy = rng.standard_normal((shape.batch,) + tuple(self.layer.output_shape)).astype(np.float32)

    def step(self):
        self.layer.forward(self.x, training=True)
        self.layer.backward(self.dy)

    def visit(self, repeats, min_seconds):
        """Seconds of at least `repeats` forward + backward runs (more until min_seconds), after the warm-up."""
        for _ in range(WARM_UP):
            self.step()
        samples = []
        while len(samples) < repeats or (sum(samples) < min_seconds and len(samples) < 100):
            start = time.perf_counter()
            self.step()
            samples.append(time.perf_counter() - start)
        return samples

    def timing(self, samples, call_s=0.0):
        """The Timing of this layer whose forward + backward took the median of `samples` seconds, of which
        call_s are the calls' fixed cost."""
        c = self.cost
        work = c.forward + c.backward_data + c.backward_weights
        phases = sum(1 for ph in (c.forward, c.backward_data, c.backward_weights) if ph.flops or ph.bytes)
        return Timing(self.shape.label, c.kernel_class, c.algorithm, work.flops, work.bytes,
                      statistics.median(samples), call_s, max(1, phases))


def kernel_timings(probes, threads, quick=False, progress=None, call_s=0.0):
    """{t: [Timing] of every probe with the CPU backend at t threads} for t in `threads`, visited in
    interleaved rounds (every thread count in turn, every probe in turn); call_s: the fixed seconds of a
    forward and a backward call, left out of the rates: a number, or a function of the layer's class name."""
    call_of = call_s if callable(call_s) else (lambda kind: call_s)
    from pydtnn import runtime

    progress = progress or (lambda line: None)
    rounds, repeats, min_seconds = (2, REPEATS, 0.05) if quick else (ROUNDS, REPEATS, MIN_VISIT_S)
    samples = {(t, i): [] for t in threads for i in range(len(probes))}
    for r in range(rounds):
        for t in threads:
            progress(f"round {r + 1} of {rounds}, {t} thread{'s' if t > 1 else ''}")
            runtime.configure(threads=t)
            for i, probe in enumerate(probes):
                samples[t, i] += probe.visit(repeats, min_seconds)
    out = {t: [probe.timing(samples[t, i], call_of(type(probe.layer).__name__)) for i, probe in enumerate(probes)]
           for t in threads}
    for t in threads:
        for probe, timing in zip(probes, out[t]):
            extra = f", {timing.bandwidth / 1e9:.2f} GB/s" if timing.kernel_class == "elementwise" else ""
            progress(f"{timing.kernel_class:<11} {timing.label} ({timing.algorithm or type(probe.layer).__name__}), "
                     f"{t} thread{'s' if t > 1 else ''}: {timing.seconds * 1e3:.2f} ms, "
                     f"{timing.rate / 1e9:.2f} GFLOP/s{extra}")
    return out


def small_shapes(quick=False):
    """shapes() at a batch SMALL_DIVISOR times smaller (at least 1), elementwise ones left out: calls of
    0.2-1 ms on one thread, whose speed-up at more threads (less than the large shapes') gives
    thread_serial_s (thread_fit)."""
    from pydtnn.layers import BatchNorm, ReLU

    return [dataclasses.replace(s, label=f"{s.label} b{max(1, s.batch // SMALL_DIVISOR)}",
                                batch=max(1, s.batch // SMALL_DIVISOR))
            for s in shapes(quick) if not isinstance(s.make(), (ReLU, BatchNorm))]


def thread_fit(large_1, large_t, small_1, small_t, threads, iterations=200):
    """({kernel class: speed-up}, serial seconds per kernel call) at t threads, from the large shapes'
    Timings at 1 and t threads (large_1[i] and large_t[i] the same shape) and the small shapes' likewise.
    The model (Machine.threaded_seconds): a call of s seconds on one thread takes a + (s - a) / S at t
    threads, a the serial part of each of its kernel calls (Timing.phases of them) and S its class's
    speed-up. A class's S is the median over its large shapes of the S that gives back their time at t
    threads given a; a is the median over the small shapes of the a that gives back theirs given their
    class's S (0 where they gained as much as the large ones). The two are solved in turn until they
    settle. No class is given more than `threads` times. Arithmetic seconds (Timing.arithmetic_s)
    throughout: the calls' fixed cost is apart."""
    def speedup(one, many, serial):
        serial = min(serial, 0.9 * many)
        if one <= serial:  # slower at t threads than the serial part allows: the plain ratio
            return one / many
        return (one - serial) / (many - serial)

    serial = 0.0
    for _ in range(iterations):
        by_class = {}
        for a, b in zip(large_1, large_t):
            by_class.setdefault(a.kernel_class, []).append(
                speedup(a.arithmetic_s, b.arithmetic_s, serial * a.phases))
        scaling = {k: min(statistics.median(v), float(threads)) for k, v in by_class.items()}
        parts = []
        for a, b in zip(small_1, small_t):
            s = scaling.get(a.kernel_class)
            if s is None or s <= 1.0:
                continue  # a class that gains nothing from threads says nothing about the serial part
            part = (b.arithmetic_s - a.arithmetic_s / s) / (1.0 - 1.0 / s)
            parts.append(min(max(part, 0.0), a.arithmetic_s) / a.phases)
        new = statistics.median(parts) if parts else 0.0
        if abs(new - serial) <= 1e-13:
            break
        serial = new
    return scaling, serial


def class_rates(timings):
    """{kernel class: median FLOP/s over its shapes}; every class of KERNEL_CLASSES must have one."""
    by_class = {k: [t.rate for t in timings if t.kernel_class == k] for k in KERNEL_CLASSES}
    missing = [k for k, rates in by_class.items() if not rates]
    if missing:
        raise RuntimeError(f"calibrate: no shape fell in kernel class {', '.join(missing)}; the CPU backend's "
                           "algorithm choices changed (backends/cpu/conv_algorithms.py): update kernel_timing.shapes()")
    return {k: statistics.median(rates) for k, rates in by_class.items()}


def memory_bandwidth(nbytes=STREAM_BYTES, repeats=STREAM_REPEATS):
    """Bytes/s of np.copyto between two nbytes float32 arrays: 2*nbytes (read + written) over the median time."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)  # written once, so the timed copies touch no fresh pages
    return 2 * nbytes / median_seconds(lambda: np.copyto(dst, src), repeats)


def reduce_rate(nbytes=STREAM_BYTES, repeats=STREAM_REPEATS):
    """Bytes/s of np.add(a, b, out=a) on nbytes float32 buffers: nbytes over the median time."""
    a = np.zeros(nbytes // 4, np.float32)
    b = np.ones_like(a)
    return nbytes / median_seconds(lambda: np.add(a, b, out=a), repeats)


def median_seconds(fn, repeats):
    """The median seconds of `repeats` calls of fn(), after one untimed call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
