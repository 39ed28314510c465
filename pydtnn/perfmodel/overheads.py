"""The fixed costs outside the arithmetic (Machine.overheads), read from pydtnn's own Trainer: traced steps
of tiny_model() at batch 1, where every layer's arithmetic takes well under a microsecond.

    fixed, detail = fixed_costs(quick=True)    # Overheads, {"layers", "parameters", "steps", ...}

calibrate.py's docstring says what each figure is and how predict.py uses it.
"""

import bisect
import statistics

import numpy as np

FIXED_WARM_UP, FIXED_STEPS = 30, 200  # trainer steps of tiny_model(): untimed, then timed (10 and 60 with quick)


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
    tracer = Tracer()
    trainer = Trainer(model, losses.create("categorical_cross_entropy"), optimizer, progress=False,
                      epoch_lines=False, tracer=tracer)
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
