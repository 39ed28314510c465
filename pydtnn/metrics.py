"""Metrics of one batch: plain functions (y, target) -> Python float, the mean over the batch.

Names accepted by `get` (and by the CLI's `--metrics accuracy,top5_accuracy`):

    accuracy        fraction of samples whose highest score is the target class
                    (alias categorical_accuracy, PyDTNN's name)
    topK_accuracy   fraction whose target class is among the K highest scores, for any K >= 1:
                    top5_accuracy, top3_accuracy, ...
    mse, mae        mean squared / absolute error over all elements
                    (aliases regression_mse, regression_mae)
    bits_per_token  the targets' cross-entropy under softmax(y) in bits (alias bpc): bits per character
                    where tokens are characters or bytes; a record that has it also gets its
                    perplexity, 2 ** bits_per_token (`with_perplexity`)

Scores y may be logits or probabilities: the ranking is the same. Classification targets are int
labels (N,) or one-hot/probability rows (N, K), reduced to labels by argmax; a sequence's scores
(N, T, K) with labels (N, T) count every token (next-token accuracy). Ties in y are broken
towards the lower class index, like argmax, so top1_accuracy == accuracy always.
Works on NumPy or CuPy arrays alike (the array module of y). With read=False a metric returns
its value as a 0-d array of y's module instead, not read back from the device (the trainer adds
them up on the GPU and reads the sums every few steps).
"""

import functools
import math
import re

from pydtnn.backends import array_module
from pydtnn.errors import ConfigError, ShapeError
from pydtnn.losses import check_batch_labels


def _tokens(y, target):
    """(y, target) with a sequence's (N, T, K) scores and (N, T) labels as N*T rows; others as they are."""
    if y.ndim == 3 and target.ndim == 2 and target.shape == y.shape[:2]:
        return y.reshape(-1, y.shape[-1]), target.reshape(-1)
    return y, target


def accuracy(y, target, read=True):
    """Fraction of rows of y (N, K) whose argmax is the target class."""
    y, target = _tokens(y, target)
    labels = _labels(y, target, "accuracy")
    hits = (y.argmax(axis=1) == labels).sum()
    return float(hits) / y.shape[0] if read else hits / y.shape[0]


def top_k_accuracy(y, target, k=5, read=True):
    """Fraction of rows of y (N, K) whose target class ranks among the k highest scores.

    Rank of the target = number of classes with a higher score, plus those with an equal score
    and a lower index (argmax's tie rule). k >= K counts every sample as correct.
    """
    if int(k) != k or k < 1:
        raise ConfigError(f"top_k_accuracy: k must be a positive integer, got {k!r}")
    y, target = _tokens(y, target)
    labels = _labels(y, target, f"top{k}_accuracy")
    xp = array_module(y)
    n, num_classes = y.shape
    s = xp.take_along_axis(y, labels[:, None], axis=1)  # (N, 1): the target's score
    ahead = (y > s) | ((y == s) & (xp.arange(num_classes)[None, :] < labels[:, None]))
    hits = (ahead.sum(axis=1) < k).sum()
    return float(hits) / n if read else hits / n


def mse(y, target, read=True):
    """mean((y - target)^2) over all elements; int labels (N,) with y (N, K) compare against one-hot rows."""
    d = y - _dense_target(y, target, "mse")
    v = (d * d).mean()
    return float(v) if read else v


def mae(y, target, read=True):
    """mean(|y - target|) over all elements; int labels (N,) with y (N, K) compare against one-hot rows."""
    v = array_module(y).abs(y - _dense_target(y, target, "mae")).mean()
    return float(v) if read else v


def bits_per_token(y, target, read=True):
    """Mean over rows (tokens) of -log2 softmax(y)[target]: the loss in bits, whatever the loss function."""
    y, target = _tokens(y, target)
    labels = _labels(y, target, "bits_per_token")
    xp = array_module(y)
    top = y.max(axis=1, keepdims=True)
    log_sum = top[:, 0] + xp.log(xp.exp(y - top).sum(axis=1))
    nats = log_sum - xp.take_along_axis(y, labels[:, None], axis=1)[:, 0]
    v = nats.astype(xp.float64).mean() / math.log(2)
    return float(v) if read else v


def with_perplexity(record, prefix=""):
    """`record` with prefix + "perplexity" = 2 ** its prefix + "bits_per_token", where it has that value."""
    bits = record.get(prefix + "bits_per_token")
    if bits is not None:
        record[prefix + "perplexity"] = 2.0 ** bits if bits < 1024 else math.inf
    return record


def _labels(y, target, who):
    """Int labels (N,) from labels or one-hot/probability rows (N, K), checked against y (N, K)."""
    if y.ndim != 2 or y.shape[0] == 0:
        raise ShapeError(f"{who}: expects scores (N, K) with N >= 1, got shape {y.shape}")
    n, k = y.shape
    if target.ndim == 2:
        if target.shape != y.shape:
            raise ShapeError(f"{who}: target of shape {target.shape}; expected labels ({n},) or rows {y.shape}")
        return target.argmax(axis=1)
    return check_batch_labels(target, n, k, who)


def _dense_target(y, target, who):
    """target as an array of y's shape and dtype: itself, or one-hot rows for int labels (N,) with y (N, K)."""
    if y.size == 0:
        raise ShapeError(f"{who}: empty batch of shape {y.shape}; expected at least one element")
    if target.shape == y.shape:
        return target.astype(y.dtype, copy=False)
    if y.ndim == 2 and target.ndim == 1 and target.dtype.kind in "iu":
        labels = check_batch_labels(target, y.shape[0], y.shape[1], who)
        xp = array_module(y)
        return (labels[:, None] == xp.arange(y.shape[1])[None, :]).astype(y.dtype)
    raise ShapeError(f"{who}: target of shape {target.shape}; expected {y.shape}, or int labels ({y.shape[0]},) "
                     f"for scores (N, K)")


_FUNCTIONS = {
    "accuracy": accuracy,
    "categorical_accuracy": accuracy,
    "top5_accuracy": functools.partial(top_k_accuracy, k=5),
    "mse": mse,
    "regression_mse": mse,
    "mae": mae,
    "regression_mae": mae,
    "bits_per_token": bits_per_token,
    "bpc": bits_per_token,
}

NAMES = tuple(_FUNCTIONS)
_ALIASES = {"categorical_accuracy": "accuracy", "regression_mse": "mse", "regression_mae": "mae", "bpc": "bits_per_token"}


def canonical(name):
    """The name a metric is reported under: PyDTNN's aliases map to ours (categorical_accuracy -> accuracy)."""
    get(name)  # validates
    return _ALIASES.get(name, name)


def get(name):
    """Metric function (y, target, read=True) -> float by name: one of NAMES, or 'topK_accuracy' for any K >= 1."""
    if name in _FUNCTIONS:
        return _FUNCTIONS[name]
    m = re.fullmatch(r"top([1-9][0-9]*)_accuracy", name)
    if m:
        return functools.partial(top_k_accuracy, k=int(m.group(1)))
    raise ConfigError(f"unknown metric {name!r}; expected one of {', '.join(NAMES)} (or topK_accuracy, K >= 1)")
