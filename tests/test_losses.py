"""Every loss: float64 finite differences, and value + gradient against PyTorch in float64 and float32."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pydtnn import losses
from pydtnn.errors import ConfigError, DataError, ShapeError
from pydtnn.testing import numerical_gradient

DTYPES = [np.float64, np.float32]
TOL = {np.float64: (1e-10, 1e-13), np.float32: (1e-5, 1e-6)}  # (rtol, atol relative to the largest entry)


def assert_close(what, got, want, dtype):
    rtol, atol = TOL[dtype]
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol * scale, err_msg=what)


def check_gradient(loss, y, target, seed=0):
    """dL/dy from backward vs float64 central differences of forward, on up to 60 entries."""
    y = np.array(y, np.float64)
    loss.forward(y, target)
    dy = loss.backward()
    idx, num = numerical_gradient(lambda: loss.forward(y, target), y, eps=1e-5, max_entries=60,
                                  rng=np.random.default_rng(seed))
    np.testing.assert_allclose(dy.reshape(-1)[idx], num, rtol=1e-6, atol=1e-9, err_msg=f"{loss!r} dL/dy")


def check_against_torch(loss, y, target, torch_fn, dtype):
    """Loss value and dL/dy against torch autograd, on y and target cast to dtype."""
    y = np.asarray(y).astype(dtype)
    if target.dtype.kind == "f":
        target = target.astype(dtype)
    ty = torch.tensor(y, requires_grad=True)
    want = torch_fn(ty, torch.from_numpy(target))
    want.backward()
    got = loss.forward(y, target)
    dy = loss.backward()
    assert type(got) is float
    assert dy.dtype == dtype and dy.shape == y.shape, f"{loss!r}: dy {dy.dtype} {dy.shape}, expected {dtype} {y.shape}"
    assert_close(f"{loss!r} value", got, want.item(), dtype)
    assert_close(f"{loss!r} dL/dy", dy, ty.grad.numpy(), dtype)


def both_checks(make, y, target, torch_fn):
    check_gradient(make(), y, target)
    for dtype in DTYPES:
        check_against_torch(make(), y, target, torch_fn, dtype)


def ce_inputs(shape, kind, seed=0):
    rng = np.random.default_rng(seed)
    n, k = shape
    y = 3 * rng.standard_normal(shape)
    if kind == "labels":
        return y, rng.integers(0, k, n)
    return y, rng.dirichlet(np.ones(k), n)


# -- SoftmaxCrossEntropy -------------------------------------------------------------------
CE_SHAPES = [(1, 2), (5, 3), (16, 10), (3, 1), (8, 100)]


@pytest.mark.parametrize("shape", CE_SHAPES)
@pytest.mark.parametrize("kind", ["labels", "probs"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
def test_cross_entropy(shape, kind, smoothing):
    y, target = ce_inputs(shape, kind)
    both_checks(lambda: losses.SoftmaxCrossEntropy(label_smoothing=smoothing), y, target,
                lambda ty, tt: F.cross_entropy(ty, tt, label_smoothing=smoothing))


@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 1, 3), (3, 4, 100)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_over_tokens_is_the_mean_over_every_token(shape, smoothing):
    """Next-token logits (N, T, V) with labels (N, T): torch's cross entropy of the N*T rows."""
    rng = np.random.default_rng(3)
    y, target = 3 * rng.standard_normal(shape), rng.integers(0, shape[2], shape[:2])
    both_checks(lambda: losses.SoftmaxCrossEntropy(label_smoothing=smoothing), y, target,
                lambda ty, tt: F.cross_entropy(ty.reshape(-1, shape[2]), tt.reshape(-1), label_smoothing=smoothing))


def test_cross_entropy_over_tokens_refuses_labels_of_another_shape():
    with pytest.raises(ShapeError, match=r"got shape \(2, 5, 7\) with targets \(2, 4\)"):
        losses.SoftmaxCrossEntropy().forward(np.zeros((2, 5, 7)), np.zeros((2, 4), np.int64))


