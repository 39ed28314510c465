"""A convolution's algorithm measured on the machine it runs on, not chosen by thresholds tuned elsewhere.

For each layer shape (geometry, output channels) the eligible algorithms (candidates(): the entries
of conv_algorithms.REGISTRY that take it) are timed on random data at batch 32 (Tuner.batch): forward +
backward, in interleaved rounds, the median of each. Not smaller: at batch 8, fixed costs per call (handing
chunks to the threads) decided the choice, and on two threads it went the other way from batch 64.
The threshold choice (conv_plan.choose) stays unless another candidate is faster by `margin` (5%):
timing noise never flips a choice that measures the same.

Choices are cached as JSON in a per-user file (default_path(): ~/.cache/pydtnn/conv_autotune.json),
keyed by CPU model, vector ISA, threads, dtype, kernels, the timed batch and the shape, so the next
run starts without timing. A file that does not parse is ignored and rewritten; an entry naming an algorithm
that is no longer eligible for its shape is ignored.
"""

import json
import os
import statistics
import time

import numpy as np

from pydtnn.backends.cpu import conv_plan, isa, threads
from pydtnn.backends.cpu.conv_algorithms import BY_NAME, REGISTRY
from pydtnn.backends.cpu.workspace import Workspace
from pydtnn.errors import ConfigError
from pydtnn.files import read_bytes, write_atomic

# the cache file's "format": a file of another format is ignored, so its shapes are timed again. 2: Winograd
# joined the candidates. 3: Winograd's weight gradient became its own, F(3x3, 2x2), and its times changed
FORMAT = "pydtnn conv autotune 3"
CACHE_LIMIT = 16 << 20  # bytes: a cache file is a few kilobytes per machine


def cpu_info():
    """(model name, vector ISA) of this CPU: ('AMD EPYC 7B13', 'avx2'); ISA 'avx512f', 'avx2' or 'other'
    (isa.cpu_features, isa.isa_name); ('unknown', 'other') where /proc/cpuinfo cannot be read."""
    model, flags = isa.cpu_features()
    return model, isa.isa_name(flags)


def describe_cpu():
    """'AMD EPYC 7B13 (avx2; kernels: 256-bit vectors (the CPU's))': the line benchmark tables print."""
    model, name = cpu_info()
    return f"{model} ({name}; kernels: {isa.describe()})"


