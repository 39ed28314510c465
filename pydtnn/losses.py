"""Losses: the mean loss of a batch and its gradient with respect to the model's output.

    loss = SoftmaxCrossEntropy()
    value = loss.forward(logits, labels)   # Python float, mean over the batch
    dy = loss.backward()                   # dL/dlogits of that mean, same shape and dtype as logits
    v = loss.value(logits, labels)         # the same mean as a 0-d array, left on the device (no sync)

Every loss works on NumPy or CuPy arrays alike (the array module of its input) and keeps the
input's dtype: float32 logits give float32 gradients. Targets are checked; a bad one raises a
one-line error naming the bad value and what was expected. Checking the values of a target on a
GPU reads them back, a synchronization: the trainer checks its batches on the host before they are
copied and computes inside `targets_checked_on_host()`, where device targets' values are not read.
"""

import contextlib
import contextvars

from pydtnn.backends import array_module, is_device_array

_CHECKED_ON_HOST = contextvars.ContextVar("pydtnn_targets_checked_on_host", default=False)


@contextlib.contextmanager
def targets_checked_on_host():
    """Within it, losses and metrics check device targets' shapes and dtypes but do not read their values
    (the caller checked them on the host): no device synchronization."""
    token = _CHECKED_ON_HOST.set(True)
    try:
        yield
    finally:
        _CHECKED_ON_HOST.reset(token)


def _read_values(target):
    """Whether a target's values are checked here (always, except device arrays the caller checked)."""
    return not (_CHECKED_ON_HOST.get() and is_device_array(target))
from pydtnn.errors import ConfigError, DataError, ShapeError


class Loss:
    """Base class: value(y, target) -> 0-d array, forward(y, target) -> float, backward() -> dL/dy.
    A loss defines value (or only forward, then the trainer reads it every step). Calling it is forward."""

    name = "loss"

    def forward(self, y, target):
        """The mean loss of the batch as a Python float (on a GPU, a read: the host waits)."""
        return float(self.value(y, target))

    def value(self, y, target):
        """The mean loss of the batch as a 0-d array of y's module, not read back."""
        raise NotImplementedError

    def backward(self):
        raise NotImplementedError

    def __call__(self, y, target):
        return self.forward(y, target)

    def __repr__(self):
        return f"{type(self).__name__}()"


