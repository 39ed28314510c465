"""The Optimizer contract: update parameters in place from their gradients, state keyed by name.

    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)   # [(name, param, grad)], live arrays
    model.backward(dy); opt.step()                       # one update from the current grads
    opt.lr = 0.01                                        # schedules change lr between steps
    opt.state_dict()  # {"arrays": {"0.weight.momentum_buffer": ...}, "scalars": {"step": 1, "lr": ...}}

Per-parameter state arrays ("slots") are created at construction, in the parameter's dtype and on
its device. The update math is the backend's (backends/base.py: sgd_update, adam_update), so a backend
with compiled or CUDA kernels runs its own; pass the model's backend (optim.create(..., backend=)), else
one is chosen from the parameters' array type. A step allocates no arrays: temporaries are views into one scratch buffer per dtype,
made once. Grads are read, never written, so a reducer or a logger can still look at them.
"""

import math

from pydtnn.backends import array_module, backend_for
from pydtnn.errors import ConfigError

_SCRATCH = 2  # temporaries one parameter's update may need at once


class Optimizer:
    """Base class: holds (name, param, grad) triples, per-parameter slots, the step count and `lr`.

    Subclasses set `slots` (names of per-parameter state arrays), implement `update(p, g, state, tmp)`
    for one parameter and `configure(**hyper)` to validate and set their hyperparameters.
    """

    slots = ()  # names of per-parameter state arrays
    sharded = False  # its state over several processes (ZeRO's ShardedOptimizer): state_dict() is then a collective

    def __init__(self, params, backend=None, **hyper):
        self.params = [tuple(t) for t in params]
        seen = set()
        for i, triple in enumerate(self.params):
            if len(triple) != 3:
                raise ConfigError(f"{self.kind}: parameter {i} is {len(triple)}-tuple; expected (name, param, grad)")
            name, p, g = triple
            if name in seen:
                raise ConfigError(f"{self.kind}: parameter name {name!r} appears twice; names must be unique")
            seen.add(name)
            if tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype:
                raise ConfigError(
                    f"{self.kind}: gradient of {name!r} is {g.dtype}{tuple(g.shape)}, "
                    f"expected {p.dtype}{tuple(p.shape)} like the parameter"
                )
        self.backend = backend if backend is not None or not self.params else backend_for(self.params[0][1])
        self.t = 0  # steps taken
        self.configure(**hyper)
        active = self.active_slots()
        self.state = {name: {s: array_module(p).zeros_like(p) for s in active} for name, p, _ in self.params}
        self._tmp = self._scratch_views()

    # -- hyperparameters -----------------------------------------------------------------
    @property
    def kind(self):
        return type(self).__name__

    def configure(self, lr):
        """Validate and set hyperparameters (subclasses extend)."""
        self.lr = check(self, "lr", lr, 0.0)

    def hyperparameters(self):
        """{name: value} of every hyperparameter, as configure() takes them."""
        return {"lr": self.lr}

    def active_slots(self):
        """Slots these hyperparameters need (e.g. no momentum buffer without momentum)."""
        return self.slots

    # -- stepping ------------------------------------------------------------------------
    def step(self):
        """One update of every parameter from its current gradient."""
        self.t += 1
        self.begin_step()
        for name, p, g in self.params:
            self.update(p, g, self.state[name], self._tmp[name])

    def begin_step(self):
        """Scalar work shared by all parameters in this step (after self.t is incremented)."""

    def update(self, p, g, state, tmp):
        """Update p in place from g; state: {slot: array}; tmp: scratch arrays shaped like p."""
        raise NotImplementedError

    def _scratch_views(self):
        """{name: [views]}: per dtype and array module, one flat buffer; views of it shaped like each param."""
        flat = {}
        for _, p, _ in self.params:
            key = (array_module(p).__name__, p.dtype)
            flat[key] = max(flat.get(key, 0), p.size)
        buffers = {key: None for key in flat}
        views = {}
        for name, p, _ in self.params:
            key = (array_module(p).__name__, p.dtype)
            if buffers[key] is None:
                buffers[key] = array_module(p).empty(_SCRATCH * flat[key], p.dtype)
            views[name] = [buffers[key][i * p.size : (i + 1) * p.size].reshape(p.shape) for i in range(_SCRATCH)]
        return views

    # -- state ---------------------------------------------------------------------------
    def scalar_state(self):
        """{name: value} of scalar state beyond the step count (subclasses with such state extend)."""
        return {}

    def set_scalar_state(self, scalars):
        """Validate and restore what scalar_state() returned."""

    def state_dict(self):
        """{"arrays": {"<param>.<slot>": live array}, "scalars": {"step": int, state, hyperparameters}}.

        Arrays are the optimizer's own (not copies), as in Model.state_dict(); scalars are plain
        JSON-serialisable Python values.
        """
        arrays = {f"{name}.{s}": a for name, slots in self.state.items() for s, a in slots.items()}
        return {"arrays": arrays, "scalars": {"step": self.t, **self.scalar_state(), **self.hyperparameters()}}

    def state_dtypes(self):
        """{"<param>.<slot>": dtype} of every state array, as state_dict() names them (no array is made)."""
        return {f"{name}.{s}": a.dtype for name, slots in self.state.items() for s, a in slots.items()}

    def load_state_dict(self, d):
        """Restore a state_dict(): copy arrays into this optimizer's own, set step, state and hyperparameters.

        Names and shapes must match this optimizer's (same parameters, same kind, same slots).
        """
        if not isinstance(d, dict) or set(d) != {"arrays", "scalars"}:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ConfigError(f"{self.kind}: optimizer state dict has keys {got}; expected ['arrays', 'scalars']")
        own = self.state_dict()
        for part in ("arrays", "scalars"):
            extra = sorted(set(d[part]) - set(own[part]))
            missing = sorted(set(own[part]) - set(d[part]))
            if extra or missing:
                what = "; ".join([f"unexpected {extra[:5]}"] * bool(extra) + [f"missing {missing[:5]}"] * bool(missing))
                raise ConfigError(
                    f"{self.kind}: optimizer state {part} do not fit this optimizer: {what}; "
                    f"expected {sorted(own[part])[:8]}{' ...' if len(own[part]) > 8 else ''}"
                )
        for k, v in d["arrays"].items():
            if tuple(v.shape) != tuple(own["arrays"][k].shape):
                raise ConfigError(
                    f"{self.kind}: optimizer state {k!r} has shape {tuple(v.shape)}, "
                    f"expected {tuple(own['arrays'][k].shape)}"
                )
        step = d["scalars"]["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"{self.kind}: optimizer state 'step' is {step!r}; expected an integer >= 0")
        old, old_scalars, slots = self.hyperparameters(), self.scalar_state(), self.active_slots()
        try:  # validate and set every scalar, or none
            self.configure(**{k: d["scalars"][k] for k in old})
            if self.active_slots() != slots:
                raise ConfigError(
                    f"{self.kind}: the state's hyperparameters need slots {list(self.active_slots())}, "
                    f"this optimizer has {list(slots)}; build it with the same options"
                )
            self.set_scalar_state({k: d["scalars"][k] for k in old_scalars})
        except ConfigError:
            self.configure(**old)
            self.set_scalar_state(old_scalars)
            raise
        for k, v in d["arrays"].items():
            dst = own["arrays"][k]
            dst[...] = array_module(dst).asarray(v, dtype=dst.dtype)
        self.t = step

    def __repr__(self):
        hyper = ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())
        return f"{self.kind}({len(self.params)} parameters, {hyper})"


def check(opt, name, value, lo, hi=None, lo_open=False, hi_open=True):
    """float(value) if lo <= value (< or <=) hi, else ConfigError naming the value and the range."""
    left = f"{lo} {'<' if lo_open else '<='} {name}"
    expected = left if hi is None else f"{left} {'<' if hi_open else '<='} {hi}"
    try:
        if isinstance(value, bool):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{opt.kind}: {name}={value!r} is not a number; expected {expected}") from None
    ok = (v > lo if lo_open else v >= lo) and (hi is None or (v < hi if hi_open else v <= hi)) and math.isfinite(v)
    if not ok:
        raise ConfigError(f"{opt.kind}: {name}={value!r} is out of range; expected {expected}")
    return v

