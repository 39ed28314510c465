"""Measured layer times: every distinct layer of some models timed on one process, forward and backward, at a
few batch sizes, which the performance model takes in place of its roofline where it has them.

    profile = measure(["resnet20_cifar10"], batches=(16, 64), threads=(1,))
    save(profile, "layers.json")          # a machine file's `layer_profile: layers.json` makes predict() use it
    profile.seconds(cost, threads=1)      # (forward_s, backward_s) of a costs.LayerCost, or None

A layer is known by its signature (costs.signature: its description, input and output shapes, algorithm,
whether it computes dx, dtype), so the same layer at another place, in another model, a pipeline stage or a
replica shares its times; a layer split over a model-parallel group has other shapes and keeps the roofline.
A batch between two measured ones is interpolated linearly (a layer's time is close to a + b x batch); one
outside them is extrapolated from the nearest two, never below half of the nearest one's time scaled by the
batch ratio.

Measured: each model built as pydtnn-perfmodel builds it (the design input, float32, the CPU backend's
algorithm thresholds, as pydtnn-train --conv_autotune false runs), its own forward and backward through
Model.set_tracer's spans (each leaf layer's call, its Python overhead included), `warmup` untimed then `steps`
timed steps per batch; a layer's time is the median over the steps, and a signature's the median over its
layers. Blocks' combining steps are not spanned and keep the roofline. The file is JSON (FORMAT).
"""

import dataclasses
import json
import os
import statistics

from pydtnn.errors import ConfigError

FORMAT = "pydtnn-layer-profile"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """layers[signature][threads][batch] = (forward_s, backward_s); about: where and how it was measured;
    path: the file it was read from (None where built here)."""

    layers: dict
    about: dict = dataclasses.field(default_factory=dict)
    path: str | None = None

    def seconds(self, cost, threads):
        """(forward_s, backward_s) of costs.LayerCost `cost` at `threads` threads, or None where this layer or
        thread count was not measured."""
        by_batch = self.layers.get(cost.signature, {}).get(threads)
        if not by_batch or cost.batch < 1:
            return None
        return interpolate(by_batch, cost.batch)

    def __len__(self):
        return len(self.layers)


def interpolate(by_batch, batch):
    """(forward_s, backward_s) at `batch` from {measured batch: (forward_s, backward_s)} (module docstring)."""
    if batch in by_batch:
        return tuple(by_batch[batch])
    sizes = sorted(by_batch)
    if len(sizes) == 1:
        return tuple(t * batch / sizes[0] for t in by_batch[sizes[0]])
    below = [b for b in sizes if b < batch]
    above = [b for b in sizes if b > batch]
    a, b = (below[-1], above[0]) if below and above else (sizes[:2] if not below else sizes[-2:])
    nearest = a if abs(batch - a) <= abs(batch - b) else b
    out = []
    for ta, tb, tn in zip(by_batch[a], by_batch[b], by_batch[nearest]):
        t = ta + (tb - ta) * (batch - a) / (b - a)
        out.append(max(t, 0.5 * tn * batch / nearest))
    return tuple(out)


def measure(models, batches, threads=(1,), steps=5, warmup=2, progress=None, into=None):
    """The LayerProfile of every leaf layer of `models` (registered names) at each of `batches` and `threads`;
    into: a LayerProfile whose entries the new ones join (replacing those measured again)."""
    from pydtnn import runtime
    from pydtnn.perfmodel.calibrate import cores, cpu_model
    from pydtnn.perfmodel.simulate import build_model

    progress = progress or (lambda line: None)
    layers = {k: {t: dict(v) for t, v in by_t.items()} for k, by_t in (into.layers if into else {}).items()}
    for name in models:
        built_name, model = build_model(name)
        for t in threads:
            runtime.configure(threads=t)
            for b in batches:
                for sig, times in _model_times(model, b, steps, warmup).items():
                    layers.setdefault(sig, {}).setdefault(t, {})[b] = times
                progress(f"{built_name}: batch {b}, {t} thread{'s' if t > 1 else ''}")
    about = dict(into.about) if into else {}
    about.update(cpu=cpu_model(), cores=cores(), steps=steps, warmup=warmup)
    about["models"] = sorted(set(about.get("models", [])) | set(models))
    return LayerProfile(layers, about)


def _model_times(model, batch, steps, warmup):
    """{signature: (forward_s, backward_s)} of `model`'s leaf layers over `steps` timed forward + backward steps
    of `batch` random samples."""
    import numpy as np

    from pydtnn.perfmodel.costs import layer_costs
    from pydtnn.profiling.tracer import Tracer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input_shape)).astype(np.float32)
    dy = rng.standard_normal((batch, *model.output_shape)).astype(np.float32) / batch
    spans = {}
    model.train()
    for step in range(warmup + steps):
        tracer = Tracer() if step >= warmup else None
        model.set_tracer(tracer)
        model.forward(x, training=True)
        model.backward(dy)
        for ev in tracer.events if tracer else ():
            spans.setdefault((ev["name"], ev["cat"]), []).append(ev["dur"] / 1e6)
    model.set_tracer(None)
    by_sig = {}
    for c in layer_costs(model, batch):
        fwd, bwd = spans.get((c.name, "forward")), spans.get((c.name, "backward"))
        if fwd and bwd:
            by_sig.setdefault(c.signature, []).append((statistics.median(fwd), statistics.median(bwd)))
    return {sig: tuple(statistics.median(t[k] for t in pairs) for k in (0, 1)) for sig, pairs in by_sig.items()}


def to_dict(profile):
    return {"format": FORMAT, "version": VERSION, "about": profile.about,
            "layers": {sig: {str(t): {str(b): list(v) for b, v in sorted(by_b.items())}
                             for t, by_b in sorted(by_t.items())} for sig, by_t in sorted(profile.layers.items())}}


def from_dict(data, source="layer profile"):
    """A LayerProfile from its JSON layout; anything else is one ConfigError naming `source`."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ConfigError(f"{source} is not a pydtnn layer profile; expected JSON with format {FORMAT!r}, version "
                          f"{VERSION} (pydtnn-perfmodel profile writes one)")
    layers = {}
    try:
        for sig, by_t in data["layers"].items():
            layers[str(sig)] = {int(t): {int(b): _pair(v) for b, v in by_b.items()} for t, by_b in by_t.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{source}: a bad entry ({e}); expected layers[signature][threads][batch] = "
                          "[forward_s, backward_s]") from None
    if any(t < 1 or b < 1 for by_t in layers.values() for t, by_b in by_t.items() for b in by_b):
        raise ConfigError(f"{source}: a thread count or batch below 1; expected positive integers")
    return LayerProfile(layers, dict(data.get("about") or {}))


def _pair(v):
    f, b = (float(x) for x in v)
    if not (f >= 0 and b >= 0):
        raise ValueError(f"times {v!r}")
    return f, b


def load(path):
    from pydtnn.files import read_bytes

    path = os.fspath(path)
    try:
        data = json.loads(read_bytes(path, "layer profile", limit=16 << 20).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"layer profile {path} does not exist; `pydtnn-perfmodel profile --out {path}` writes "
                          "one") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"layer profile {path} is not JSON: {e}") from None
    return dataclasses.replace(from_dict(data, f"layer profile {path}"), path=path)


def save(profile, path):
    """Write `profile` to `path` as JSON, whole or not at all (a temporary file renamed over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_dict(profile), f, indent=1)
    os.replace(tmp, path)