class SoftmaxCrossEntropy(Loss):
    """Cross entropy of softmax(y), fused with the softmax: the loss that goes on raw logits.

    y: logits (N, K). target: int class labels (N,) in [0, K), or class probabilities (N, K). A sequence's
    logits (N, T, K) with int labels (N, T) (next-token prediction) are its N*T rows: the mean over every token.
    With label smoothing eps the target distribution is q = (1 - eps) * target + eps / K.
    L = -mean_n sum_k q[n, k] * log_softmax(y)[n, k];  dL/dy = (softmax(y) * sum_k q - q) / N.
    Same as torch.nn.functional.cross_entropy(y, target, label_smoothing=eps).
    After forward, `self.probs` holds softmax(y) (N, K), for accuracy without recomputing.
    """

    name = "categorical_cross_entropy"

    def __init__(self, label_smoothing=0.0):
        label_smoothing = float(label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ConfigError(f"{self.name}: label_smoothing must be in [0, 1], got {label_smoothing}")
        self.label_smoothing = label_smoothing
        self.probs = self.labels = self.q = None
        self.shape = None  # the logits' shape: backward gives dy in it

    def __repr__(self):
        return f"SoftmaxCrossEntropy(label_smoothing={self.label_smoothing})"

    def value(self, y, target):
        xp = array_module(y)
        shape = y.shape
        if y.ndim == 3 and target.ndim == 2 and target.shape == y.shape[:2]:  # tokens: N*T rows
            y, target = y.reshape(-1, y.shape[-1]), target.reshape(-1)
        if y.ndim != 2:
            raise ShapeError(f"{self.name}: expects logits (N, K), or (N, T, K) with labels (N, T), got shape "
                             f"{y.shape}{f' with targets {target.shape}' if y.ndim == 3 else ''}")
        _check_nonempty(self.name, y)
        n, k = y.shape
        eps = self.label_smoothing
        if target.ndim == 1:
            labels, q = check_batch_labels(target, n, k, self.name), None
        else:  # checked before anything is kept, so a bad target leaves the last batch's state whole
            _check_same_shape(self.name, y, target, "probabilities (N, K)")
            labels, q = None, target.astype(y.dtype, copy=False)
            if eps:
                q = q * (1 - eps) + eps / k
        z = y - y.max(axis=1, keepdims=True)  # <= 0: exp never overflows, and the max term is exp(0) = 1
        logp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
        self.probs, self.labels, self.q, self.shape = xp.exp(logp), labels, q, shape
        if q is None:
            per_sample = -(1 - eps) * xp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
            if eps:
                per_sample -= (eps / k) * logp.sum(axis=1)
        else:
            per_sample = -(q * logp).sum(axis=1)
        return per_sample.sum() / n

    def backward(self):
        n, k = self.probs.shape
        if self.q is not None:
            dy = self.probs * self.q.sum(axis=1, keepdims=True) - self.q
        else:
            dy = self.probs - self.label_smoothing / k
            dy[array_module(dy).arange(n), self.labels] -= 1 - self.label_smoothing
        dy *= 1 / n
        return dy.reshape(self.shape)


class BinaryCrossEntropy(Loss):
    """Binary cross entropy on logits: one independent sigmoid per element.

    y: logits, any shape; target: same shape, floats in [0, 1].
    L = mean(max(y, 0) - y * t + log1p(exp(-|y|)));  dL/dy = (sigmoid(y) - t) / y.size.
    Same as torch.nn.functional.binary_cross_entropy_with_logits. After forward, `self.probs`
    holds sigmoid(y).
    """

    name = "binary_cross_entropy"

    def __init__(self):
        self.probs = self.t = None

    def value(self, y, target):
        xp = array_module(y)
        _check_same_shape(self.name, y, target, "targets in [0, 1] of the logits' shape")
        _check_nonempty(self.name, y)
        t = target.astype(y.dtype, copy=False)
        if _read_values(t):
            lo, hi = float(t.min()), float(t.max())
            if not (0 <= lo and hi <= 1):  # also catches NaN
                bad = lo if not 0 <= lo else hi
                raise DataError(f"{self.name}: target value {bad} out of range; expected probabilities in [0, 1]")
        e = xp.exp(-xp.abs(y))  # in (0, 1]: never overflows
        self.probs = xp.where(y >= 0, 1 / (1 + e), e / (1 + e))
        self.t = t
        return (xp.maximum(y, 0) - y * t + xp.log1p(e)).mean()

    def backward(self):
        dy = self.probs - self.t
        dy *= 1 / dy.size
        return dy


class MeanSquaredError(Loss):
    """L = mean((y - t)^2) over all elements;  dL/dy = 2 (y - t) / y.size. Same as F.mse_loss."""

    name = "mse"

    def __init__(self):
        self.diff = None

    def value(self, y, target):
        _check_same_shape(self.name, y, target, "targets of the outputs' shape")
        _check_nonempty(self.name, y)
        self.diff = y - target.astype(y.dtype, copy=False)
        return (self.diff * self.diff).mean()

    def backward(self):
        return self.diff * (2 / self.diff.size)


def defers(loss):
    """Whether `loss.value` computes what `loss.forward` returns, so it can be left on the device: a loss
    that defines value and does not override forward below it (a subclass adding a term to forward is
    read through forward)."""
    cls = type(loss)
    if cls.value is Loss.value:
        return False
    for klass in cls.__mro__:  # the class that defines forward must not be below the one that defines value
        if "value" in vars(klass):
            return True
        if "forward" in vars(klass):
            return False
    return False


def check_host_targets(loss, target, output_shape):
    """Check a batch's targets on the host, before they are copied to the device, as `loss` would on the
    device: int labels against the model's classes, or BinaryCrossEntropy's targets in [0, 1]."""
    if is_device_array(target):
        return
    if isinstance(loss, BinaryCrossEntropy):
        if target.size and not (0 <= float(target.min()) and float(target.max()) <= 1):
            bad = float(target.min()) if not 0 <= float(target.min()) else float(target.max())
            raise DataError(f"{loss.name}: target value {bad} out of range; expected probabilities in [0, 1]")
    elif target.ndim == 1 and target.dtype.kind in "iu" and len(output_shape) == 1:
        check_batch_labels(target, len(target), output_shape[0], loss.name)
    elif target.ndim == 2 and target.dtype.kind in "iu" and len(output_shape) == 2:  # tokens (N, T), scores (T, K)
        check_batch_labels(target.reshape(-1), target.size, output_shape[-1], loss.name)


def check_batch_labels(target, n, k, who):
    """A batch's target, checked against its scores (n, k) at each step: class labels (n,) of an integer
    dtype, all in [0, k), on the scores' device; returns them as they are, or raises DataError/ShapeError
    naming `who` (the loss or metric)."""
    if target.shape != (n,):
        raise ShapeError(f"{who}: labels of shape {target.shape}; expected ({n},) for a batch of {n}")
    if target.dtype.kind not in "iu":
        raise DataError(f"{who}: labels of dtype {target.dtype}; expected integer class labels, "
                        f"or probabilities of shape ({n}, {k})")
    if n == 0 or not _read_values(target):
        return target
    lo, hi = int(target.min()), int(target.max())
    if lo < 0 or hi >= k:
        bad = lo if lo < 0 else hi
        i = int(array_module(target).argmax(target == bad))
        raise DataError(f"{who}: label {bad} (sample {i} of the batch) out of range; expected labels in [0, {k}) "
                        f"for {k} classes")
    return target


def _check_same_shape(who, y, target, what):
    if target.shape != y.shape:
        raise ShapeError(f"{who}: target of shape {target.shape}; expected {what}, i.e. shape {y.shape}")
    if target.dtype.kind not in "biuf":
        raise DataError(f"{who}: target of dtype {target.dtype}; expected a numeric array")


def _check_nonempty(who, y):
    if y.size == 0:
        raise ShapeError(f"{who}: empty batch of shape {y.shape}; expected at least one element")


_CLASSES = {
    "categorical_cross_entropy": SoftmaxCrossEntropy,
    "cross_entropy": SoftmaxCrossEntropy,
    "binary_cross_entropy": BinaryCrossEntropy,
    "mse": MeanSquaredError,
}

NAMES = tuple(_CLASSES)


def create(name, **options):
    """A fresh loss by name ('categorical_cross_entropy' / 'cross_entropy', 'binary_cross_entropy',
    'mse'); options go to its constructor (e.g. label_smoothing=0.1)."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown loss {name!r}; expected one of {', '.join(NAMES)}")
    return _CLASSES[name](**options)
