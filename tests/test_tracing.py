"""The Chrome-trace tracer: per-layer forward/backward spans and per-phase totals."""

import json
import os

import numpy as np
import pytest

from pydtnn import data, models
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD
from pydtnn.profiling import Tracer, trace_paths, written
from pydtnn.trainer import Trainer


def test_trace_has_every_layer_and_phase(tmp_path):
    train, _ = data.load("mnist5k")
    m = models.create("simplecnn")
    tracer = Tracer()
    t = Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.01), progress=False, tracer=tracer)
    m.set_tracer(tracer)
    t.fit(train, epochs=1, batch_size=16, steps_per_epoch=3)
    tracer.write(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    leaves = [p for p, layer in m.layers()]
    for phase in ("forward", "backward"):
        names = {e["name"] for e in spans if e["cat"] == phase and e["tid"] == 0}
        assert names == set(leaves), phase  # every layer, 3 times each
        assert sum(e["cat"] == phase and e["tid"] == 0 for e in spans) == 3 * len(leaves)
    for cat in ("data", "loss", "optimizer", "step"):
        assert sum(e["cat"] == cat for e in spans) == 3, cat
    assert all(e["dur"] >= 0 for e in spans)
    steps = sorted((e for e in spans if e["cat"] == "step"), key=lambda e: e["ts"])
    for e in spans:  # every span lies inside one of the steps
        if e["cat"] != "step":
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in steps)
    totals = tracer.totals()
    assert totals["step"] >= totals["forward"] / 2  # layer spans and model span both count as forward
    rows = table_rows(tracer.summary_table())
    assert "optimizer" in rows and "  layers (part of forward)" in rows and "  layers (part of backward)" in rows
    top = [share for label, (_, share) in rows.items() if not label.startswith(" ") and label != "total"]
    assert sum(top) == pytest.approx(100.0, abs=0.3)  # used to be 105.8%: the layers counted twice
    m.set_tracer(None)
    n = len(tracer.events)
    m.forward(np.zeros((1, 1, 28, 28), np.float32))
    assert len(tracer.events) == n  # off means off


def table_rows(table):
    """{label (indentation kept): (seconds, percent)} of summary_table's rows."""
    rows = {}
    for line in table.splitlines()[2:]:
        if line.startswith("communication"):
            continue
        label, sec, share = line[:34].rstrip(), float(line[34:44]), float(line[44:].rstrip("%"))
        rows[label] = (sec, share)
    return rows


def synthetic(tracer, steps):
    """Spans given in milliseconds: steps is a list of [(cat, begin, end, tid)] per step."""
    ms = 1_000_000
    for spans in steps:
        for cat, a, b, tid in spans:
            tracer.add(cat, cat, tracer.t0 + a * ms, tracer.t0 + b * ms, tid=tid)


def step_at(t, forward_ms):
    """One step starting at t ms: data 1 ms, forward (two layers), backward (a layer and a wait),
    an allreduce in flight on its own track, optimizer 1 ms, 1 ms untraced at the end (50 ms for f = 8)."""
    f = forward_ms
    return [("step", t, t + f + 42, 0), ("data", t, t + 1, 1),
            ("forward", t + 1, t + 1 + f, 1), ("forward", t + 1, t + 1 + f / 2, 0), ("forward", t + 1 + f / 2, t + f, 0),
            ("backward", t + 1 + f, t + 40 + f, 1), ("backward", t + 1 + f, t + 20 + f, 0), ("wait", t + 30 + f, t + 40 + f, 1),
            ("allreduce", t + 15 + f, t + 40 + f, 2), ("optimizer", t + 40 + f, t + 41 + f, 1)]


def test_summary_adds_up_to_the_step_time_and_nests_the_layers():
    tracer = Tracer()
    synthetic(tracer, [step_at(0, 1000), step_at(2000, 8), step_at(3000, 8)])  # a slow first step: compilation
    paths, counted, skipped = tracer.breakdown()
    assert (counted, skipped) == (2, 1)
    assert paths[()] == pytest.approx(2 * 0.050)  # the two later steps, 50 ms each
    assert paths[("forward",)] == pytest.approx(0.016) and paths[("forward", "forward")] == pytest.approx(0.014)
    assert paths[("backward", "backward")] == pytest.approx(0.038) and paths[("backward", "wait")] == pytest.approx(0.02)
    assert not any("allreduce" in p for p in paths)  # in flight beside the computation, not part of it
    table = tracer.summary_table()
    assert table.splitlines()[0].startswith("2 steps (the first excluded as warm-up), 50.0 ms per step")
    rows = table_rows(table)
    assert list(rows) == ["data", "forward", "  layers (part of forward)", "backward", "  layers (part of backward)",
                          "  wait (part of backward)", "optimizer", "untraced (between phases)", "total"]
    assert rows["forward"] == (0.016, 16.0) and rows["untraced (between phases)"] == (0.002, 2.0)
    assert rows["total"] == (0.1, 100.0)
    assert sum(share for label, (_, share) in rows.items() if not label.startswith(" ") and label != "total") == 100.0
    assert "communication 0.050 s in flight, 0.020 s waited for: 60% hidden" in table


def test_a_single_step_is_summarised_and_says_nothing_was_excluded():
    tracer = Tracer()
    synthetic(tracer, [step_at(0, 8)])
    assert tracer.summary_table().splitlines()[0].startswith("1 steps (none excluded as warm-up: only one)")
    assert Tracer().summary_table() == "no training step was traced"


def test_every_ranks_trace_file_is_named(tmp_path):
    assert trace_paths(tmp_path / "t.json", 1) == [str(tmp_path / "t.json")]
    every = trace_paths(tmp_path / "t.json", 3)
    assert every == [str(tmp_path / f"t.rank{r}.json") for r in range(3)]
    assert Tracer(pid=1).write(tmp_path / "t.json", 3) == every
    assert os.listdir(tmp_path) == ["t.rank1.json"]  # each rank writes its own file
    assert written(every) == f"traces written, one per rank (3): {', '.join(every)}"
    assert written(every[:1]) == f"trace written to {every[0]}"
    assert Tracer().write(tmp_path / "one.json") == [tmp_path / "one.json"]
