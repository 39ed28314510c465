"""The performance model swept along the five axes of Castelló et al. (PDP 2021): batch size per process,
node arithmetic rate, node memory bandwidth, link bandwidth and number of nodes, one axis at a time with
the others held at a baseline.

    points = sweep(model, "vgg16_imagenet", machine.DEFAULT, Baseline(nodes=64, batch_size=32))
    crossovers(points)           # {axis: [values where exposed communication passes half the step]}
    plot(points, "docs/perfmodel_vgg16_imagenet.png", machine.DEFAULT, Baseline(64, 32))

What each axis varies (everything else is the baseline: its nodes, its batch, the machine as described):
  batch      samples per process and step (8 .. 256)
  rate       every kernel class's FLOP rate times a factor (x0.25 .. x16)
  bandwidth  memory bandwidth and the reduction rate (adding two buffers is a memory-bound pass) times
             a factor (x0.25 .. x16)
  link       the inter-node link's bandwidth (100 Mbit/s .. 400 Gbit/s); its latency and the intra-node link
             are the machine's
  nodes      1 .. 1024 nodes (powers of two) of processes_per_node processes each
Each axis's grid holds the baseline's own value, so that one point per axis is the baseline itself.

Throughput is samples per second over all processes: batch_size * processes / step_s. Every point is
the prediction of one run plan (pydtnn.plan.RunPlan, predict.predict_plan, as pydtnn-train --simulate
predicts a run) on the model built once; each recomputes the layers' costs, which takes milliseconds, so
no cache is kept.

Schemes, compared on the same processes and the same global batch (batch_size x processes):
  data    every process a replica with batch_size samples;
  model   every layer split over all the processes, one replica with the whole global batch;
  hybrid  every layer split over the processes of a node (processes_per_node), one replica per node with
          batch_size x processes_per_node samples, data parallel across nodes;
  pipeline  the layers cut into a stage per process of a node (at least 2), one pipeline per node with
          batch_size x processes_per_node samples in micro_batches micro-batches (1F1B), data parallel across
          nodes.
Every scheme takes micro_batches and recompute alike (the pipeline's micro-batches are its own).
Model parallelism cannot split a layer over more processes than it has output channels (the trainer
refuses it): such points are left out, and summary() says from how many processes on.
"""

import dataclasses
import io
import itertools
import math

from pydtnn.errors import ConfigError
from pydtnn.perfmodel.predict import predict_plan
from pydtnn.plan import Reduction, RunPlan, layout

SCHEMES = ("data", "model", "hybrid", "pipeline")
SCHEME_LABELS = {"data": "data parallelism", "model": "model parallelism",
                 "hybrid": "hybrid (model in a node, data across)", "pipeline": "pipeline (stages in a node, data across)"}
SCHEME_COLORS = {"data": "tab:blue", "model": "tab:orange", "hybrid": "tab:green", "pipeline": "tab:purple"}
AXES = ("batch", "rate", "bandwidth", "link", "nodes")
AXIS_LABELS = {"batch": "batch size per process", "rate": "node arithmetic rate (x machine's)",
               "bandwidth": "node memory bandwidth (x machine's)", "link": "inter-node link bandwidth (bit/s)",
               "nodes": "nodes"}