def default_path():
    """The cache file: $XDG_CACHE_HOME/pydtnn/conv_autotune.json, else ~/.cache/pydtnn/conv_autotune.json
    (the folder of downloaded datasets by default; Numba's kernel cache sits next to the kernels)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "pydtnn", "conv_autotune.json")


def candidates(g, co, kernels, tuning):
    """The algorithms that compute geometry g with co output channels (the eligible entries of
    conv_algorithms.REGISTRY, in its order), the threshold choice first."""
    first = conv_plan.choose(g, co, kernels, tuning).algorithm
    return (first, *[a.name for a in REGISTRY if a.name != first and a.eligible(g, co, kernels, tuning)])


def key(g, co, dtype, n_threads, kernels, batch, cpu=None, bits=None):
    """The cache key of one layer shape timed at `batch` samples on this machine, with the kernels'
    vector width (isa.VECTOR_BITS unless `bits`): a readable string."""
    model, name = cpu or cpu_info()
    vectors = f"{name} {bits or isa.VECTOR_BITS}-bit"
    shape = (f"c{g.c} {g.h}x{g.w} k{g.kh}x{g.kw} s{g.sh}x{g.sw} d{g.dh}x{g.dw} "
             f"p{g.pt},{g.pb},{g.pl},{g.pr} g{g.groups} co{co}")
    return f"{model} | {vectors} | {n_threads} threads | {np.dtype(dtype).name} | {kernels} | batch {batch} | {shape}"


def pick(times, first, margin):
    """The algorithm to use from {algorithm: seconds}: `first` (the threshold choice) unless another is
    faster than it by more than `margin` (a fraction), then the fastest."""
    best = min(times, key=times.get)
    return best if times[best] < times[first] * (1 - margin) else first


def measure(g, co, algorithms, dtype, kernels, tuning, batch=32, rounds=5, slow=1.0):
    """{algorithm: median seconds of forward + backward (dx and dw)} at `batch` samples, on random data.

    Runs each algorithm's entry (conv_algorithms.py) on a Workspace of its own (its own scratch pool;
    random numbers of its own: the model's stream is untouched); one untimed call of each first (it
    compiles the kernels it needs), then `rounds` rounds, each timing every algorithm once, so a slow
    spell of the machine falls on all alike; 3 rounds when the untimed calls took more than `slow`
    seconds (large images)."""
    b = Workspace(kernels, tuning)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, g.c, g.h, g.w)).astype(dtype)
    w = rng.standard_normal((co, g.c // g.groups, g.kh, g.kw)).astype(dtype)
    dy = rng.standard_normal((batch, co, g.ho, g.wo)).astype(dtype)
    plans = {a: conv_plan.plan_for(g, a) for a in algorithms}

    def once(plan):
        entry = BY_NAME[plan.algorithm]
        t0 = time.perf_counter()
        _, ctx = entry.forward(b, x, w, plan.run, True)
        entry.backward(b, dy, w, ctx, plan.run, True)
        ctx.release()
        return time.perf_counter() - t0

    if sum(once(plan) for plan in plans.values()) > slow:
        rounds = min(rounds, 3)
    samples = {a: [] for a in algorithms}
    for _ in range(rounds):
        for a, plan in plans.items():
            samples[a].append(once(plan))
    return {a: statistics.median(s) for a, s in samples.items()}


class Tuner:
    """Measured choices of convolution algorithms, cached in the JSON file at `path`.

    path: the cache file (default_path()); None keeps choices in memory only.
    measure: (g, co, algorithms, dtype, kernels, tuning, batch) -> {algorithm: seconds}; default measure().
    margin: how much faster than the threshold choice another algorithm must be to replace it.
    batch: samples per timed call.
    """

    def __init__(self, path=default_path, measure=measure, margin=0.05, batch=32):
        self.path = path() if callable(path) else path
        self.measure, self.margin, self.batch = measure, margin, batch
        self._choices = None  # key -> algorithm, read from the file on first use

    def __repr__(self):
        return f"Tuner(path={self.path!r}, margin={self.margin}, batch={self.batch})"

    def read(self):
        """{key: algorithm} from the cache file, algorithms this build has; {} when it is missing or does not
        parse."""
        return {k: a for k, a in self._stored().items() if a in conv_plan.ALGORITHMS}

    def _stored(self):
        """Every {key: name} the file holds, names this build lacks included (save keeps them)."""
        if self.path is None:
            return {}
        try:
            doc = json.loads(read_bytes(self.path, "convolution autotune cache", CACHE_LIMIT).decode("utf-8"))
        except (FileNotFoundError, ConfigError, ValueError, RecursionError):  # missing, unreadable, not JSON
            return {}
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("choices"), dict):
            return {}
        return {k: a for k, a in doc["choices"].items() if isinstance(k, str) and isinstance(a, str)}

    def choices(self):
        if self._choices is None:
            self._choices = self.read()
        return self._choices

    def key(self, g, co, dtype, kernels):
        """key() of this shape with the threads in use now and this tuner's batch."""
        return key(g, co, dtype, threads.threads(), kernels, self.batch)

    def cached(self, g, co, dtype, kernels, tuning):
        """The algorithm cached for this shape on this machine, or None (not timed yet, or an algorithm
        that no longer computes this shape)."""
        a = self.choices().get(self.key(g, co, dtype, kernels))
        return a if a is not None and a in candidates(g, co, kernels, tuning) else None

    def choose(self, shapes, dtype, kernels, tuning, say=None, every=10.0):
        """{(g, co): algorithm} for every shape in `shapes`: from the cache, else timed now (and the cache
        rewritten). say: prints one line before the first timing, then one every `every` seconds while
        timing goes on, and one when it ends."""
        out, todo = {}, []
        for g, co in shapes:
            a = self.cached(g, co, dtype, kernels, tuning)
            if a is None:
                todo.append((g, co))
            else:
                out[(g, co)] = a
        if not todo:
            return out
        if say is not None:
            where = f"cached in {self.path}" if self.path else "not cached"
            say(f"pydtnn: timing convolution algorithms for {len(todo)} layer shape{'s' * (len(todo) != 1)}, "
                f"first run only ({where})")
        timed, start = {}, time.monotonic()
        last = start
        for i, (g, co) in enumerate(todo, 1):
            algorithms = candidates(g, co, kernels, tuning)
            if len(algorithms) == 1:
                out[(g, co)] = algorithms[0]
            else:
                times = self.measure(g, co, algorithms, dtype, kernels, tuning, self.batch)
                out[(g, co)] = pick(times, algorithms[0], self.margin)
            timed[self.key(g, co, dtype, kernels)] = out[(g, co)]
            if say is not None and i < len(todo) and time.monotonic() - last >= every:
                last = time.monotonic()
                say(f"pydtnn: timed {i} of {len(todo)} layer shapes ({last - start:.0f} s)")
        if say is not None:
            say(f"pydtnn: timed {len(todo)} layer shape{'s' * (len(todo) != 1)} in {time.monotonic() - start:.1f} s")
        self.save(timed, say)
        return out

    def save(self, choices, say=None):
        """Add {key: algorithm} to the cache file (re-read first, so choices another run wrote stay)."""
        self.choices().update(choices)
        if self.path is None:
            return
        merged = {**self._stored(), **choices}
        text = json.dumps({"format": FORMAT, "choices": dict(sorted(merged.items()))}, indent=1)
        try:
            write_atomic(self.path, text.encode("utf-8"), make_folder=True)
        except ConfigError as e:  # a read-only home: the choices hold for this run
            if say is not None:
                say(f"pydtnn: convolution choices not cached: {e}")
