"""Weight initializers: He, Glorot and LeCun (uniform and normal), GPT-2's normal (std 0.02, whatever the fans:
gpt_normal, for embeddings and transformer projections), zeros, ones.

Each takes (shape, fan_in, fan_out, rng, dtype) and returns a NumPy array; the caller moves it to
its device. Randomness always comes from the Generator passed in (the backend's), never a global.
"""

import numpy as np

from pydtnn.errors import ConfigError


def _uniform(limit):
    return lambda shape, rng: rng.uniform(-limit, limit, size=shape)


def _normal(std):
    return lambda shape, rng: rng.normal(0.0, std, size=shape)


# name -> (variance scale as a function of (fan_in, fan_out), distribution)
_RULES = {
    "he": lambda fi, fo: 2.0 / fi,
    "glorot": lambda fi, fo: 2.0 / (fi + fo),
    "lecun": lambda fi, fo: 1.0 / fi,
}

GPT_STD = 0.02
NAMES = tuple(f"{r}_{d}" for r in _RULES for d in ("uniform", "normal")) + ("gpt_normal", "zeros", "ones")


def initialize(name, shape, fan_in, fan_out, rng, dtype=np.float32):
    """Array of `shape` drawn by initializer `name` (e.g. 'he_uniform', 'glorot_normal', 'zeros')."""
    if name == "zeros":
        return np.zeros(shape, dtype)
    if name == "ones":
        return np.ones(shape, dtype)
    if name == "gpt_normal":
        return _normal(GPT_STD)(shape, rng).astype(dtype)
    rule, _, dist = name.partition("_")
    if rule not in _RULES or dist not in ("uniform", "normal"):
        raise ConfigError(f"unknown initializer {name!r}; expected one of {', '.join(NAMES)}")
    var = _RULES[rule](fan_in, fan_out)
    # uniform(-a, a) has variance a^2/3
    draw = _uniform(np.sqrt(3.0 * var)) if dist == "uniform" else _normal(np.sqrt(var))
    return draw(shape, rng).astype(dtype)
