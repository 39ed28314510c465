"""The Layer contract: parameters + forward + backward, nothing else.

A layer is built once for an input shape (without the batch dimension), then called many times:

    layer.build((3, 32, 32), dtype=numpy.float32)     # CPU backend unless a Model passes its own
    y = layer.forward(x, training=True)              # x: (N, 3, 32, 32)
    dx = layer.backward(dy)                          # fills layer.grads, returns dL/dx

`params` and `grads` are dicts of arrays with the same keys; `backward` writes gradients into the
preallocated `grads` arrays (overwriting, not accumulating), so a gradient reducer can rely on stable
memory. `buffers` hold non-trainable state (BatchNorm's running statistics).
"""

import functools
import math
import os

import numpy as np

from pydtnn.backends import get_backend
from pydtnn.errors import ShapeError, TooLarge
from pydtnn.initializers import initialize


class Layer:
    """Base class of every layer and block."""

    def __init__(self):
        self.params, self.grads, self.buffers = {}, {}, {}
        self.input_shape = self.output_shape = None
        self.backend = None
        self.dtype = None
        self.path = None  # dotted name inside a Model ("features.3"), set by the Model
        self.need_dx = True  # False for the first layer of a model: nobody wants dL/dinput

    # -- identity ------------------------------------------------------------------------
    @property
    def xp(self):
        """Array module of this layer's backend (numpy or cupy)."""
        return self.backend.xp

    @property
    def name(self):
        kind = type(self).__name__
        return f"{kind} '{self.path}'" if self.path else kind

    def describe(self):
        """One-line configuration shown by Model.summary()."""
        return type(self).__name__

    def __repr__(self):
        return self.describe()

    # -- building ------------------------------------------------------------------------
    def build(self, input_shape, dtype=np.float32, backend=None):
        """Validate `input_shape` (no batch dimension), create parameters, set `output_shape`.

        Subclasses call this first, then add their parameters and set `output_shape` (it defaults
        to the input shape).
        """
        self.input_shape = tuple(int(s) for s in input_shape)
        self.backend = backend if backend is not None else get_backend("cpu", dtype)
        self.dtype = np.dtype(dtype)
        self.output_shape = self.input_shape
        self.params, self.grads, self.buffers = {}, {}, {}

    def expect_rank(self, rank, what):
        """Raise ShapeError unless the input has `rank` dimensions; `what` names the expected layout."""
        if len(self.input_shape) != rank:
            hint = "; add Flatten() before it" if rank == 1 and len(self.input_shape) > 1 else ""
            raise ShapeError(f"{self.name}: expects input {what}, got {self.input_shape}{hint}")

    def init(self, initializer, shape, fan_in, fan_out):
        """Parameter array drawn from the backend's Generator, on the backend's device."""
        self.check_fits(shape)
        a = initialize(initializer, shape, fan_in, fan_out, self.backend.rng, self.dtype)
        return self.backend.asarray(a)

    def check_fits(self, shape):
        """ShapeError, before anything is allocated, when a parameter of `shape` alone needs more bytes than
        the machine has available: an input shape far too large fails with one line naming it, instead
        of a MemoryError (or the kernel killing the process) after minutes of trying."""
        need = math.prod(int(s) for s in shape) * self.dtype.itemsize
        available, source = memory_available()
        if available is not None and need > available:
            raise TooLarge(f"{self.name}: its {self.dtype.name} parameter of shape {tuple(int(s) for s in shape)} "
                             f"needs {_gib(need)}, more than the {_gib(available)} of memory available ({source}); "
                             f"the layer's input shape {self.input_shape} is too large: build the model for a "
                             f"smaller input shape")

    def add_param(self, name, value):
        """Register a trainable parameter and its zeroed gradient buffer."""
        self.params[name] = value
        self.grads[name] = self.xp.zeros_like(value)

    def add_buffer(self, name, value):
        """Register non-trainable state saved in the state dict (e.g. running statistics)."""
        self.buffers[name] = value

    # -- computing -----------------------------------------------------------------------
    def forward(self, x, training=True):
        """y = f(x) for a batch x of shape (N, *input_shape)."""
        raise NotImplementedError

    def backward(self, dy):
        """Given dL/dy, write dL/dparams into self.grads and return dL/dx (None if not need_dx)."""
        raise NotImplementedError

    def __call__(self, x, training=True):
        return self.forward(x, training)

    def synchronize(self, sync):
        """Statistics over the samples of every data-parallel rank from now on (None: this rank's own).

        sync: an object with allreduce(array) (the sum over ranks, in place) and weight (this rank's share of
        the global batch). Nothing here: a layer whose statistics span the batch (BatchNorm) overrides it.
        """

    def take_saved(self, name):
        """The state forward kept in self.<name> for this backward, let go here: nothing holds it for this
        layer during the rest of backward or until the next forward (a second backward needs a new one)."""
        value = getattr(self, name, None)
        if value is None:
            raise RuntimeError(f"{self.name}: no saved forward state; run forward(x, training=True) before each "
                               "backward")
        setattr(self, name, None)
        return value

    # -- structure -----------------------------------------------------------------------
    def named_children(self):
        """(name, layer) pairs of sub-layers; a leaf has none."""
        return []

    def named_layers(self, prefix=""):
        """Depth-first (path, layer) pairs of this layer and every descendant."""
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_layers(_join(prefix, name))

    def flops(self):
        """Forward floating-point operations per sample (a multiply-add counts 2)."""
        return 0

    def count_params(self):
        return sum(int(np.prod(p.shape)) for _, layer in self.named_layers() for p in layer.params.values())


@functools.lru_cache(maxsize=None)
def memory_available():
    """(bytes, where the number comes from) of memory a new allocation can have on this machine:
    MemAvailable from /proc/meminfo, else the physical memory; (None, None) when neither is known.
    Read once per process: it bounds what a single parameter may take, not what is free right now."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"
    except (OSError, ValueError, AttributeError):
        return None, None


def _gib(n):
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _join(prefix, name):
    """Dotted path; an empty name adds no segment (its children appear in the parent's namespace)."""
    if not name:
        return prefix
    return f"{prefix}.{name}" if prefix else name


def as_pair(v, what):
    """(a, b) from an int or a pair; `what` names the argument in the error."""
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, (int, np.integer)) for i in v):
        return int(v[0]), int(v[1])
    raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
