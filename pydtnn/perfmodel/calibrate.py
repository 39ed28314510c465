"""Measure a Machine on the machine at hand: `pydtnn-perfmodel calibrate --out machine.yaml`.

    machine, report = calibrate(threads=(1, 2), np_=2, level="intra", base=DEFAULT, quick=False)
    lines = summary(machine, report, base_name="the built-in defaults")   # what the command prints

This module puts the Machine together; kernel_timing.py times the layers (rates, thread scaling, memory
and reduction bandwidths), overheads.py the fixed costs, and mpi_links.py runs mpi_probe.py under
mpiexec and fits the links on its times.

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

import dataclasses
import importlib.util
import os
import statistics
import sys

from pydtnn.errors import PydtnnError
from pydtnn.perfmodel.kernel_timing import (
    STREAM_REPEATS,
    Probe,
    class_rates,
    kernel_timings,
    memory_bandwidth,
    reduce_rate,
    shapes,
    small_shapes,
    thread_fit,
)
from pydtnn.perfmodel.machine import KERNEL_CLASSES, LEVELS, Link, Machine
from pydtnn.perfmodel.mpi_links import (
    BURST_S,
    FIT_ALGORITHM,
    MPI_TIMEOUT_S,
    burst_work,
    collective_links,
    fit_alpha_beta,
    mpiexec_path,
    run_mpi_probe,
)
from pydtnn.perfmodel.overheads import fixed_costs

# -- the machine ----------------------------------------------------------------------------------------


def cpu_model():
    """The CPU model named in /proc/cpuinfo (isa.cpu_features, the one reading of it), or None."""
    from pydtnn.backends.cpu.isa import cpu_features

    model = cpu_features()[0]
    return None if model == "unknown" else model


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def mpi_missing():
    """Why the probe cannot run here (one sentence), or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py mpich)"
    if mpiexec_path() is None:
        return f"no mpiexec next to {sys.executable} or on PATH (pip install mpich)"
    return None


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
              mpi_timeout=MPI_TIMEOUT_S, progress=None, probe=None):
    """(Machine, Report) measured here; see the module docstring. base: the Machine whose unmeasured
    fields are kept (default machine.DEFAULT); mpi=False keeps the base's links; probe: the MPI probe's result
    (mpi_probe.measure) where a running job measured it over its own processes, in place of an mpiexec of the
    probe (the oversubscribed collective's cost is then the base's)."""
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
    links, processes_per_node, probe, crowded = _measure_network(np_, level, base, quick, mpi, mpi_timeout, progress,
                                                                 probe)

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
                      thread_scaling_by_class=by_class, thread_serial_s=serial, overheads=fixed,
                      layer_profile=base.layer_profile)
    return machine, Report(timings, rates, probe, level, bandwidth, gamma_rate, fixed_detail, crowded, small_timings)


def _measure_network(np_, level, base, quick, mpi, mpi_timeout, progress, given=None):
    """(links, processes per node, the probe's report or None, the oversubscribed probe's or None): the MPI
    ping-pong's alpha-beta link at `level`, and with level intra the cost of a collective among more ranks
    than cores. mpi=False keeps the base's links; `given`: the probe's result measured already (nothing
    launched, the oversubscribed cost left to the base)."""
    links, processes_per_node, probe, crowded = dict(base.links), base.processes_per_node, None, None
    if not mpi:
        return links, processes_per_node, probe, crowded
    if given is None:
        progress(f"MPI probe: mpiexec -n {np_} ({level} link)")
    probe = given if given is not None else run_mpi_probe(np_, quick=quick, timeout=mpi_timeout)
    sizes, seconds = zip(*probe["pingpong"])
    try:
        alpha, beta = fit_alpha_beta(sizes, seconds)
    except ValueError as e:
        raise PydtnnError(f"the MPI probe's ping-pong times give no {level} link: {e}") from None
    links[level] = Link(latency_s=alpha, bandwidth_bytes_per_s=1.0 / beta, background=base.links[level].background)
    progress(f"{level} link: latency {alpha * 1e6:.2f} us, bandwidth {1 / beta / 1e9:.3f} GB/s")
    if level != "intra" or given is not None:
        return links, processes_per_node if given is None else np_, probe, crowded
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