def test_token_labels_are_checked_on_the_host_and_a_refused_batch_keeps_the_last_state():
    loss = losses.SoftmaxCrossEntropy()
    losses.check_host_targets(loss, np.array([[0, 6]]), (2, 7))
    with pytest.raises(DataError, match=r"label 7 \(sample 1 of the batch\) out of range; expected labels in \[0, 7\)"):
        losses.check_host_targets(loss, np.array([[0, 7]]), (2, 7))
    y = np.random.default_rng(0).standard_normal((2, 3, 4))
    loss.forward(y, np.zeros((2, 3), np.int64))
    with pytest.raises(ShapeError):
        loss.forward(np.zeros((5, 6, 7)), np.zeros((5, 2), np.int64))
    assert loss.backward().shape == (2, 3, 4)


def test_cross_entropy_unnormalized_probability_targets():
    """Rows that do not sum to 1 (torch accepts them): dL/dy = softmax * sum(q) - q, not softmax - q."""
    rng = np.random.default_rng(1)
    y, target = rng.standard_normal((6, 4)), rng.uniform(0, 2, (6, 4))
    both_checks(lambda: losses.SoftmaxCrossEntropy(0.2), y, target,
                lambda ty, tt: F.cross_entropy(ty, tt, label_smoothing=0.2))


def test_cross_entropy_keeps_softmax_and_is_repeatable():
    y, labels = ce_inputs((7, 5), "labels")
    loss = losses.SoftmaxCrossEntropy(0.1)
    loss.forward(y, labels)
    np.testing.assert_allclose(loss.probs, torch.softmax(torch.tensor(y), 1).numpy(), rtol=1e-12)
    probs = loss.probs.copy()
    dy1, dy2 = loss.backward(), loss.backward()
    np.testing.assert_array_equal(dy1, dy2)
    np.testing.assert_array_equal(loss.probs, probs)  # backward did not write into what forward kept


