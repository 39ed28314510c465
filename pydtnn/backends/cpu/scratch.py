"""The CPU backend's scratch pool: large temporaries (im2col matrices, padded inputs) reused from one
step to the next, so a training step does not page-fault fresh memory for them."""

import numpy as np


class ScratchPool:
    """Arrays keyed by (tag, shape, dtype, geometry). Arrays handed to a caller as results are never pooled."""

    def __init__(self):
        self.free = {}  # key -> arrays nobody holds

    def take(self, tag, shape, dtype, g=None):
        """(key, array). A new array is zeroed; a reused one holds what its last user left, which im2col
        relies on: the entries a geometry never writes (padding) stay zero."""
        key = (tag, shape, np.dtype(dtype).str, g)
        free = self.free.get(key)
        return key, (free.pop() if free else np.zeros(shape, dtype))

    def give(self, key, a):
        self.free.setdefault(key, []).append(a)

    def loan(self, key, a):
        """a, kept by a forward for its backward: back to the pool when released (see Loan)."""
        return Loan(self.free, key, a)

    def keep_if(self, keep, key, a):
        """A forward's context: a lent to backward when `keep`, else a back in the pool now and None."""
        if keep:
            return self.loan(key, a)
        self.give(key, a)
        return None


class Loan:
    """A pooled array that a forward keeps for its backward.

    It goes back to the pool when the backward is done with it (`release`), or when this object is
    dropped without a backward (a forward-only call): the next forward of the same layer then
    finds it there instead of faulting in fresh memory.
    """

    __slots__ = ("array", "free", "key")

    def __init__(self, free, key, array):
        self.free, self.key, self.array = free, key, array

    def release(self):
        if self.array is not None:
            self.free.setdefault(self.key, []).append(self.array)
            self.array = None

    def __del__(self):
        self.release()


class Kept:
    """A forward's input kept for its backward (not pooled: the caller's own array)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def release(self):
        self.array = None
