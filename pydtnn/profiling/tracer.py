"""Chrome-trace timeline of a run: forward/backward per layer, data loading, loss, optimizer step.

    tracer = Tracer()
    trainer = Trainer(model, loss, optimizer, tracer=tracer); model.set_tracer(tracer)
    ...
    tracer.write("trace.json")        # open in https://ui.perfetto.dev or chrome://tracing
    print(tracer.summary_table())     # share of the step time per phase, warm-up excluded

Events are "complete" events (ph "X") with microsecond begin and duration. When tracing is off no
tracer exists and the only cost is one `is None` test per layer call.
"""

import bisect
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager

# Categories of spans that run beside the computation on their own track (an allreduce, ZeRO stage 2's
# non-blocking reduce-scatter of a bucket, in flight while backward goes on, or stage 3's gather of a layer's
# parameters, started while the layer before computes): never nested in a phase, summed apart as communication.
# A model-parallel group's blocking reduce_scatter is not one of them.
CONCURRENT = ("allreduce", "ireduce_scatter", "iallgather")
_ORDER = ("data", "forward", "loss", "backward", "reduce", "optimizer")


def _phase_order(path):
    """Top-level rows in the order a step runs them, others after."""
    return (_ORDER.index(path[0]) if path[0] in _ORDER else len(_ORDER), path[0])


def _contains(outer, inner, slack=1e-3):
    """Whether span `inner` lies within span `outer` (times in microseconds; slack for rounding)."""
    return outer["ts"] - slack <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack


class Tracer:
    """Collects timed spans; pid tells ranks apart in a merged view."""

    def __init__(self, pid=0, name="pydtnn"):
        self.pid, self.name = pid, name
        self.t0 = time.perf_counter_ns()
        self.events = []

    def add(self, name, cat, start_ns, end_ns, tid=0, **args):
        """Record a span measured elsewhere (e.g. an allreduce's start and end)."""
        ev = {"name": name, "cat": cat, "ph": "X", "pid": self.pid, "tid": tid,
              "ts": (start_ns - self.t0) / 1e3, "dur": (end_ns - start_ns) / 1e3}
        if args:
            ev["args"] = args
        self.events.append(ev)

    @contextmanager
    def span(self, name, cat, tid=0, **args):
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter_ns(), tid, **args)

    def totals(self):
        """{category: seconds} summed over all spans; nested categories count separately."""
        out = defaultdict(float)
        for ev in self.events:
            out[ev["cat"]] += ev["dur"] / 1e6
        return dict(out)

    def breakdown(self, warmup=1):
        """Where the steps' time went: ({path: seconds}, steps counted, steps left out as warm-up).

        A path is the categories from a top-level span of a step down to a span nested in it:
        ("forward",) is the model's forward phase, ("forward", "forward") the layers' spans inside
        it, ("backward", "wait") a wait for a reduction during backward. Spans of CONCURRENT categories
        (allreduces in flight, on their own track) run beside the others and are left out. The first
        `warmup` steps (compilation, first-touch allocation) are left out when later steps exist.
        """
        steps = sorted((e for e in self.events if e["cat"] == "step"), key=lambda e: e["ts"])
        skip = warmup if len(steps) > warmup else 0
        starts = [e["ts"] for e in steps]
        inside = defaultdict(list)  # step index -> its spans
        for ev in self.events:
            if ev["cat"] == "step" or ev["cat"] in CONCURRENT:
                continue
            i = bisect.bisect_right(starts, ev["ts"]) - 1
            if i >= skip and _contains(steps[i], ev):
                inside[i].append(ev)
        out = defaultdict(float)
        for spans in inside.values():
            stack = []  # (span, path) of the spans that enclose the current one
            for ev in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
                while stack and not _contains(stack[-1][0], ev):
                    stack.pop()
                path = (stack[-1][1] if stack else ()) + (ev["cat"],)
                out[path] += ev["dur"] / 1e6
                stack.append((ev, path))
        out[()] = sum(e["dur"] for e in steps[skip:]) / 1e6  # the steps themselves
        return dict(out), len(steps) - skip, skip

    def summary_table(self, warmup=1):
        """Share of the step time per phase, nested phases indented under the one they are part of.

        The top-level rows and 'untraced' add up to 100% of the steps' time (the first `warmup` steps
        excluded, as the heading says); an indented row is part of the row above it, not more time.
        """
        paths, counted, skipped = self.breakdown(warmup)
        step = paths.pop((), 0.0)
        if not counted or step <= 0:
            return "no training step was traced"
        excluded = ("none excluded as warm-up: only one" if not skipped else
                    f"the first {'' if skipped == 1 else f'{skipped} '}excluded as warm-up")
        rows = [f"{counted} steps ({excluded}), {1e3 * step / counted:.1f} ms per step on average; "
                "indented rows are part of the row above them",
                f"{'phase':<34}{'seconds':>10}{'% of steps':>12}"]

        def row(label, sec, depth):
            rows.append(f"{'  ' * depth + label:<34}{sec:>10.3f}{100 * sec / step:>11.1f}%")

        def children(parent):
            found = [p for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent]
            for p in sorted(found, key=lambda q: -paths[q]):
                # a span of its parent's category is a finer record of it: the layers of forward/backward
                label = "layers" if p[-1] == p[-2] else p[-1]
                row(f"{label} (part of {p[-2]})", paths[p], len(p) - 1)
                children(p)

        top = sum(sec for p, sec in paths.items() if len(p) == 1)
        for p in sorted((p for p in paths if len(p) == 1), key=_phase_order):
            row(p[0], paths[p], 0)
            children(p)
        row("untraced (between phases)", max(step - top, 0.0), 0)
        row("total", step, 0)
        comm = self._in_flight(skipped)
        exposed = sum(sec for p, sec in paths.items() if p[-1] in ("wait", "blocking"))
        if comm > 0:
            hidden = max(comm - exposed, 0.0)
            rows.append(f"communication {comm:.3f} s in flight, {exposed:.3f} s waited for: "
                        f"{100 * hidden / comm:.0f}% hidden behind computation")
        return "\n".join(rows)

    def _in_flight(self, skipped):
        """Seconds of CONCURRENT spans that start after the first `skipped` steps."""
        steps = sorted((e for e in self.events if e["cat"] == "step"), key=lambda e: e["ts"])
        after = steps[skipped]["ts"] if steps[skipped:] else float("inf")
        return sum(e["dur"] for e in self.events if e["cat"] in CONCURRENT and e["ts"] >= after) / 1e6

    def write(self, path, world_size=None):
        """Write this rank's trace as Chrome JSON (atomically: a temporary file renamed into place).

        world_size None: to `path`. Else `path` names the run's traces and this rank (pid) writes its
        own, trace_paths(path, world_size)[pid]. Returns every rank's file, so that rank 0 can name them.
        """
        from pydtnn.files import write_atomic

        paths = [path] if world_size is None else trace_paths(path, world_size)
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": self.name}}]
        # ts: microseconds from t0_ns on the machine's monotonic clock (perf_counter_ns), which every process
        # of a machine shares: the ranks' traces line up by it
        data = json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                           "otherData": {"clock": "perf_counter_ns", "t0_ns": self.t0}}).encode()
        write_atomic(paths[0 if world_size is None else self.pid], data, make_folder=True)
        return paths


def trace_paths(path, world_size):
    """Every rank's trace file: `path` itself for one process, else path's stem + .rankR.json per rank."""
    if world_size == 1:
        return [str(path)]
    stem = os.path.splitext(str(path))[0]
    return [f"{stem}.rank{r}.json" for r in range(world_size)]


def written(paths):
    """'trace written to P', or for several ranks every file: 'traces written, one per rank: P0, P1'."""
    if len(paths) == 1:
        return f"trace written to {paths[0]}"
    shown = ", ".join(paths) if len(paths) <= 8 else f"{paths[0]}, {paths[1]}, ..., {paths[-1]}"
    return f"traces written, one per rank ({len(paths)}): {shown}"
