"""Measure a Machine on the machine at hand: `pydtnn-perfmodel calibrate --out machine.yaml`.

    machine, report = calibrate(threads=(1, 2), np_=2, level="intra", base=DEFAULT, quick=False)
    alpha, beta = fit_alpha_beta([8, 1024, 1 << 20], [2e-6, 2.2e-6, 2.1e-4])

What is measured, and how each figure agrees with the rest of the model:
- rates[kernel class], FLOP/s on one thread: small real layers built on the CPU backend, timed forward
  plus backward (need_dx on, as for every layer but a model's first): the median of all timed runs,
  taken in ROUNDS interleaved visits per shape and thread count, each after WARM_UP untimed runs. A
  shape's rate is the FLOPs that costs.layer_costs assigns to those three phases over that time, so a prediction that divides the
  same FLOPs by the rate gives back the measured time: the counts agree by construction, and each
  measurement is filed under the kernel_class costs.py gives the layer. A class's rate is the MEDIAN
  of its shapes' rates (the mean of the middle two for an even count). "elementwise" (ReLU,
  BatchNorm) is memory-bound: its bytes per second (costs.py's bytes over the same time) are
  reported next to its FLOP/s.
- overheads, seconds: the fixed costs outside the arithmetic, from pydtnn's own Trainer running
  FIXED_STEPS traced steps (after FIXED_WARM_UP) of tiny_model() at batch 1 on one thread, where every
  layer's arithmetic takes well under a microsecond. layer_forward_s and layer_backward_s: the mean over
  the model's layers of each layer's median forward (backward) span; parameter_s: the median optimizer
  span over the number of parameter tensors; step_s: the median of the step span less its layer spans
  and its optimizer span (data, loss, the trainer's and the containers' bookkeeping).
  layer_calls[kind]: the same two means over the layers of one kind (class name: Conv2D, BatchNorm,
  ReLU, MaxPool2D, Flatten, Dense), which predict uses for layers of that kind. They are measured
  first, and each shape's rate above is its FLOPs over its median time LESS one forward and one backward
  call of its kind (predict adds them back), so a prediction still gives back the measured time.
- thread_scaling_by_class[k] {t: s} and thread_serial_s {t: a}: the same layers at t threads
  (runtime.configure(threads=t)), and small_shapes() (the non-elementwise ones at a 16 times smaller
  batch, 0.2-1 ms calls) at 1 and t threads. A kernel call of s seconds on one thread is modelled as
  a + (s - a) / S at t threads (Machine.threaded_seconds): thread_fit solves for the serial part a of
  every call and each class's speed-up S beyond it, from the large shapes (mostly S) and the small
  ones (mostly a) in turn. thread_scaling {t: s}: the median of the classes' S. Thread counts not
  measured keep the base's entries.
- memory_bandwidth: np.copyto between two 64 MiB float32 arrays on one thread, bytes read plus bytes
  written over the median time.
- reduce_rate: np.add(a, b, out=a) on 64 MiB float32 buffers on one thread, bytes of a over the
  median time (the 1/gamma of collectives.py: seconds per byte reduced).
- links[level]: `mpiexec -n NP python -m pydtnn.perfmodel.mpi_probe` (a subprocess with a timeout)
  times ping-pong between ranks 0 and 1 from 8 bytes to 16 MiB; fit_alpha_beta gives latency and
  bandwidth. Its allreduce times over the same sizes are printed (a Machine has no field for them).
  The other level is the base's, unchanged. links[level].collectives[op]: the probe also times
  allgather, reduce_scatter and allreduce through pydtnn's communicator as the trainer calls them
  (mpi_probe.py); fit_collective gives each its own latency and bandwidth, those that the ring formula
  of collectives.py at the probe's NP (with the measured reduce_rate as gamma) needs to give back the
  measured times. On this one machine the probe's ranks share memory, which
  is the intra-node link. The inter-node link is calibrated under benchmarks/netem.py, which runs a
  command in a network namespace whose loopback (or veth pair, with --nodes 2) is capped by tc and
  forces MPICH onto TCP, so the probe measures the emulated link:
      python benchmarks/netem.py --rate 1gbit -- pydtnn-perfmodel calibrate --level inter \\
          --base machine.yaml --out machine_1gbit.yaml
- overheads.oversubscribed_collective_s (with --level intra): `mpiexec -n 2*cores python -m
  pydtnn.perfmodel.mpi_probe --oversubscribed`, twice as many ranks as cores, each running bursts of
  BURST_S of one-thread compute (timed here, alone) with and without an 8-byte allreduce after each;
  the extra seconds per burst. Predict adds it per collective where a node's ranks x threads exceed
  its cores. The base's value is kept with --level inter or without MPI.
- cores: the cores this process may run on (os.sched_getaffinity). processes_per_node: NP with
  --level intra (the probe's ranks all ran on this node, which is what was measured); the base's with
  --level inter or without MPI (the probe then measures one link, not how ranks are placed).
- name: --name, else the CPU model from /proc/cpuinfo and the core count.
"""

