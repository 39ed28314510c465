"""Activation recomputation: forward keeps only the inputs of a model's segments, and backward runs each
segment's forward again just before its backward, trading that second forward for the memory of the
activations.

    passes = Recompute(model, "segments")     # or "all"; passes(model, "none") is the model itself
    out = passes.forward(x, training=True)
    dx = passes.backward(dy)                  # the layers' grads as model.backward(dy) leaves them

The segments are runs of the model's units (Model.units: Sequentials opened up, blocks whole): about
sqrt(L) units each for "segments" (Chen et al. 2016), one unit each for "all". The last segment keeps
its state, since its backward comes first. The second forward computes what the first computed: the
backend's Generator is put back to its state before the first (dropout drawn from it), dropout drawn
from per-sample streams draws from the same streams again, BatchNorm normalizes by the same batch
statistics, and the running statistics, which the first forward updated, are put back after the
second. Gradient hooks (a data-parallel reducer's) and tracer spans fire as in a plain backward.
"""

import math

from pydtnn.errors import ConfigError

MODES = ("none", "segments", "all")


def passes(model, mode):
    """What a step runs forward and backward through: the model ("none") or a Recompute of it."""
    if mode not in MODES:
        raise ConfigError(f"--recompute {mode!r}: expected one of {', '.join(MODES)}")
    return model if mode == "none" else Recompute(model, mode)


def segments(n_units, mode):
    """Bounds [0, ..., n_units] of the segments: every unit ("all"), or runs of ceil(sqrt(n)) ("segments")."""
    size = 1 if mode == "all" else max(1, math.ceil(math.sqrt(n_units)))
    return list(range(0, n_units, size)) + [n_units]


class Recompute:
    """forward/backward of a Model that keep only its segments' inputs (module docstring)."""

    def __init__(self, model, mode="segments"):
        if mode not in MODES[1:]:
            raise ConfigError(f"--recompute {mode!r}: expected one of {', '.join(MODES)}")
        self.model, self.mode, self.backend = model, mode, model.backend
        units = [(parent, layer) for _, layer, parent in model.units()]
        bounds = segments(len(units), mode)
        self.segments = [units[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        self.layers = [[sub for _, unit in seg for _, sub in unit.named_layers()] for seg in self.segments]
        self.inputs = []  # per segment but the last: (its input, the Generator's state before it)

    def forward(self, x, training=True):
        if not training:
            return self.model.forward(x, training=False)
        x = x.astype(self.backend.dtype, copy=False)
        self.inputs = []
        last = len(self.segments) - 1
        for k, seg in enumerate(self.segments):
            if k == last:
                return self._run(seg, x)
            state = self.backend.rng.bit_generator.state
            before = [(layer, dict(layer.__dict__)) for layer in self.layers[k]]
            self.inputs.append((x, state))
            x = self._run(seg, x)
            for layer, kept in before:  # let go of what the segment's layers saved for backward
                layer.__dict__.clear()
                layer.__dict__.update(kept)
        return x

    __call__ = forward

    def backward(self, dy):
        dy = dy.astype(self.backend.dtype, copy=False)
        for k in reversed(range(len(self.segments))):
            seg = self.segments[k]
            if k < len(self.segments) - 1:
                self._again(k)
            for parent, unit in reversed(seg):
                dy = parent._backward_child(unit, dy)
        self.inputs = []
        return dy

    def _run(self, seg, x):
        for parent, unit in seg:
            x = parent._forward_child(unit, x, True)
        return x

    def _again(self, k):
        """Segment k's forward once more, as the first time: its layers then hold what backward needs."""
        x, state = self.inputs[k]
        self.inputs[k] = None
        rng = self.backend.rng.bit_generator
        now = rng.state
        kept = [(a, a.copy()) for layer in self.layers[k] for a in layer.buffers.values()]
        rng.state = state
        try:
            self._run(self.segments[k], x)
        finally:
            rng.state = now
            for a, copy in kept:  # the running statistics as the first forward left them
                a[...] = copy
