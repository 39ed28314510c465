"""Metrics against hand-built cases with known answers and against straightforward references (torch)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pydtnn import metrics
from pydtnn.errors import ConfigError, DataError, ShapeError

DTYPES = [np.float64, np.float32]


# -- accuracy ------------------------------------------------------------------------------
def test_accuracy_known_answer_with_a_tie():
    y = np.array([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5], [0.5, 0.5]])
    labels = np.array([1, 1, 0, 1])  # right, wrong, tie -> class 0 (right), tie -> class 0 (wrong)
    assert metrics.accuracy(y, labels) == 0.5
    assert metrics.accuracy(y, np.eye(2)[labels]) == 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3), (50, 10), (33, 2)])
def test_accuracy_matches_argmax_reference(dtype, shape):
    rng = np.random.default_rng(0)
    y = rng.standard_normal(shape).astype(dtype)
    labels = rng.integers(0, shape[1], shape[0])
    want = (torch.tensor(y).argmax(1) == torch.tensor(labels)).double().mean().item()
    got = metrics.accuracy(y, labels)
    assert type(got) is float and got == pytest.approx(want, abs=1e-15)
    probs = rng.dirichlet(np.ones(shape[1]), shape[0])  # probability targets: argmax is the label
    assert metrics.accuracy(y, probs) == metrics.accuracy(y, probs.argmax(1))
    assert metrics.accuracy(y, labels.astype(np.uint8)) == got


# -- top-k ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((40, 10), 1), ((40, 10), 3), ((40, 10), 5), ((7, 4), 4), ((7, 4), 9),
                                     ((100, 1000), 5)])
def test_top_k_matches_torch_topk(dtype, shape, k):
    rng = np.random.default_rng(k)
    y = rng.standard_normal(shape).astype(dtype)  # continuous: no ties, so torch.topk is unambiguous
    labels = rng.integers(0, shape[1], shape[0])
    top = torch.topk(torch.tensor(y), min(k, shape[1]), dim=1).indices
    want = (top == torch.tensor(labels)[:, None]).any(1).double().mean().item()
    assert 0 < want or shape[0] < 10  # the case exercises hits, not only misses
    assert metrics.top_k_accuracy(y, labels, k) == pytest.approx(want, abs=1e-15)
    assert metrics.get(f"top{k}_accuracy")(y, labels) == pytest.approx(want, abs=1e-15)


def test_top_k_ties_break_towards_lower_index():
    y = np.array([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 2.0]])
    labels = np.array([2, 1])  # row 0: target is third of three tied; row 1: first of three tied
    assert metrics.top_k_accuracy(y, labels, k=1) == 0.5
    assert metrics.top_k_accuracy(y, labels, k=2) == 0.5
    assert metrics.top_k_accuracy(y, labels, k=3) == 1.0


def test_top_1_equals_accuracy_even_with_many_ties():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, (200, 6)).astype(np.float64)
    labels = rng.integers(0, 6, 200)
    assert metrics.top_k_accuracy(y, labels, k=1) == metrics.accuracy(y, labels)
    assert metrics.top_k_accuracy(y, np.eye(6)[labels], k=2) == metrics.top_k_accuracy(y, labels, k=2)


def test_top_k_needs_a_positive_integer_k():
    for k in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="positive integer"):
            metrics.top_k_accuracy(np.zeros((2, 3)), np.zeros(2, np.int64), k)


# -- regression ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (5, 3), (2, 3, 4, 4)])
def test_mse_mae_match_torch(dtype, shape):
    rng = np.random.default_rng(2)
    y, t = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    rtol = 1e-12 if dtype == np.float64 else 1e-6
    for fn, ref in ((metrics.mse, F.mse_loss), (metrics.mae, F.l1_loss)):
        got = fn(y, t)
        assert type(got) is float
        assert got == pytest.approx(ref(torch.tensor(y), torch.tensor(t)).item(), rel=rtol)


def test_mse_mae_known_answers_and_labels_as_one_hot():
    y = np.array([[1.0, 0.0], [0.0, 3.0]])
    assert metrics.mse(y, np.zeros((2, 2))) == 2.5
    assert metrics.mae(y, np.zeros((2, 2))) == 1.0
    assert metrics.mse(y, np.array([0, 1])) == 1.0  # one-hot [[1, 0], [0, 1]]: only (3 - 1)^2 = 4 remains
    assert metrics.mae(y, np.array([1, 1])) == 1.0  # one-hot [[0, 1], [0, 1]]: |1| + |-1| + |2| = 4


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [metrics.accuracy, metrics.get("top2_accuracy"), metrics.mse, metrics.mae])
def test_label_out_of_range(fn):
    with pytest.raises(DataError, match=r"label 3 \(sample 1 .*\[0, 3\)"):
        fn(np.zeros((2, 3)), np.array([0, 3]))


@pytest.mark.parametrize("fn,y,target", [
    (metrics.accuracy, np.zeros(4), np.zeros(4, np.int64)),          # scores not (N, K)
    (metrics.accuracy, np.zeros((4, 3)), np.zeros(5, np.int64)),      # labels of another batch size
    (metrics.accuracy, np.zeros((4, 3)), np.zeros((4, 2))),           # rows of another class count
    (metrics.accuracy, np.zeros((0, 3)), np.zeros(0, np.int64)),      # empty batch
    (metrics.mse, np.zeros((4, 3)), np.zeros((3, 4))),
])
def test_bad_shapes(fn, y, target):
    with pytest.raises(ShapeError) as e:
        fn(y, target)
    assert "\n" not in str(e.value)


# -- names ---------------------------------------------------------------------------------
def test_get_by_name():
    assert {"accuracy", "top5_accuracy", "mse", "mae"} <= set(metrics.NAMES)
    for name in metrics.NAMES:
        assert callable(metrics.get(name))
    assert metrics.get("accuracy") is metrics.accuracy is metrics.get("categorical_accuracy")
    y, labels = np.tile(np.arange(8.0)[::-1], (8, 1)), np.arange(8)  # sample i's target ranks i-th (from 0)
    assert metrics.get("top5_accuracy")(y, labels) == 5 / 8
    assert metrics.get("top3_accuracy")(y, labels) == 3 / 8
    assert metrics.get("top1_accuracy")(y, labels) == metrics.accuracy(y, labels)


@pytest.mark.parametrize("name", ["acc", "top0_accuracy", "top_accuracy", "topk_accuracy", "Accuracy"])
def test_unknown_metric(name):
    with pytest.raises(ConfigError, match=f"unknown metric '{name}'.*accuracy.*top5_accuracy"):
        metrics.get(name)


def test_accuracy_over_tokens_counts_every_token():
    rng = np.random.default_rng(0)
    y, target = rng.standard_normal((3, 5, 7)), rng.integers(0, 7, (3, 5))
    want = float((y.argmax(axis=2) == target).mean())
    assert metrics.accuracy(y, target) == pytest.approx(want)
    assert metrics.get("top7_accuracy")(y, target) == 1.0
    assert metrics.get("top1_accuracy")(y, target) == pytest.approx(want)