import bisect
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from pydtnn.errors import PydtnnError
from pydtnn.perfmodel.machine import KERNEL_CLASSES, LEVELS, Link, Machine

STREAM_BYTES = 64 << 20  # each of the two arrays of the copy and of the reduction
WARM_UP = 2  # untimed runs of a shape each time it is visited (the first visit loads the compiled kernels)
ROUNDS = 3  # visits of every (shape, thread count), interleaved, so that a load that comes and goes on a
            # shared machine falls on every thread count alike (2 with quick)
REPEATS = 3  # timed runs per visit at least, more for shapes under MIN_VISIT_S
MIN_VISIT_S = 0.25  # a visit times a shape for about this long at least (0.05 s with quick)
STREAM_REPEATS = 10  # timed copies and additions (5 with quick)
FIXED_WARM_UP, FIXED_STEPS = 30, 200  # trainer steps of tiny_model(): untimed, then timed (10 and 60 with quick)
MPI_TIMEOUT_S = 120.0
BURST_S = 2e-3  # compute between two collectives in the oversubscribed probe: a layer's worth, on one thread
SMALL_DIVISOR = 16  # small_shapes(): the large shapes' batch over this
FIT_ALGORITHM = "ring"  # the formula a collective's own link is fitted through (MPICH's for large messages)


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
                               "its arithmetic: enlarge it in calibrate.shapes()")

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
                           "algorithm choices changed (conv_plan.py): update calibrate.shapes()")
    return {k: statistics.median(rates) for k, rates in by_class.items()}


def tiny_model():
    """The layers a network is built of, on a (2, 4, 4) input, with a few hundred FLOPs each at batch 1: a
    direct and an im2col 3x3 convolution, a depthwise and a pointwise one, BatchNorm, ReLU, max pooling,
    Flatten and two Dense layers (15 layers, 16 parameter tensors)."""
    from pydtnn.backends import CPUBackend
    from pydtnn.layers import BatchNorm, Conv2D, Dense, Flatten, MaxPool2D, ReLU
    from pydtnn.model import Model

    layers = [Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), Conv2D(4, 3, stride=2, padding=1), BatchNorm(), ReLU(),
              Conv2D(4, 3, padding=1, groups=4), Conv2D(8, 1), BatchNorm(), ReLU(), MaxPool2D(2), Flatten(),
              Dense(8), ReLU(), Dense(2)]
    return Model(layers, (2, 4, 4), backend=CPUBackend(np.float32, seed=0))


def fixed_costs(quick=False):
    """(Overheads, detail) from the Trainer's traced steps of tiny_model() at batch 1 (see the module
    docstring and fixed_costs_from_trace), at the threads configured now."""
    from pydtnn import losses, optim
    from pydtnn.data.synthetic import SyntheticDataset
    from pydtnn.profiling import Tracer
    from pydtnn.trainer import Trainer

    warm_up, steps = (10, 60) if quick else (FIXED_WARM_UP, FIXED_STEPS)
    model = tiny_model()
    optimizer = optim.create("sgd", model.parameters(), backend=model.backend, lr=1e-3, momentum=0.9)
    trainer = Trainer(model, losses.create("categorical_cross_entropy"), optimizer, progress=False,
                      epoch_lines=False)
    tracer = Tracer()
    trainer.tracer = tracer
    model.set_tracer(tracer)
    data = SyntheticDataset(warm_up + steps, model.input_shape, 2, seed=0)
    trainer.fit(data, epochs=1, batch_size=1, steps_per_epoch=warm_up + steps)
    return fixed_costs_from_trace(tracer.events, [name for name, _ in model.layers()], len(model.parameters()),
                                  warm_up, kinds={name: type(layer).__name__ for name, layer in model.layers()})


