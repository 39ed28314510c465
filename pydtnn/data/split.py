"""Validation sets: a fixed random part of the training set (--validation_split), or the test set
(--test_as_validation)."""

import numbers

import numpy as np

from pydtnn.errors import ConfigError


def split_validation(train, fraction, seed=0, stratify=False):
    """(train_part, val_part): round(fraction * len(train)) samples held out for validation.

    The held-out samples are a pure function of (len(train), fraction, seed) (and the labels with
    stratify=True, which holds out the same fraction of every class), so every process and every
    resumed run splits alike. fraction 0 returns (train, None). ConfigError outside [0, 1).
    """
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0.0 <= fraction < 1.0:
        raise ConfigError(f"validation_split must be a fraction in [0, 1), got {fraction!r}")
    if fraction == 0:
        return train, None
    n = len(train)
    rng = np.random.default_rng([seed, 0x5A11D])
    if stratify:
        y = np.asarray(train.y)
        val = np.concatenate([idx[rng.permutation(len(idx))[:round(len(idx) * fraction)]]
                              for idx in (np.flatnonzero(y == c) for c in np.unique(y))])
    else:
        val = rng.permutation(n)[:round(n * fraction)]
    if len(val) == 0 or len(val) == n:
        raise ConfigError(f"validation_split {fraction} of {n} samples leaves {n - len(val)} for training and "
                          f"{len(val)} for validation; expected at least 1 in each")
    is_val = np.zeros(n, bool)
    is_val[val] = True
    name = getattr(train, "name", "dataset")
    return (train.subset(np.flatnonzero(~is_val), name=f"{name}[train part]"),
            train.subset(np.flatnonzero(is_val), name=f"{name}[validation part]"))


def resolve_validation(train, test, validation_split=0.0, test_as_validation=False, seed=0):
    """(train, val) as the two flags say: a split of train, the test set itself, or (train, None).

    They are exclusive: holding out part of the training set while validating on the test set
    would train on less data for nothing.
    """
    if test_as_validation:
        if validation_split:
            raise ConfigError(f"validation_split={validation_split} and test_as_validation=True are exclusive; "
                              f"choose one")
        if test is None:
            raise ConfigError("test_as_validation=True needs a test set; this dataset has none")
        return train, test
    return split_validation(train, validation_split, seed)
