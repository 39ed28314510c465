"""Optimizers: update a model's parameters in place from its gradients; state lives here, keyed by name.

    opt = optim.create("adam", model.parameters(), lr=1e-3)
    opt.step()

Each matches its torch.optim counterpart (tests/test_optimizers.py checks every step against it).
"""

import inspect

from pydtnn.errors import ConfigError
from pydtnn.optim.adam import Adam, AdamW, Nadam
from pydtnn.optim.base import Optimizer
from pydtnn.optim.rmsprop import RMSProp
from pydtnn.optim.sgd import SGD

NAMES = ("sgd", "rmsprop", "adam", "adamw", "nadam")
_CLASSES = dict(zip(NAMES, (SGD, RMSProp, Adam, AdamW, Nadam)))


def create(name, params, backend=None, **hyper):
    """Optimizer `name` (one of NAMES, any case) over params [(name, param, grad)] with hyperparameters;
    backend: the model's, whose update kernels it runs (default: one for the parameters' array type)."""
    cls = _CLASSES.get(str(name).lower())
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r}; expected one of {', '.join(NAMES)}")
    accepted = [k for k in inspect.signature(cls).parameters if k not in ("params", "backend")]
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
        raise ConfigError(f"optimizer {name!r} has no option {', '.join(unknown)}; it takes {', '.join(accepted)}")
    return cls(params, backend=backend, **hyper)


def hyperparameters(name, **hyper):
    """Every hyperparameter optimizer `name` runs with: its constructor's defaults updated with `hyper`."""
    cls = _CLASSES[str(name).lower()]
    defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items()
                if k not in ("params", "backend") and p.default is not inspect.Parameter.empty}
    return {**defaults, **hyper}


__all__ = ["Adam", "AdamW", "create", "hyperparameters", "NAMES", "Nadam", "Optimizer", "RMSProp", "SGD"]