def fixed_costs_from_trace(events, layers, tensors, warm_up, kinds=None):
    """(Overheads, {"layers", "parameters", "steps", "step_s", "optimizer_s"}) from a Trainer's trace
    (Chrome-trace events, times in µs) of a model whose arithmetic is negligible, after `warm_up` steps:
    layer_forward_s (layer_backward_s) the mean over `layers` (their span names) of each one's median
    forward (backward) span per step, and with kinds ({layer: class name}) layer_calls[kind] the same means
    over the layers of each kind; parameter_s the median optimizer span over `tensors` parameter
    tensors; step_s the median over the steps of the step span less the layer and optimizer spans in it."""
    from pydtnn.perfmodel.machine import Overheads

    step_spans = sorted((e for e in events if e["cat"] == "step"), key=lambda e: e["ts"])[warm_up:]
    if not step_spans or not layers or tensors < 1:
        raise RuntimeError(f"calibrate: {len(step_spans)} steps after {warm_up} warm-up steps, {len(layers)} layers, "
                           f"{tensors} parameter tensors in the tiny model's trace; expected at least one of each")
    n = len(step_spans)
    starts = [e["ts"] for e in step_spans]
    layer_s = {(phase, name): [0.0] * n for phase in ("forward", "backward") for name in layers}
    optimizer_s, inside = [0.0] * n, [0.0] * n
    for e in events:
        if e["cat"] == "step" or e.get("ph") != "X":
            continue
        i = _step_of(e["ts"], starts)
        if i is None:
            continue
        if e["tid"] == 0 and (e["cat"], e["name"]) in layer_s:
            layer_s[e["cat"], e["name"]][i] += e["dur"] / 1e6
            inside[i] += e["dur"] / 1e6
        elif e["tid"] == 1 and e["cat"] == "optimizer":
            optimizer_s[i] += e["dur"] / 1e6
            inside[i] += e["dur"] / 1e6
    def call(phase, names):
        return statistics.mean(statistics.median(layer_s[phase, name]) for name in names)

    by_kind = {}
    for name in layers if kinds else ():
        by_kind.setdefault(kinds[name], []).append(name)
    rest = statistics.median(e["dur"] / 1e6 - s for e, s in zip(step_spans, inside))
    fixed = Overheads(layer_forward_s=call("forward", layers), layer_backward_s=call("backward", layers),
                      parameter_s=statistics.median(optimizer_s) / tensors, step_s=max(0.0, rest),
                      layer_calls={kind: (call("forward", names), call("backward", names))
                                   for kind, names in by_kind.items()})
    detail = {"layers": len(layers), "parameters": tensors, "steps": n,
              "step_s": statistics.median(e["dur"] / 1e6 for e in step_spans),
              "optimizer_s": statistics.median(optimizer_s)}
    return fixed, detail


def _step_of(ts, starts):
    """The index of the step whose span starts last at or before `ts` (µs), or None before the first."""
    i = bisect.bisect_right(starts, ts) - 1
    return i if i >= 0 else None


