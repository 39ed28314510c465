"""The Chrome-trace tracer: per-layer forward/backward spans and per-phase totals."""

import json

import numpy as np

from pydtnn import data, models
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD
from pydtnn.profiling import Tracer
from pydtnn.trainer import Trainer


def test_trace_has_every_layer_and_phase(tmp_path):
    train, _ = data.load("mnist5k")
    m = models.create("simplecnn")
    t = Trainer(m, SoftmaxCrossEntropy(), SGD(m.parameters(), lr=0.01), progress=False)
    tracer = Tracer()
    m.set_tracer(tracer)
    t.tracer = tracer
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
    assert "optimizer" in tracer.summary_table()
    m.set_tracer(None)
    n = len(tracer.events)
    m.forward(np.zeros((1, 1, 28, 28), np.float32))
    assert len(tracer.events) == n  # off means off
