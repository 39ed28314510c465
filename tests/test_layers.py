"""Every layer: float64 finite differences, and forward/backward against PyTorch in float64 and float32."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pydtnn.layers import (
    AdditionBlock,
    AvgPool2D,
    BatchNorm,
    ConcatenationBlock,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool2D,
    LeakyReLU,
    MaxPool2D,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)
from pydtnn.testing import check_against_torch, check_gradients

DTYPES = [np.float64, np.float32]


def both_checks(make, x_shape, torch_fn, training=True):
    """Gradient check in float64, then the torch oracle in both dtypes, each on a fresh layer."""
    check_gradients(make(), x_shape, training=training)
    for dtype in DTYPES:
        check_against_torch(make(), x_shape, torch_fn, dtype=dtype, training=training)


# -- Dense ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,units,bias", [((5, 7), 3, True), ((1, 13), 9, False), ((8, 32), 16, True)])
def test_dense(shape, units, bias):
    both_checks(lambda: Dense(units, use_bias=bias), shape, lambda x, p: F.linear(x, p["weight"], p.get("bias")))


# -- Conv2D --------------------------------------------------------------------------------
CONV_CASES = [
    # (x_shape, filters, kwargs)
    ((2, 3, 7, 7), 4, dict(kernel_size=3)),
    ((2, 3, 8, 9), 5, dict(kernel_size=3, stride=2, padding=1)),
    ((1, 2, 9, 9), 3, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0))),
    ((2, 4, 9, 9), 6, dict(kernel_size=3, dilation=2, padding=2)),
    ((2, 4, 7, 7), 6, dict(kernel_size=3, groups=2, padding=1)),
    ((2, 4, 8, 8), 4, dict(kernel_size=3, groups=4, stride=2, padding=1)),  # depthwise
    ((2, 3, 6, 6), 8, dict(kernel_size=3, groups=1, padding=1, use_bias=False)),
    ((2, 3, 6, 6), 4, dict(kernel_size=1)),  # pointwise
    ((2, 2, 7, 6), 3, dict(kernel_size=4, padding="same")),  # even kernel: asymmetric padding
    ((2, 2, 7, 7), 3, dict(kernel_size=3, padding="same", dilation=2)),
    ((2, 2, 5, 5), 3, dict(kernel_size=3, padding="valid")),
]


def torch_conv(kwargs):
    stride, dilation, groups = kwargs.get("stride", 1), kwargs.get("dilation", 1), kwargs.get("groups", 1)
    padding = kwargs.get("padding", 0)

    def fn(x, p):
        return F.conv2d(x, p["weight"], p.get("bias"), stride, padding, dilation, groups)

    return fn


@pytest.mark.parametrize("x_shape,filters,kwargs", CONV_CASES)
def test_conv2d(x_shape, filters, kwargs):
    both_checks(lambda: Conv2D(filters, **kwargs), x_shape, torch_conv(kwargs))


def test_conv2d_same_with_stride_gives_ceil_output():
    layer = Conv2D(3, 3, stride=2, padding="same")
    layer.build((2, 9, 8))
    assert layer.output_shape == (3, 5, 4)
    check_gradients(Conv2D(3, 3, stride=2, padding="same"), (2, 2, 9, 8))


def test_conv2d_first_layer_skips_dx():
    layer = Conv2D(3, 3)
    layer.build((2, 5, 5), np.float64)
    layer.need_dx = False
    layer.forward(np.ones((1, 2, 5, 5)))
    assert layer.backward(np.ones((1, 3, 3, 3))) is None
    check_gradients(layer, (2, 2, 5, 5))  # parameters still right


# -- Pooling -------------------------------------------------------------------------------
POOL_CASES = [
    ((2, 3, 8, 8), dict(pool_size=2)),
    ((2, 3, 9, 9), dict(pool_size=3, stride=2)),
    ((2, 2, 7, 7), dict(pool_size=3, stride=2, padding=1)),
    ((1, 2, 6, 8), dict(pool_size=(2, 3), stride=(2, 1))),
    ((2, 2, 5, 5), dict(pool_size=2, stride=1)),  # overlapping windows
]


@pytest.mark.parametrize("x_shape,kwargs", POOL_CASES)
def test_maxpool2d(x_shape, kwargs):
    k, s, p = kwargs["pool_size"], kwargs.get("stride"), kwargs.get("padding", 0)
    both_checks(lambda: MaxPool2D(**kwargs), x_shape, lambda x, _: F.max_pool2d(x, k, s, p))


@pytest.mark.parametrize("x_shape,kwargs", POOL_CASES)
def test_avgpool2d(x_shape, kwargs):
    k, s, p = kwargs["pool_size"], kwargs.get("stride"), kwargs.get("padding", 0)
    both_checks(lambda: AvgPool2D(**kwargs), x_shape, lambda x, _: F.avg_pool2d(x, k, s, p))


def test_maxpool_backward_routes_to_argmax_only():
    layer = MaxPool2D(2)
    layer.build((1, 2, 2))
    x = np.array([[[[1.0, 5.0], [3.0, 2.0]]]], np.float32)
    assert layer.forward(x)[0, 0, 0, 0] == 5.0
    np.testing.assert_array_equal(layer.backward(np.ones((1, 1, 1, 1), np.float32))[0, 0], [[0, 1], [0, 0]])


@pytest.mark.parametrize("x_shape", [(2, 3, 4, 4), (3, 5, 1, 7)])
def test_global_avgpool2d(x_shape):
    both_checks(GlobalAvgPool2D, x_shape, lambda x, _: x.mean(dim=(2, 3)))


# -- BatchNorm -----------------------------------------------------------------------------
@pytest.mark.parametrize("x_shape", [(4, 3, 5, 5), (6, 7), (2, 2, 1, 3)])
def test_batchnorm_training(x_shape, kernels):
    c = x_shape[1]

    def make(dtype=np.float64):
        bn = BatchNorm(momentum=0.1, eps=1e-5)
        bn.build(x_shape[1:], dtype)
        bn.params["weight"][...] = np.linspace(0.5, 1.5, c)  # not the trivial ones/zeros
        bn.params["bias"][...] = np.linspace(-1, 1, c)
        return bn

    check_gradients(make(), x_shape)
    for dtype in DTYPES:
        bn = make(dtype)
        tdtype = torch.float64 if dtype == np.float64 else torch.float32
        rm, rv = torch.zeros(c, dtype=tdtype), torch.ones(c, dtype=tdtype)
        check_against_torch(
            bn, x_shape, lambda x, p: F.batch_norm(x, rm, rv, p["weight"], p["bias"], True, 0.1, 1e-5), dtype=dtype
        )
        np.testing.assert_allclose(bn.buffers["running_mean"], rm.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bn.buffers["running_var"], rv.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_shape", [(7, 3, 4, 5), (9, 6)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_in_chunks(monkeypatch, x_shape, training):
    """The NumPy path reduces and writes dx a few samples at a time: chunks of 2 samples, last one short."""
    from dataclasses import replace

    from pydtnn.backends.cpu import normalization, tuning

    monkeypatch.setenv("PYDTNN_CPU_KERNELS", "numpy")  # the compiled kernels take whole channels

    per_sample = int(np.prod(x_shape[1:]))
    c = x_shape[1]

    def make(dtype=np.float64):
        bn = BatchNorm()
        bn.build(x_shape[1:], dtype)
        bn.params["weight"][...] = np.linspace(0.5, 1.5, c)
        bn.params["bias"][...] = np.linspace(-1, 1, c)
        bn.buffers["running_mean"][...] = np.linspace(-0.3, 0.2, c)
        bn.buffers["running_var"][...] = np.linspace(0.5, 2.0, c)
        return bn

    for dtype in DTYPES:
        chunk = 2 * per_sample * np.dtype(dtype).itemsize
        monkeypatch.setattr(tuning, "DEFAULT", replace(tuning.DEFAULT, batchnorm_chunk_bytes=chunk))
        bn = make(dtype)
        assert len(normalization.chunks(bn.backend, np.zeros(x_shape, dtype))) == (x_shape[0] + 1) // 2
        rm, rv = (torch.tensor(bn.buffers[k].copy()) for k in ("running_mean", "running_var"))
        check_against_torch(
            bn, x_shape, lambda x, p: F.batch_norm(x, rm, rv, p["weight"], p["bias"], training), dtype=dtype,
            training=training,
        )
        if dtype == np.float64:
            check_gradients(make(), x_shape, training=training)


def test_batchnorm_float32_far_from_zero_mean(kernels):
    """Statistics and gradients stay accurate in float32 when |mean| is 100 standard deviations."""
    rng = np.random.default_rng(1)
    x = (100 + rng.standard_normal((8, 4, 6, 6)) * np.array([1, 0.5, 2, 1])[:, None, None]).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    bn = BatchNorm()
    bn.build(x.shape[1:], np.float32)
    ref = BatchNorm()
    ref.build(x.shape[1:], np.float64)
    for _ in range(2):  # the second step reuses the scratch buffer
        y, dx = bn.forward(x), bn.backward(dy)
        want_y, want_dx = ref.forward(x.astype(np.float64)), ref.backward(dy.astype(np.float64))
    assert y.dtype == dx.dtype == np.float32
    np.testing.assert_allclose(y, want_y, rtol=0, atol=2e-4)
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=1e-5 * np.abs(want_dx).max())
    for k in ("weight", "bias"):
        np.testing.assert_allclose(bn.grads[k], ref.grads[k], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(bn.buffers["running_var"], ref.buffers["running_var"], rtol=1e-4)


@pytest.mark.parametrize("x_shape", [(5, 4, 6, 7), (9, 3)])
def test_batchnorm_compiled_kernels_match_numpy_path(x_shape):
    """The CPU backend's compiled BatchNorm (whole channels per call) and the NumPy path (chunked
    reductions) agree to rounding, in float32 and float64: output, running statistics, gradients."""
    from pydtnn.backends.cpu import CPUBackend

    rng = np.random.default_rng(3)
    c = x_shape[1]
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = (5 + 2 * rng.standard_normal(x_shape)).astype(dtype)
        dy = rng.standard_normal(x_shape).astype(dtype)
        runs = []
        for k in ("numba", "numpy"):
            bn = BatchNorm()
            bn.build(x_shape[1:], dtype, CPUBackend(dtype, kernels=k))
            bn.params["weight"][...] = np.linspace(0.5, 1.5, c)
            bn.params["bias"][...] = np.linspace(-1, 1, c)
            assert bn.backend.kernels == k
            y = bn.forward(x)
            dx = bn.backward(dy)
            runs.append([y, dx, bn.grads["weight"], bn.grads["bias"], *bn.buffers.values()])
        for i, (a, b) in enumerate(zip(*runs)):
            assert a.dtype == b.dtype == dtype
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1, np.abs(b).max()), err_msg=f"output {i}")


def test_batchnorm_eval_uses_running_stats():
    x_shape = (4, 3, 2, 2)
    bn = BatchNorm()
    bn.build(x_shape[1:], np.float64)
    bn.buffers["running_mean"][...] = [0.5, -1.0, 2.0]
    bn.buffers["running_var"][...] = [1.5, 0.25, 4.0]
    rm, rv = torch.tensor(bn.buffers["running_mean"]), torch.tensor(bn.buffers["running_var"])
    check_against_torch(bn, x_shape, lambda x, p: F.batch_norm(x, rm, rv, p["weight"], p["bias"], False), training=False)
    check_gradients(bn, x_shape, training=False)


# -- Activations, Flatten, Softmax ---------------------------------------------------------
ACTIVATIONS = [
    (ReLU, F.relu),
    (ReLU6, F.relu6),
    (lambda: LeakyReLU(0.1), lambda x: F.leaky_relu(x, 0.1)),
    (Sigmoid, torch.sigmoid),
    (Tanh, torch.tanh),
    (Softmax, lambda x: F.softmax(x, dim=1)),
    (Flatten, lambda x: x.flatten(1)),
]


@pytest.mark.parametrize("make,fn", ACTIVATIONS)
@pytest.mark.parametrize("x_shape", [(4, 6), (2, 3, 4, 5)])
def test_activation(make, fn, x_shape, kernels):
    both_checks(make, x_shape, lambda x, _: fn(x))


def test_relu_batch_size_changes_and_nan(kernels):
    """ReLU keeps one sample of zeros: a new batch size reuses it; NaN goes through as in PyTorch."""
    relu = ReLU()
    relu.build((2, 3), np.float32)
    rng = np.random.default_rng(4)
    for n in (5, 1, 0, 3):
        x = rng.standard_normal((n, 2, 3)).astype(np.float32)
        y = relu.forward(x)
        assert y.dtype == np.float32 and y.shape == x.shape
        np.testing.assert_array_equal(y, F.relu(torch.from_numpy(x)).numpy())
    y = relu.forward(np.array([[[np.nan, -1, 2], [0, -np.inf, 1]]], np.float32))
    np.testing.assert_array_equal(y, [[[np.nan, 0, 2], [0, 0, 1]]])
    x = rng.standard_normal((170, 2, 3)).astype(np.float32)  # long enough for the vector loops
    x.flat[::7], x.flat[3::11] = np.nan, -np.inf
    y = relu.forward(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))  # NaN where x is NaN
    dy = rng.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_array_equal(relu.backward(dy), np.where(y > 0, dy, 0))


def test_relu6_clips_both_sides():
    x = 4 * np.random.default_rng(3).standard_normal((4, 50))  # reaches past 0 and 6
    check_gradients(ReLU6(), x.shape, x=x)
    for dtype in DTYPES:
        layer = ReLU6()
        layer.build((50,), dtype)
        y = layer.forward(x.astype(dtype))
        tx = torch.tensor(x.astype(dtype), requires_grad=True)
        F.relu6(tx).sum().backward()
        np.testing.assert_allclose(y, F.relu6(tx).detach().numpy())
        np.testing.assert_allclose(layer.backward(np.ones_like(y)), tx.grad.numpy())
    assert (y == 6).any() and (y == 0).any()


@pytest.mark.parametrize("make,kept", [(ReLU, "y"), (ReLU6, "y"), (Sigmoid, "y"), (Tanh, "y"), (Softmax, "y"),
                                       (BatchNorm, "x")])
def test_activations_and_batchnorm_let_what_they_keep_go_in_backward(make, kept):
    """The tensor an activation (its output) or BatchNorm (its input) keeps for its backward is let go
    there: in a model whose convolutions copy their input (im2col), nothing holds it once backward has
    passed the layer; a second backward without a forward says what to do."""
    import gc
    import weakref

    from pydtnn.backends import CPUBackend
    from pydtnn.model import Model

    model = Model([Conv2D(4, 3, padding=1), make(), Conv2D(3, 3, padding=1)], (2, 6, 6),
                  backend=CPUBackend(np.float64, kernels="numpy"))
    act = model.layers()[1][1]
    model.forward(np.random.default_rng(0).standard_normal((2, 2, 6, 6)), training=True)
    held = weakref.ref(getattr(act, kept))
    model.backward(np.ones((2, 3, 6, 6)))
    gc.collect()
    assert held() is None
    with pytest.raises(RuntimeError, match="no saved forward state; run forward.* before each backward"):
        act.backward(np.ones((2, 4, 6, 6)))


@pytest.mark.parametrize("make,x_shape,kept", [(lambda: Dense(3), (2, 5), "x"), (lambda: MaxPool2D(2), (2, 3, 4, 4), "ctx"),
                                             (lambda: LeakyReLU(0.1), (2, 5), "mask")])
def test_layers_let_their_saved_state_go_in_backward(make, x_shape, kept):
    """Dense (its input), MaxPool2D (its argmax) and LeakyReLU (its mask) keep state for one backward:
    let go there, so a second backward without a forward says what to do."""
    layer = make()
    layer.build(x_shape[1:], np.float64)
    y = layer.forward(np.random.default_rng(0).standard_normal(x_shape))
    assert getattr(layer, kept) is not None
    layer.backward(np.ones_like(y))
    assert getattr(layer, kept) is None
    with pytest.raises(RuntimeError, match="no saved forward state"):
        layer.backward(np.ones_like(y))


def test_sigmoid_and_softmax_do_not_overflow():
    for layer, x in ((Sigmoid(), [[-1e4, 1e4]]), (Softmax(), [[1e4, -1e4]])):
        layer.build((2,), np.float32)
        y = layer.forward(np.array(x, np.float32))
        assert np.all(np.isfinite(y)) and y.dtype == np.float32


# -- Dropout -------------------------------------------------------------------------------
def test_dropout_mask_is_per_sample_and_inverted():
    d = Dropout(0.5)
    d.build((1000,), np.float64)
    y = d.forward(np.ones((4, 1000)))
    assert set(np.unique(y)) <= {0.0, 2.0}  # survivors scaled by 1 / (1 - rate)
    assert not np.array_equal(y[0], y[1])  # PyDTNN shared one mask across the batch
    assert abs(y.mean() - 1.0) < 0.1  # expectation preserved
    np.testing.assert_array_equal(d.backward(np.ones((4, 1000))), y)
    assert np.array_equal(d.forward(np.ones((4, 1000)), training=False), np.ones((4, 1000)))


def test_dropout_gradients_and_torch():
    check_gradients(Dropout(0.3), (3, 2, 4, 4))
    for dtype in DTYPES:
        d = Dropout(0.3)
        d.build((2, 4, 4), dtype)
        state = d.backend.rng.bit_generator.state
        x = np.ones((3, 2, 4, 4), dtype)
        mask = d.forward(x) != 0  # the same Generator state replays the same mask below
        d.backend.rng.bit_generator.state = state
        check_against_torch(d, (3, 2, 4, 4), lambda x, _: x * torch.tensor(mask) / 0.7, dtype=dtype)


# -- Blocks --------------------------------------------------------------------------------
def residual_block():
    return AdditionBlock(
        [Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), Conv2D(4, 3, padding=1)],
        [Conv2D(4, 1)],
    )


def torch_residual(x, p):
    a = F.conv2d(x, p["0.0.weight"], p["0.0.bias"], padding=1)
    a = F.relu(F.batch_norm(a, None, None, p["0.1.weight"], p["0.1.bias"], True))
    a = F.conv2d(a, p["0.3.weight"], p["0.3.bias"], padding=1)
    return a + F.conv2d(x, p["1.0.weight"], p["1.0.bias"])


def test_addition_block():
    both_checks(residual_block, (2, 3, 5, 5), torch_residual)


def test_addition_block_identity_path():
    both_checks(
        lambda: AdditionBlock([Conv2D(3, 3, padding=1), Tanh()], []),
        (2, 3, 4, 4),
        lambda x, p: torch.tanh(F.conv2d(x, p["0.0.weight"], p["0.0.bias"], padding=1)) + x,
    )


@pytest.mark.parametrize("n_paths", [1, 3])
def test_addition_block_one_and_three_paths(n_paths):
    """The sum is a new array for any number of paths; identity paths leave the input untouched."""
    paths = [[Conv2D(3, 1)]] + [[] for _ in range(n_paths - 1)]

    def torch_fn(x, p):
        return F.conv2d(x, p["0.0.weight"], p["0.0.bias"]) + (n_paths - 1) * x

    both_checks(lambda: AdditionBlock(*paths), (2, 3, 4, 4), torch_fn)
    block = AdditionBlock(*paths)
    block.build((3, 4, 4), np.float64)
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 4))
    x0 = x.copy()
    y = block.forward(x)
    dy = np.ones_like(y)
    dx = block.backward(dy)
    assert y is not x and dx is not dy
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(dy, 1)


def test_concatenation_block():
    def torch_fn(x, p):
        a = F.conv2d(x, p["0.0.weight"], p["0.0.bias"])
        b = F.conv2d(x, p["1.0.weight"], p["1.0.bias"], padding=1)
        c = F.max_pool2d(x, 3, 1, 1)
        return torch.cat([a, b, c], dim=1)

    both_checks(
        lambda: ConcatenationBlock([Conv2D(2, 1)], [Conv2D(3, 3, padding=1)], [MaxPool2D(3, stride=1, padding=1)]),
        (2, 3, 5, 5),
        torch_fn,
    )


def test_nested_sequential_with_names():
    make = lambda: Sequential({"conv": Conv2D(2, 3), "act": Sigmoid(), "flat": Flatten(), "fc": Dense(3)})  # noqa: E731
    both_checks(
        make,
        (2, 1, 5, 5),
        lambda x, p: F.linear(torch.sigmoid(F.conv2d(x, p["conv.weight"], p["conv.bias"])).flatten(1), p["fc.weight"], p["fc.bias"]),
    )


def test_synchronized_batchnorm_on_one_rank_is_batchnorm():
    """The synchronized path (one allreduce of moments, one of gradient sums) on a world of one."""

    class OneRank:
        weight = 1.0
        calls = 0

        def allreduce(self, buf):
            OneRank.calls += 1
            return buf

    def make():
        bn = BatchNorm()
        bn.synchronize(OneRank())
        return bn

    check_gradients(make(), (4, 3, 5, 5))
    tr = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    check_against_torch(make(), (4, 3, 5, 5), lambda x, p: F.batch_norm(x, *tr, p["weight"], p["bias"], True))
    assert OneRank.calls > 0