def memory_bandwidth(nbytes=STREAM_BYTES, repeats=STREAM_REPEATS):
    """Bytes/s of np.copyto between two nbytes float32 arrays: 2*nbytes (read + written) over the median time."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)  # written once, so the timed copies touch no fresh pages
    return 2 * nbytes / _median_seconds(lambda: np.copyto(dst, src), repeats)


def reduce_rate(nbytes=STREAM_BYTES, repeats=STREAM_REPEATS):
    """Bytes/s of np.add(a, b, out=a) on nbytes float32 buffers: nbytes over the median time."""
    a = np.zeros(nbytes // 4, np.float32)
    b = np.ones_like(a)
    return nbytes / _median_seconds(lambda: np.add(a, b, out=a), repeats)


def _median_seconds(fn, repeats):
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# -- network ------------------------------------------------------------------------------------------


def fit_alpha_beta(sizes, seconds):
    """(alpha, beta) of one-way time = alpha + n*beta by least squares over (n bytes, seconds) pairs.

    The residuals are relative (each divided by its measured time), so that the microsecond times of
    small messages set alpha as much as the millisecond ones of large messages set beta; with plain
    residuals a 1% error at 16 MiB outweighs every small message. A negative alpha (noise) is fitted
    again with alpha = 0. Raises ValueError unless there are two distinct sizes, every time is
    positive and beta comes out positive."""
    n = np.asarray(sizes, np.float64)
    t = np.asarray(seconds, np.float64)
    if n.ndim != 1 or n.shape != t.shape:
        raise ValueError(f"fit_alpha_beta: {n.shape[0] if n.ndim else 0} sizes and {t.size} times; expected "
                         "two lists of the same length")
    if len(np.unique(n)) < 2:
        raise ValueError(f"fit_alpha_beta: sizes {n.tolist()}; expected at least two distinct sizes")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n >= 0)):
        raise ValueError(f"fit_alpha_beta: times {t.tolist()}, sizes {n.tolist()}; expected times > 0, sizes >= 0")
    w = 1.0 / t
    (alpha, beta), *_ = np.linalg.lstsq(np.column_stack([w, n * w]), np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(n * w) / np.sum((n * w) ** 2))
    if not beta > 0:
        raise ValueError(f"fit_alpha_beta: the times {t.tolist()} do not grow with the sizes {n.tolist()} "
                         f"(fitted beta {beta:.3g} s/byte); expected bandwidth-bound large messages")
    return float(alpha), float(beta)


def fit_collective(op, p, sizes, seconds, gamma, algorithm=FIT_ALGORITHM):
    """Link (latency, bandwidth) that `op`'s `algorithm` formula (collectives.py) over p processes needs
    to give the measured (n bytes, seconds): each formula is a alpha + b n beta + c n gamma, so
    (t - c n gamma) / a = alpha + (b / a) n beta is fitted by fit_alpha_beta. ValueError as that one
    raises, or when gamma's share leaves no time to fit."""
    from pydtnn.perfmodel.collectives import FORMULAS

    formula = FORMULAS[op][algorithm]
    a, b, c = formula(0, p, 1.0, 0.0, 0.0), formula(1, p, 0.0, 1.0, 0.0), formula(1, p, 0.0, 0.0, 1.0)
    if a <= 0 or b <= 0:
        raise ValueError(f"fit_collective: {op} by {algorithm} over {p} processes has no latency or bandwidth term")
    rest = [(t - c * n * gamma) / a for n, t in zip(sizes, seconds)]
    if min(rest) <= 0:
        raise ValueError(f"fit_collective: {op} took {list(seconds)} s, no more than its reductions at "
                         f"{1 / gamma / 1e9:.2f} GB/s; expected times above the reduction's")
    alpha, beta = fit_alpha_beta([b / a * n for n in sizes], rest)
    return Link(latency_s=alpha, bandwidth_bytes_per_s=1.0 / beta)


def collective_links(probe, gamma):
    """{op: Link} fitted on the probe's "collectives" times (none for an older probe's result)."""
    return {op: fit_collective(op, probe["np"], *zip(*times), gamma)
            for op, times in (probe.get("collectives") or {}).items()}


def burst_work(seconds=BURST_S):
    """Units of mpi_probe.burst's work that take `seconds` here on one thread (the median of 5 timings)."""
    from pydtnn.perfmodel import mpi_probe

    a, b = np.zeros(mpi_probe.BURST_ELEMENTS, np.float32), np.ones(mpi_probe.BURST_ELEMENTS, np.float32)
    unit = _median_seconds(lambda: mpi_probe.burst(100, a, b), 5) / 100
    return max(1, round(seconds / unit))


def mpiexec_path():
    """The mpiexec next to the Python in use (pip's mpich puts it there), else the first on PATH, else None."""
    mine = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return mine if os.access(mine, os.X_OK) else shutil.which("mpiexec")


