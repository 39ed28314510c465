"""The model zoo: one builder function per architecture, registered by name below.

    pydtnn.models.names()                                 # ['simplecnn', 'simplemlp', ...]
    model = pydtnn.models.create("simplecnn", backend=CPUBackend(seed=1))

A builder takes (input_shape, num_classes, **options) and returns the list of layers; `create`
builds it into a Model. Defaults come from the dataset the architecture was designed for.
"""

from pydtnn.backends.cpu import CPUBackend
from pydtnn.errors import ConfigError
from pydtnn.model import Model
from pydtnn.models import simple

# name -> (builder, default input shape, default number of classes)
_REGISTRY = {
    "simplecnn": (simple.simplecnn, (1, 28, 28), 10),
    "simplemlp": (simple.simplemlp, (1, 28, 28), 10),
}


def names():
    """Registered architecture names, sorted."""
    return sorted(_REGISTRY)


def create(name, input_shape=None, num_classes=None, backend=None, **options):
    """Built Model of architecture `name` on `backend` (CPU float32 seed 0 by default)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}; expected one of {', '.join(names())}")
    builder, default_shape, default_classes = _REGISTRY[name]
    shape = tuple(input_shape or default_shape)
    layers = builder(shape, num_classes or default_classes, **options)
    return Model(layers, shape, backend if backend is not None else CPUBackend(), name=name)
