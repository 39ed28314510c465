"""Measured layer times: every distinct layer of some models timed on one process, forward and backward, at a
few batch sizes, which the performance model takes in place of its roofline where it has them.

    profile = layer_timing.measure(["resnet20_cifar10"], batches=(16, 64), threads=(1,))
    save(profile, "layers.json")          # a machine file's `layer_profile: layers.json` makes predict() use it
    profile.seconds(cost, threads=1)      # (forward_s, backward_s) of a costs.LayerCost, or None

A layer is known by its signature (costs.signature: its description, input and output shapes, parameters,
algorithm, whether it computes dx, dtype), so the same layer at another place, in another model, a pipeline
stage or a replica shares its times; a layer split over a model-parallel group has other shapes and keeps the
roofline, scaled by its kind's ratio of measured to roofline time in the whole model (step_parts.profile_scales).
A batch between two measured ones is interpolated linearly (a layer's time is close to a + b x batch); one
outside them is extrapolated from the nearest two, never below half of the nearest one's time scaled by the
batch ratio.

Measured (layer_timing.py): each model built as pydtnn-perfmodel builds it (the design input, float32, the CPU
backend's algorithm thresholds, as pydtnn-train --conv_autotune false runs), its own forward and backward through
Model.set_tracer's spans (each leaf layer's call, its Python overhead included), `warmup` untimed then `steps`
timed steps per batch; a layer's time is the median over the steps, and a signature's the median over its
layers. Blocks' combining steps are not spanned and keep the roofline. The file is JSON (FORMAT). This module
imports nothing of the package but errors and files, so that machine.py can hold a LayerProfile.
"""

import dataclasses
import json
import math
import os

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
    about = data.get("about") or {}
    if not isinstance(about, dict):
        raise ConfigError(f"{source}: about = {about!r}; expected a mapping (where and how it was measured)")
    return LayerProfile(layers, dict(about))


def _pair(v):
    f, b = (float(x) for x in v)
    if not (math.isfinite(f) and math.isfinite(b) and f >= 0 and b >= 0):
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
    """Write `profile` to `path` as JSON, whole or not at all (files.write_atomic)."""
    from pydtnn.files import write_atomic

    write_atomic(path, (json.dumps(to_dict(profile), indent=1) + "\n").encode("utf-8"))