def mpi_missing():
    """Why the probe cannot run here (one sentence), or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py mpich)"
    if mpiexec_path() is None:
        return f"no mpiexec next to {sys.executable} or on PATH (pip install mpich)"
    return None


def run_mpi_probe(np_, quick=False, timeout=MPI_TIMEOUT_S, extra=()):
    """The probe's result ({"np", "pingpong", "allreduce", "collectives"}, or with extra = ("--oversubscribed",
    ...) that mode's) from `mpiexec -n np_`; PydtnnError when it fails or runs past `timeout` seconds
    (its whole process group is then ended)."""
    cmd = [mpiexec_path(), "-n", str(np_), sys.executable, "-m", "pydtnn.perfmodel.mpi_probe"]
    cmd += (["--quick"] if quick else []) + list(extra)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    shown = " ".join(cmd[:3]) + " python -m pydtnn.perfmodel.mpi_probe"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        raise PydtnnError(f"the MPI probe ({shown}) did not finish in {timeout:g} s: MPI hangs or is very slow "
                          "here (under benchmarks/netem.py: is the burst at least 64 KiB?); raise --mpi_timeout "
                          "or pass --no_mpi to keep the base's links") from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise PydtnnError(f"the MPI probe ({shown}) failed with exit code {proc.returncode}: {last}")
    result = json.loads(lines[-1])
    if result["np"] != np_:
        raise PydtnnError(f"the MPI probe ran with {result['np']} processes under {shown}; the mpiexec found "
                          "belongs to another MPI than mpi4py's")
    return result


def _end_group(proc):
    """SIGTERM to the probe's process group (its own session), SIGKILL after 3 s."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 3)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# -- the machine ----------------------------------------------------------------------------------------


def cpu_model():
    """The CPU model named in /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return None


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclasses.dataclass
class Report:
    """What calibrate measured, beyond the Machine: every shape's timing per thread count, the
    per-class rates per thread count, the probe's raw result and the level it measured."""

    timings: dict  # threads -> [Timing]
    rates: dict  # threads -> {kernel class: FLOP/s}
    probe: object  # the probe's result, or None
    level: str
    memory_bandwidth: float
    reduce_rate: float
    fixed: dict = dataclasses.field(default_factory=dict)  # fixed_costs()'s detail
    oversubscribed: dict = None  # the oversubscribed probe's result, or None
    small_timings: dict = None  # threads -> [Timing] of small_shapes()