def test_cross_entropy_integer_label_dtypes_and_one_hot_rows_agree():
    y, labels = ce_inputs((9, 4), "labels")
    loss = losses.SoftmaxCrossEntropy()
    want, want_dy = loss.forward(y, labels), loss.backward()
    for target in (labels.astype(np.uint8), labels.astype(np.int32), np.eye(4, dtype=np.int64)[labels]):
        assert loss.forward(y, target) == pytest.approx(want, rel=1e-14)
        np.testing.assert_allclose(loss.backward(), want_dy, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_large_logits_are_stable(dtype, smoothing):
    rng = np.random.default_rng(2)
    y = (1e4 * rng.standard_normal((6, 5))).astype(dtype)
    y[0] = [1e4, -1e4, 0, 1e4, -1e4]  # a tie at the top, and a gap of 2e4
    labels = np.array([1, 0, 2, 3, 4, 1])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss = losses.SoftmaxCrossEntropy(smoothing)
        value = loss.forward(y, labels)
        dy = loss.backward()
    assert np.isfinite(value) and np.isfinite(dy).all() and np.isfinite(loss.probs).all()
    check_against_torch(losses.SoftmaxCrossEntropy(smoothing), y, labels,
                        lambda ty, tt: F.cross_entropy(ty, tt, label_smoothing=smoothing), dtype)


# -- BinaryCrossEntropy --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (7, 1), (4, 6), (2, 3, 4, 4)])
@pytest.mark.parametrize("hard", [True, False])
def test_binary_cross_entropy(shape, hard):
    rng = np.random.default_rng(3)
    y = 4 * rng.standard_normal(shape)
    target = rng.integers(0, 2, shape).astype(np.float64) if hard else rng.uniform(0, 1, shape)
    both_checks(losses.BinaryCrossEntropy, y, target, F.binary_cross_entropy_with_logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_binary_cross_entropy_large_logits_are_stable(dtype):
    y = np.array([[1e4, -1e4, 1e4, -1e4, 0.0, 50.0]], dtype)
    target = np.array([[1.0, 0.0, 0.0, 1.0, 0.5, 0.3]], dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss = losses.BinaryCrossEntropy()
        value = loss.forward(y, target)
        dy = loss.backward()
    assert np.isfinite(value) and np.isfinite(dy).all()
    check_against_torch(losses.BinaryCrossEntropy(), y, target, F.binary_cross_entropy_with_logits, dtype)


# -- MeanSquaredError ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (2, 3, 4, 5)])
def test_mse(shape):
    rng = np.random.default_rng(4)
    both_checks(losses.MeanSquaredError, rng.standard_normal(shape), rng.standard_normal(shape), F.mse_loss)


# -- the checks themselves can fail --------------------------------------------------------
class _OffByOnePercent(losses.SoftmaxCrossEntropy):
    def backward(self):
        return super().backward() * 1.01


def test_checks_catch_a_wrong_gradient():
    y, labels = ce_inputs((4, 3), "labels")
    with pytest.raises(AssertionError, match="dL/dy"):
        check_gradient(_OffByOnePercent(), y, labels)
    for dtype in DTYPES:
        with pytest.raises(AssertionError, match="dL/dy"):
            check_against_torch(_OffByOnePercent(), y, labels, F.cross_entropy, dtype)


# -- bad targets ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad,index", [(5, 2), (-1, 0), (17, 3)])
def test_cross_entropy_label_out_of_range(bad, index):
    labels = np.array([0, 1, 4, 3])
    labels[index] = bad
    with pytest.raises(DataError) as e:
        losses.SoftmaxCrossEntropy().forward(np.zeros((4, 5)), labels)
    msg = str(e.value)
    assert f"label {bad} (sample {index} " in msg and "[0, 5)" in msg and "\n" not in msg


@pytest.mark.parametrize("make,y,target,error,match", [
    (losses.SoftmaxCrossEntropy, np.zeros((4, 5)), np.zeros(3, np.int64), ShapeError, r"\(3,\); expected \(4,\)"),
    (losses.SoftmaxCrossEntropy, np.zeros((4, 5)), np.zeros((4, 4)), ShapeError, r"\(4, 4\).*\(4, 5\)"),
    (losses.SoftmaxCrossEntropy, np.zeros((4, 5)), np.zeros(4), DataError, "float64; expected integer"),
    (losses.SoftmaxCrossEntropy, np.zeros((4, 5, 2)), np.zeros(4, np.int64), ShapeError, r"\(N, K\).*\(4, 5, 2\)"),
    (losses.SoftmaxCrossEntropy, np.zeros((0, 5)), np.zeros(0, np.int64), ShapeError, "empty batch"),
    (losses.BinaryCrossEntropy, np.zeros((4, 1)), np.zeros(4), ShapeError, r"\(4,\).*\(4, 1\)"),
    (losses.BinaryCrossEntropy, np.zeros((2, 2)), np.array([[0, 1], [2, 0.5]]), DataError, r"2\.0 .*\[0, 1\]"),
    (losses.BinaryCrossEntropy, np.zeros((1, 2)), np.array([[0, np.nan]]), DataError, r"nan .*\[0, 1\]"),
    (losses.MeanSquaredError, np.zeros((4, 3)), np.zeros((3, 4)), ShapeError, r"\(3, 4\).*\(4, 3\)"),
])
def test_bad_targets_raise_one_line_errors(make, y, target, error, match):
    with pytest.raises(error, match=match) as e:
        make().forward(y, target)
    assert "\n" not in str(e.value)


# -- names ---------------------------------------------------------------------------------
def test_create_by_name():
    assert set(losses.NAMES) == {"categorical_cross_entropy", "cross_entropy", "binary_cross_entropy", "mse"}
    assert type(losses.create("categorical_cross_entropy")) is losses.SoftmaxCrossEntropy
    assert type(losses.create("cross_entropy")) is losses.SoftmaxCrossEntropy
    assert type(losses.create("binary_cross_entropy")) is losses.BinaryCrossEntropy
    assert type(losses.create("mse")) is losses.MeanSquaredError
    assert losses.create("cross_entropy", label_smoothing=0.1).label_smoothing == 0.1
    assert losses.create("mse") is not losses.create("mse")


def test_unknown_name_and_bad_options():
    with pytest.raises(ConfigError, match="unknown loss 'hinge'.*categorical_cross_entropy.*mse"):
        losses.create("hinge")
    with pytest.raises(ConfigError, match="label_smoothing"):
        losses.SoftmaxCrossEntropy(label_smoothing=1.5)