FACTORS = tuple(2.0 ** (k / 2) for k in range(-4, 9))  # x0.25 .. x16 in steps of sqrt(2)
GRIDS = {
    "batch": (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
    "rate": FACTORS,
    "bandwidth": FACTORS,
    "link": tuple(bits / 8 for bits in (1e8, 2e8, 5e8, 1e9, 2e9, 5e9, 1e10, 2.5e10, 4e10, 1e11, 2e11, 4e11)),  # bytes/s
    "nodes": tuple(2**k for k in range(11)),
}
HALF = 0.5  # the exposed-communication share of the step that counts as "communication takes over"
SHARES = (0.25, HALF)  # the shares summary() names crossings of


@dataclasses.dataclass(frozen=True)
class Baseline:
    """Where the axes not swept are held: nodes of machine.processes_per_node processes each, batch_size
    samples per process; rates, memory bandwidth and links are the machine's."""

    nodes: int = 64
    batch_size: int = 32

    def __post_init__(self):
        for what, value in (("nodes", self.nodes), ("batch_size", self.batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"sweep baseline {what}={value!r}; expected a positive integer")


@dataclasses.dataclass(frozen=True)
class Point:
    """One predicted step: the axis swept and its value (in the axis's unit: samples, a factor, bytes/s,
    nodes), the configuration it stands for, and the prediction's split in seconds."""

    model: str
    scheme: str
    axis: str
    value: float
    nodes: int
    processes: int
    batch_size: int
    rate_factor: float
    bandwidth_factor: float
    link_bytes_per_s: float
    step_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    exposed_comm_s: float

    @property
    def throughput(self):
        """Samples per second over all processes."""
        return self.batch_size * self.processes / self.step_s

    @property
    def exposed_share(self):
        """The part of the step spent in communication that nothing hides."""
        return self.exposed_comm_s / self.step_s

    def to_dict(self):
        return {**dataclasses.asdict(self), "throughput": self.throughput, "exposed_share": self.exposed_share}


def check_axes(axes):
    """`axes` as a tuple, each one of AXES (ConfigError naming the first that is not)."""
    from pydtnn.suggest import did_you_mean

    axes = tuple(axes)
    for a in axes:
        if a not in AXES:
            raise ConfigError(f"unknown sweep axis {a!r}{did_you_mean(a, AXES) or ';'} expected some of "
                              f"{', '.join(AXES)}")
    if not axes:
        raise ConfigError(f"no sweep axis given; expected some of {', '.join(AXES)}")
    return axes


def baseline_value(axis, machine, baseline):
    """The baseline's value on `axis`, in the axis's unit."""
    return {"batch": baseline.batch_size, "rate": 1.0, "bandwidth": 1.0,
            "link": machine.link("inter").bandwidth_bytes_per_s, "nodes": baseline.nodes}[axis]


def axis_values(axis, machine, baseline, points=None):
    """The values swept on `axis`, ascending: its grid with the baseline's value added; points: at most
    that many, spread evenly over the grid, the baseline's value always kept."""
    base = baseline_value(axis, machine, baseline)
    values = sorted(set(GRIDS[axis]) | {base})
    if points is not None and points < len(values):
        if points < 2:
            raise ConfigError(f"points={points!r}; expected at least 2 per axis")
        picked = {values[round(i * (len(values) - 1) / (points - 1))] for i in range(points)}
        if base not in picked:  # the baseline replaces the pick nearest to it
            picked.remove(min(picked - {values[0], values[-1]} or picked, key=lambda v: abs(math.log(v / base))))
            picked.add(base)
        values = sorted(picked)
    return values


def setting(axis, value, machine, baseline):
    """(machine, nodes, batch_size) of the point at `value` on `axis`; the machine itself where the axis
    leaves it as it is (the baseline value), so that point is exactly the baseline's prediction."""
    nodes, batch = baseline.nodes, baseline.batch_size
    if axis == "batch":
        batch = int(value)
    elif axis == "nodes":
        nodes = int(value)
    elif axis == "rate" and value != 1.0:
        machine = dataclasses.replace(machine, rates={k: r * value for k, r in machine.rates.items()})
    elif axis == "bandwidth" and value != 1.0:
        machine = dataclasses.replace(machine, memory_bandwidth=machine.memory_bandwidth * value,
                                      reduce_rate=machine.reduce_rate * value)
    elif axis == "link" and value != machine.link("inter").bandwidth_bytes_per_s:
        machine = machine.with_link("inter", bandwidth=value)
    return machine, nodes, batch


def sweep(model, name, machine, baseline, axes=AXES, reduction="bucketed", algorithm="ring", progress="test",
          points=None, on_point=None, density=None, micro_batches=1, recompute="none", pipeline_micro_batches=8,
          zero=0, rank=None, every=None):
    """[Point] of `model` (built once, on a CPU backend) for every scheme and every value of every axis.
    reduction, algorithm, progress, density (topk, oktopk), rank (powersgd), every (local_sgd), micro_batches, recompute,
    zero (ZeRO's stage over the replicas):
    each point's plan's (predict.predict_plan; pipeline_micro_batches: the pipeline scheme's); on_point: called
    once per point computed. A machine's layer profile is set aside (the roofline throughout), since measured
    layers would not follow the rate and bandwidth axes."""
    points_out = []
    machine = dataclasses.replace(machine, layer_profile=None)
    for scheme in SCHEMES:
        for axis in check_axes(axes):
            for value in axis_values(axis, machine, baseline, points):
                m, nodes, batch = setting(axis, value, machine, baseline)
                np_ = nodes * m.processes_per_node
                p = scheme_step(model, name, scheme, batch, np_, m, reduction=reduction, algorithm=algorithm,
                                progress=progress, density=density, recompute=recompute, zero=zero, rank=rank,
                                every=every,
                                micro_batches=pipeline_micro_batches if scheme == "pipeline" else micro_batches)
                if on_point is not None:
                    on_point()
                if p is None:
                    continue
                points_out.append(Point(
                    model=name, scheme=scheme, axis=axis, value=value, nodes=nodes, processes=np_, batch_size=batch,
                    rate_factor=value if axis == "rate" else 1.0,
                    bandwidth_factor=value if axis == "bandwidth" else 1.0,
                    link_bytes_per_s=m.link("inter").bandwidth_bytes_per_s, step_s=p.step_s, compute_s=p.compute_s,
                    memory_s=p.memory_s, comm_s=p.comm_s, exposed_comm_s=p.exposed_comm_s))
    return points_out


def scheme_step(model, name, scheme, batch, np_, machine, reduction="bucketed", algorithm="ring", progress="test",
                density=None, micro_batches=1, recompute="none", zero=0, rank=None, every=None):
    """The prediction of one scheme's run plan at `batch` samples per process over np_ processes (the same global
    batch for every scheme; predict.predict_plan); None where the scheme cannot run (a layer with fewer
    channels than its group, a pipeline of fewer than 2 stages or more stages than layers, fewer samples than
    micro-batches)."""
    group = 1 if scheme == "data" else np_ if scheme == "model" else min(machine.processes_per_node, np_)
    if scheme == "pipeline":
        if group < 2 or batch * group < micro_batches:
            return None
        lay = layout("hybrid" if np_ > group else "pipeline", np_, pipeline_stages=group)
    else:
        lay = layout("data" if group == 1 else "hybrid", np_, group if group > 1 else None)
    own = {"density": density, "rank": rank, "every": every}
    plan = RunPlan(lay, batch * group, None, Reduction(reduction, "none", progress, own),
                   accumulation_steps=min(micro_batches, batch * group), zero=zero)
    try:
        return predict_plan(model, plan, machine, algorithm=algorithm, name=name, recompute=recompute)
    except ConfigError as e:
        if "fewer than the" in str(e) or "more than the model's" in str(e):
            return None
        raise


def count(machine, baseline, axes=AXES, points=None):
    """How many points sweep() computes per model."""
    return len(SCHEMES) * sum(len(axis_values(a, machine, baseline, points)) for a in check_axes(axes))


def crossovers(points, share=HALF):
    """{(scheme, axis): [values where the exposed-communication share of the step crosses `share`]},
    each read by linear interpolation of the share against log(value) between two neighbouring points."""
    found = {}
    for key in dict.fromkeys((p.scheme, p.axis) for p in points):
        line = sorted((p for p in points if (p.scheme, p.axis) == key), key=lambda p: p.value)
        found[key] = []
        for a, b in itertools.pairwise(line):
            da, db = a.exposed_share - share, b.exposed_share - share
            if da == 0:
                found[key].append(a.value)
            elif da * db < 0:
                t = da / (da - db)
                found[key].append(math.exp(math.log(a.value) + t * (math.log(b.value) - math.log(a.value))))
        if line and line[-1].exposed_share == share and len(line) > 1:
            found[key].append(line[-1].value)
    return found


def show(axis, value):
    """A value on `axis` as a reader writes it: 32, x0.25, 10 Gbit/s, 64 nodes."""
    if axis in ("rate", "bandwidth"):
        return f"x{value:.3g}"
    if axis == "link":
        bits = 8 * value
        return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    if axis == "nodes":
        return f"{value:.4g} node{'s' if value != 1 else ''}"
    return f"{value:.4g}"


def summary(points, shares=SHARES):
    """One line per model, scheme and axis: where exposed communication passes each of `shares` of the
    step, and its share at both ends of the axis."""
    lines = []
    for name in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == name]
        found = {share: crossovers(mine, share) for share in shares}
        for scheme, axis in dict.fromkeys((p.scheme, p.axis) for p in mine):
            line = sorted((p for p in mine if (p.scheme, p.axis) == (scheme, axis)), key=lambda p: p.value)
            lo, hi = line[0], line[-1]
            where = "; ".join(f"{share:.0%} at {', '.join(show(axis, v) for v in found[share][scheme, axis]) or 'none'}"
                              for share in shares)
            lines.append(f"{name} {SCHEME_LABELS[scheme]}, {axis}: exposed communication passes {where} "
                         f"({show(axis, lo.value)}: {lo.exposed_share:.0%} .. {show(axis, hi.value)}: "
                         f"{hi.exposed_share:.0%})")
        for scheme in SCHEMES[1:]:
            for axis, (values, ratios, missing) in scheme_crossings(mine, scheme).items():
                if not ratios:
                    lines.append(f"{name} {SCHEME_LABELS[scheme]} against data parallelism, {axis}: cannot run at any "
                                 f"point (a layer has fewer channels than processes)")
                    continue
                where = f"they cross at {', '.join(show(axis, v) for v in values)}" if values else "they do not cross"
                lines.append(f"{name} {SCHEME_LABELS[scheme]} against data parallelism, {axis}: throughput ratio "
                             f"{ratios[0][1]:.2f}x at {show(axis, ratios[0][0])} .. {ratios[-1][1]:.2f}x at "
                             f"{show(axis, ratios[-1][0])}; {where}"
                             + (f"; cannot run at {', '.join(show(axis, v) for v in missing)}" if missing else ""))
    return lines


def scheme_crossings(points, scheme, versus="data"):
    """{axis: (values where `scheme`'s throughput crosses `versus`'s, [(value, throughput ratio)], values where
    `scheme` cannot run)}, each crossing read by linear interpolation of log(ratio) against log(value)."""
    out = {}
    for axis in dict.fromkeys(p.axis for p in points):
        base = {p.value: p for p in points if (p.scheme, p.axis) == (versus, axis)}
        mine = {p.value: p for p in points if (p.scheme, p.axis) == (scheme, axis)}
        ratios = [(v, mine[v].throughput / base[v].throughput) for v in sorted(base) if v in mine]
        missing = [v for v in sorted(base) if v not in mine]
        found = []
        for (va, ra), (vb, rb) in itertools.pairwise(ratios):
            la, lb = math.log(ra), math.log(rb)
            if la == 0:
                found.append(va)
            elif la * lb < 0:
                t = la / (la - lb)
                found.append(math.exp(math.log(va) + t * (math.log(vb) - math.log(va))))
        out[axis] = (found, ratios, missing)
    return out


def figure(points, machine, baseline, reduction="bucketed", algorithm="ring", progress="test"):
    """A matplotlib Figure of one model's points: one column per axis, throughput on top, the exposed
    communication's share of the step below; the baseline marked on every axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axes = list(dict.fromkeys(p.axis for p in points))
    name = points[0].model
    fig = Figure(figsize=(max(4.2 * len(axes), 9.0), 8.0), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(2, len(axes), squeeze=False)
    for col, axis in enumerate(axes):
        top, bottom = grid[0][col], grid[1][col]
        for scheme in SCHEMES:
            line = sorted((p for p in points if (p.scheme, p.axis) == (scheme, axis)), key=lambda p: p.value)
            if not line:
                continue
            x = [8 * p.value if axis == "link" else p.value for p in line]
            style = {"ms": 3, "color": SCHEME_COLORS[scheme], "label": SCHEME_LABELS[scheme]}
            top.plot(x, [p.throughput for p in line], "-o", **style)
            bottom.plot(x, [p.exposed_share for p in line], "-o", **style)
        base = baseline_value(axis, machine, baseline) * (8 if axis == "link" else 1)
        for ax in (top, bottom):
            ax.set_xscale("log", base=10 if axis == "link" else 2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _, axis=axis: _tick(axis, v)))
            ax.axvline(base, color="gray", lw=1, ls=":")
            ax.grid(alpha=0.3)
        ys = [p.throughput for p in points if p.axis == axis]
        if max(ys) > 10 * min(ys):  # a wide range reads best on a log scale, a narrow one on a linear scale
            top.set_yscale("log")
            top.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            top.yaxis.set_minor_formatter(NullFormatter())
        top.set_title(f"{axis} (baseline {show(axis, baseline_value(axis, machine, baseline))})", fontsize=10)
        bottom.axhline(HALF, color="firebrick", lw=1, ls="--")
        bottom.set_ylim(0, 1)
        bottom.set_xlabel(AXIS_LABELS[axis])
        if col == 0:
            top.set_ylabel("training throughput (samples/s, all processes)")
            bottom.set_ylabel("exposed communication / step")
    present = [s for s in SCHEMES if any(p.scheme == s for p in points)]
    handles = [Line2D([], [], color=SCHEME_COLORS[s], marker="o", ms=3, label=SCHEME_LABELS[s]) for s in present]
    if "model" in present:
        handles.append(Line2D([], [], color="none", label="(model parallelism: only where no layer has fewer "
                                                          "channels than processes)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    schemes = ", ".join(SCHEME_LABELS[s] for s in SCHEMES)
    fig.suptitle(f"{name}: predicted training throughput, {schemes}; the same global batch\n"
                 f"baseline: {baseline.nodes} nodes x {machine.processes_per_node} processes, batch "
                 f"{baseline.batch_size} per process, {reduction} reduction, {algorithm} allreduce, MPI progress "
                 f"{progress}\nrates, memory bandwidth and links of {machine.name}", fontsize=10)
    return fig


def _tick(axis, value):
    """A tick label on `axis` (the link axis is drawn in bit/s)."""
    if axis == "link":
        for scale, unit in ((1e9, "G"), (1e6, "M")):
            if value >= scale:
                return f"{value / scale:g}{unit}"
        return f"{value:g}"
    return f"x{value:g}" if axis in ("rate", "bandwidth") else f"{value:g}"


def plot(points, path, machine, baseline, **options):
    """Write figure(points, ...) as a PNG at `path`, atomically. Returns path."""
    from pydtnn.files import write_atomic

    buffer = io.BytesIO()
    figure(points, machine, baseline, **options).savefig(buffer, format="png", dpi=100)
    write_atomic(path, buffer.getvalue())
    return path
