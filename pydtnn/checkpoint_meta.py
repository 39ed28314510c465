"""A checkpoint's meta: JSON numbers checked as read, RNG snapshots, and the trainer's meta validated.

    meta = {"epoch": 3, "rng": rng_state(model.backend.rng), ...}    # what pydtnn.resume saves
    check_training_meta(meta, "ckpt/meta.json", model.backend.rng)   # DataError naming the bad key
    set_rng_state(model.backend.rng, meta["rng"])                    # all or nothing

meta.json comes from disk, so every value that reaches an object (an epoch count, a schedule's state,
a generator's position) is checked first: is_count and finite accept JSON integers >= 0 and finite
numbers, never true/false. json_default turns NumPy scalars and arrays into JSON numbers and lists.
"""

import json
import math

import numpy as np

from pydtnn.errors import ConfigError, DataError


# -- JSON values ---------------------------------------------------------------------------------
def is_count(value):
    """True for a JSON integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def finite(value):
    """float(value) for a finite JSON number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:  # an integer beyond float's range
        return None
    return v if math.isfinite(v) else None


def json_default(o):
    """`o` as JSON: a NumPy scalar as its number, an array as nested lists; TypeError for anything else."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} {o!r:.60} is not JSON-serialisable")


# -- random generators ---------------------------------------------------------------------------
def rng_state(generator):
    """JSON-serialisable snapshot of a numpy Generator (its bit generator's state)."""
    return json.loads(json.dumps(generator.bit_generator.state, default=json_default))


def set_rng_state(generator, state):
    """Restore a snapshot from rng_state() into `generator` (same bit generator kind), in place.

    ConfigError for a state of another kind or a malformed one; the generator is then unchanged.
    """
    bit_generator = type(generator.bit_generator)
    kind = bit_generator.__name__
    if not isinstance(state, dict) or state.get("bit_generator") != kind:
        got = state.get("bit_generator") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"RNG state is for {got!r:.60}; this generator is {kind}")
    # NumPy's setters take positions without a range check (an out-of-range one reads outside the
    # state: a crash at the next draw), and MT19937's fills its key in place before it fails
    for keys, top in _RNG_POSITIONS.get(kind, ()):
        pos = state
        for k in keys:
            pos = pos.get(k) if isinstance(pos, dict) else None
        if not is_count(pos) or pos > top:
            raise ConfigError(f"invalid {kind} RNG state: {'.'.join(keys)} is {pos!r:.60}; expected 0 to {top}")
    probe = bit_generator()  # a scratch copy takes the state first: all or nothing
    try:
        inner = state.get("state")
        if kind == "MT19937" and isinstance(inner, dict) and isinstance(inner.get("key"), list):
            state = {**state, "state": {**inner, "key": np.asarray(inner["key"], np.uint32)}}
        probe.state = state
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, AttributeError) as e:
        raise ConfigError(f"invalid {kind} RNG state: {' '.join(str(e).split()) or type(e).__name__}"[:300]) from None
    generator.bit_generator.state = probe.state


_RNG_POSITIONS = {"MT19937": ((("state", "pos"), 624),), "Philox": ((("buffer_pos",), 4),)}


# -- the trainer's meta ----------------------------------------------------------------------------
_JSON_SCALAR = (type(None), bool, int, float, str)
MAX_PROCESSES = 1 << 24  # a saved run's replicas: more than any machine has run (the learning rate scales by it)
MAX_COUNT = 2**53  # epochs and steps: exact in a float64, as JSON readers elsewhere hold numbers


def check_training_meta(meta, where, generator=None, states=None):
    """DataError naming `where` and the key unless `meta` is what pydtnn.resume.save_checkpoint writes.

    Required: epoch, rng, base_lr, schedules, callbacks, history; checked when present: config,
    step, world_size (older checkpoints may lack them). generator: the RNG that meta["rng"] will be
    restored into (tried on a scratch copy). states: {"schedules": [...], "callbacks": [...]}, the
    current state_dict() of each object that will load a saved state, None for one that will not;
    a saved state must have the same keys, with numbers where it holds numbers.
    """
    def bad(key, value, expected):
        return DataError(f"{where}: meta.{key} is {value!r:.60}; expected {expected}")

    for key in ("epoch", "rng", "base_lr", "schedules", "callbacks", "history"):
        if key not in meta:
            raise DataError(f"{where} has no meta.{key}; a checkpoint written by pydtnn's training has it")
    for key in ("epoch", "step"):
        if key in meta and not (is_count(meta[key]) and meta[key] <= MAX_COUNT):
            raise bad(key, meta[key], f"an integer in [0, {MAX_COUNT}]")
    if "world_size" in meta and not (is_count(meta["world_size"]) and 1 <= meta["world_size"] <= MAX_PROCESSES):
        raise bad("world_size", meta["world_size"],
                  f"an integer in [1, {MAX_PROCESSES}] (the saved run's model replicas)")
    lr = finite(meta["base_lr"])
    if lr is None or lr < 0:
        raise bad("base_lr", meta["base_lr"], "a finite number >= 0")
    if "config" in meta and not isinstance(meta["config"], dict):
        raise bad("config", meta["config"], "an object of flag values")
    for key in ("history", "schedules", "callbacks"):
        if not isinstance(meta[key], list):
            raise bad(key, meta[key], "a list of objects")
        for i, item in enumerate(meta[key]):
            if not isinstance(item, dict):
                raise bad(f"{key}[{i}]", item, "an object")
    for i, record in enumerate(meta["history"]):
        for k, v in record.items():
            if not isinstance(v, _JSON_SCALAR):
                raise bad(f"history[{i}].{k}", v, "a number, a string or null")
    for key, own in (states or {}).items():
        for i, (saved, like) in enumerate(zip(meta[key], own)):
            if like is not None:  # their counters (epochs waited, reductions made) count at most the epochs run
                _check_state_like(saved, like, where, f"{key}[{i}]", most=meta["epoch"])
    rng = meta["rng"]
    if not (isinstance(rng, dict) and isinstance(rng.get("bit_generator"), str) and isinstance(rng.get("state"), dict)):
        raise bad("rng", rng, 'a NumPy bit generator state {"bit_generator": ..., "state": {...}}')
    if generator is not None:
        try:
            set_rng_state(np.random.Generator(type(generator.bit_generator)()), rng)
        except ConfigError as e:
            raise DataError(f"{where}: meta.rng: {e}") from None


def _check_state_like(saved, like, where, key, most=MAX_COUNT):
    """DataError unless `saved` has the keys of `like`, each with a value of the same kind: a count in
    [0, most] where `like` holds an integer, a finite number or null where it holds a float or null.

    Objects restore a state by assigning its values (a schedule sets any attribute named), so what
    is not theirs, not a number where a number was, or out of its range must not reach them.
    """
    if set(saved) != set(like):
        raise DataError(f"{where}: meta.{key} has keys {sorted(saved)[:8]}; this run's object has {sorted(like)} "
                        f"(resume with the same schedules and callbacks)")
    for k, v in saved.items():
        now = like[k]
        if isinstance(now, int) and not isinstance(now, bool):  # counters: epochs waited, reductions made
            ok, expected = is_count(v) and v <= most, f"an integer in [0, {most}] (the epochs run)"
        elif now is None or isinstance(now, float):
            ok, expected = v is None or finite(v) is not None, "a finite number or null"
        else:
            ok, expected = type(v) is type(now), type(now).__name__
        if not ok:
            raise DataError(f"{where}: meta.{key}.{k} is {v!r:.60}; expected {expected}")