def calibrate(threads=(1, 2), np_=2, level="intra", base=None, name=None, quick=False, mpi=True,
              mpi_timeout=MPI_TIMEOUT_S, progress=None):
    """(Machine, Report) measured here; see the module docstring. base: the Machine whose unmeasured
    fields are kept (default machine.DEFAULT); mpi=False keeps the base's links."""
    from pydtnn import runtime
    from pydtnn.perfmodel import machine as machine_module

    progress = progress or (lambda line: None)
    base = base or machine_module.DEFAULT
    threads = sorted({int(t) for t in threads})
    if threads[0] != 1:
        raise ValueError(f"calibrate: threads {threads}; expected 1 among them (rates are per thread)")
    if level not in LEVELS:
        raise ValueError(f"calibrate: level {level!r}; expected one of {', '.join(LEVELS)}")
    previous = runtime.configured()
    repeats = STREAM_REPEATS // 2 if quick else STREAM_REPEATS

    # the probe first: a broken MPI fails before minutes of timing
    links, processes_per_node, probe, crowded = _measure_network(np_, level, base, quick, mpi, mpi_timeout, progress)

    runtime.configure(threads=1)
    progress("fixed costs: trainer steps of a tiny model at batch 1, 1 thread")
    fixed, fixed_detail = fixed_costs(quick)
    progress(f"fixed costs: layer call {fixed.layer_forward_s * 1e6:.1f} us forward, "
             f"{fixed.layer_backward_s * 1e6:.1f} us backward; {fixed.parameter_s * 1e6:.1f} us per parameter "
             f"tensor; {fixed.step_s * 1e6:.0f} us per step")
    progress(f"building {len(shapes(quick)) + len(small_shapes(quick))} layers")
    probes = [Probe(s) for s in shapes(quick)]
    small = [Probe(s) for s in small_shapes(quick)] if len(threads) > 1 else []
    try:
        every = kernel_timings(probes + small, threads, quick, progress, lambda kind: sum(fixed.call_s(kind)))
        timings = {t: every[t][:len(probes)] for t in threads}
        small_timings = {t: every[t][len(probes):] for t in threads}
        rates = {t: class_rates(timings[t]) for t in threads}
        runtime.configure(threads=1)
        bandwidth = memory_bandwidth(repeats=repeats)
        progress(f"memory bandwidth (copy, 1 thread): {bandwidth / 1e9:.2f} GB/s")
        gamma_rate = reduce_rate(repeats=repeats)
        progress(f"reduce rate (np.add, 1 thread): {gamma_rate / 1e9:.2f} GB/s")
    finally:
        if previous is not None:
            runtime.configure(threads=previous["threads"])

    scaling, by_class, serial = _thread_scaling(base, threads, timings, small_timings, progress)

    if probe is not None:
        try:
            fits = collective_links(probe, 1.0 / gamma_rate)
        except ValueError as e:
            raise PydtnnError(f"the MPI probe's collective times give no {level} link per operation: {e}") from None
        for op, fit in fits.items():
            progress(f"{level} {op}: latency {fit.latency_s * 1e6:.2f} us, bandwidth "
                     f"{fit.bandwidth_bytes_per_s / 1e9:.3f} GB/s ({FIT_ALGORITHM} over {probe['np']} processes)")
        links[level] = dataclasses.replace(links[level], collectives=fits)
    if crowded is not None:
        fixed = dataclasses.replace(fixed, oversubscribed_collective_s=crowded["collective_s"])
    else:
        fixed = dataclasses.replace(fixed, oversubscribed_collective_s=base.overheads.oversubscribed_collective_s)

    n_cores = cores()
    model_name = cpu_model()
    name = name or (f"{model_name} ({n_cores} cores)" if model_name else f"{n_cores}-core machine")
    machine = Machine(name=name, cores=n_cores, processes_per_node=processes_per_node, rates=rates[1],
                      thread_scaling=scaling, memory_bandwidth=bandwidth, reduce_rate=gamma_rate, links=links,
                      thread_scaling_by_class=by_class, thread_serial_s=serial, overheads=fixed)
    return machine, Report(timings, rates, probe, level, bandwidth, gamma_rate, fixed_detail, crowded, small_timings)


def _measure_network(np_, level, base, quick, mpi, mpi_timeout, progress):
    """(links, processes per node, the probe's report or None, the oversubscribed probe's or None): the MPI
    ping-pong's alpha-beta link at `level`, and with level intra the cost of a collective among more ranks
    than cores. mpi=False keeps the base's links."""
    links, processes_per_node, probe, crowded = dict(base.links), base.processes_per_node, None, None
    if not mpi:
        return links, processes_per_node, probe, crowded
    progress(f"MPI probe: mpiexec -n {np_} ({level} link)")
    probe = run_mpi_probe(np_, quick=quick, timeout=mpi_timeout)
    sizes, seconds = zip(*probe["pingpong"])
    try:
        alpha, beta = fit_alpha_beta(sizes, seconds)
    except ValueError as e:
        raise PydtnnError(f"the MPI probe's ping-pong times give no {level} link: {e}") from None
    links[level] = Link(latency_s=alpha, bandwidth_bytes_per_s=1.0 / beta)
    progress(f"{level} link: latency {alpha * 1e6:.2f} us, bandwidth {1 / beta / 1e9:.3f} GB/s")
    if level != "intra":
        return links, processes_per_node, probe, crowded
    work, ranks = burst_work(), 2 * cores()
    progress(f"MPI probe, oversubscribed: mpiexec -n {ranks} on {cores()} cores, bursts of "
             f"{BURST_S * 1e3:g} ms ({work} units)")
    crowded = run_mpi_probe(ranks, quick=quick, timeout=mpi_timeout,
                            extra=("--oversubscribed", "--burst_work", str(work)))
    crowded["burst_s"] = BURST_S
    progress(f"oversubscribed: {crowded['collective_s'] * 1e3:.2f} ms per collective "
             f"({crowded['with_s'] * 1e3:.2f} ms a burst with one, {crowded['without_s'] * 1e3:.2f} without)")
    return links, np_, probe, crowded


