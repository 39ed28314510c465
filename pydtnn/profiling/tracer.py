"""Chrome-trace timeline of a run: forward/backward per layer, data loading, loss, optimizer step.

    tracer = Tracer()
    model.set_tracer(tracer); trainer.tracer = tracer
    ...
    tracer.write("trace.json")        # open in https://ui.perfetto.dev or chrome://tracing
    print(tracer.summary_table())     # seconds per category

Events are "complete" events (ph "X") with microsecond begin and duration. When tracing is off no
tracer exists and the only cost is one `is None` test per layer call.
"""

import json
import time
from collections import defaultdict
from contextlib import contextmanager


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

    def summary_table(self):
        """Seconds and share of the 'step' time per category, as a small text table."""
        totals = self.totals()
        step = totals.get("step", 0.0) or sum(totals.values()) or 1.0
        rows = [f"{'phase':<14}{'seconds':>10}{'% of steps':>12}"]
        for cat, sec in sorted(totals.items(), key=lambda kv: -kv[1]):
            rows.append(f"{cat:<14}{sec:>10.3f}{100 * sec / step:>11.1f}%")
        comm, exposed = totals.get("allreduce", 0.0), totals.get("wait", 0.0) + totals.get("blocking", 0.0)
        if comm > 0:
            hidden = max(comm - exposed, 0.0)
            rows.append(f"communication {comm:.3f} s in flight, {exposed:.3f} s waited for: "
                        f"{100 * hidden / comm:.0f}% hidden behind computation")
        return "\n".join(rows)

    def write(self, path):
        """Write the trace as Chrome JSON (atomically: a temporary file renamed into place)."""
        from pydtnn.checkpoint import write_atomic

        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": self.name}}]
        write_atomic(path, json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}).encode())