def _thread_scaling(base, threads, timings, small_timings, progress):
    """(median speed-up per thread count, per kernel class, serial seconds per call): each count beyond one
    fitted against one thread's timings; the base's values kept for counts not measured."""
    scaling = dict(base.thread_scaling)
    by_class = {k: dict(v) for k, v in base.thread_scaling_by_class.items()}
    serial = dict(base.thread_serial_s)
    for t in threads[1:]:
        classes, serial[t] = thread_fit(timings[1], timings[t], small_timings[1], small_timings[t], t)
        scaling[t] = statistics.median(classes[k] for k in KERNEL_CLASSES)
        for k in KERNEL_CLASSES:
            by_class.setdefault(k, {1: 1.0})[t] = classes[k]
        progress(f"{t} threads: {serial[t] * 1e6:.0f} us of each kernel call serial; speed-up beyond it "
                 + ", ".join(f"{k} {classes[k]:.2f}" for k in KERNEL_CLASSES))
    return scaling, by_class, serial


def summary(machine, report, base_name):
    """The lines printed after calibrating: rates per class and thread count, bandwidths, links, allreduce."""
    threads = sorted(report.rates)
    head = f"{'kernel class':<12} {'GFLOP/s':>9} {'shapes':>6}" + "".join(f" {f'x{t} thr':>7}" for t in threads[1:])
    lines = [f"machine: {machine.name}, {machine.cores} cores, {machine.processes_per_node} processes per node",
             head]
    for k in KERNEL_CLASSES:
        count = sum(t.kernel_class == k for t in report.timings[1])
        row = f"{k:<12} {report.rates[1][k] / 1e9:>9.2f} {count:>6}"
        row += "".join(f" {machine.thread_speedup(t, k):>7.2f}" for t in threads[1:])
        if k == "elementwise":
            moved = statistics.median(t.bandwidth for t in report.timings[1] if t.kernel_class == k)
            row += f"   ({moved / 1e9:.2f} GB/s moved)"
        lines.append(row)
    lines.append("thread scaling: " + ", ".join(f"{t}: {s:.2f}" for t, s in sorted(machine.thread_scaling.items()))
                 + "; serial part of each kernel call: " + (", ".join(
                     f"{t} threads {s * 1e6:.0f} us" for t, s in sorted(machine.thread_serial_s.items())) or "none"))
    o = machine.overheads
    lines.append(f"fixed costs: layer call {o.layer_forward_s * 1e6:.1f} us forward, {o.layer_backward_s * 1e6:.1f} us "
                 f"backward; {o.parameter_s * 1e6:.1f} us per parameter tensor; {o.step_s * 1e6:.0f} us per step; "
                 f"{o.oversubscribed_collective_s * 1e3:.2f} ms per collective on oversubscribed cores "
                 f"({'measured' if report.oversubscribed is not None else f'from {base_name}'})")
    if o.layer_calls:
        lines.append("  layer calls by kind: " + ", ".join(f"{kind} {f * 1e6:.1f} / {b * 1e6:.1f} us"
                                                           for kind, (f, b) in sorted(o.layer_calls.items())))
    lines.append(f"memory bandwidth {machine.memory_bandwidth / 1e9:.2f} GB/s, reduce rate "
                 f"{machine.reduce_rate / 1e9:.2f} GB/s")
    for level in LEVELS:
        link = machine.links[level]
        how = "measured" if report.probe is not None and level == report.level else f"from {base_name}"
        lines.append(f"link {level:<5} latency {link.latency_s * 1e6:8.2f} us, bandwidth "
                     f"{link.bandwidth_bytes_per_s / 1e9:8.3f} GB/s ({how})")
        for op, fit in link.collectives.items():
            lines.append(f"  {op:<14} latency {fit.latency_s * 1e6:8.2f} us, bandwidth "
                         f"{fit.bandwidth_bytes_per_s / 1e9:8.3f} GB/s (its own fit)")
    if report.probe is not None:
        lines.append(f"allreduce over {report.probe['np']} processes (not kept in the machine file):")
        lines.append("  " + ", ".join(f"{_bytes(n)} {t * 1e6:.1f} us" for n, t in report.probe["allreduce"]))
    return lines


def _bytes(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
