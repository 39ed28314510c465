"""Model: shape inference and its errors, state dicts, hooks, summary, whole-model gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pydtnn import models
from pydtnn.backends import CPUBackend
from pydtnn.errors import ShapeError
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
    MaxPool2D,
    ReLU,
    Sequential,
    Tanh,
)
from pydtnn.model import Model
from pydtnn.models.simple import simplecnn, simplemlp
from pydtnn.testing import check_against_torch, check_gradients


def tiny_resnet():
    return [
        Conv2D(4, 3, padding=1), BatchNorm(), ReLU(),
        AdditionBlock([Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), Conv2D(4, 3, padding=1), BatchNorm()], []),
        ReLU(),
        ConcatenationBlock([Conv2D(2, 1)], [AvgPool2D(3, stride=1, padding=1)]),
        MaxPool2D(2), Dropout(0.2), GlobalAvgPool2D(), Dense(3),
    ]


@pytest.mark.parametrize(
    "layers,x_shape",
    [(simplecnn((1, 8, 8), 3), (2, 1, 8, 8)), (simplemlp((1, 6, 6), 4), (3, 1, 6, 6)), (tiny_resnet(), (2, 3, 6, 6))],
)
def test_whole_model_gradients(layers, x_shape):
    check_gradients(Sequential(layers), x_shape, max_entries=25)


def test_simplecnn_matches_torch():
    def torch_fn(x, p):
        x = F.max_pool2d(F.relu(F.conv2d(x, p["0.weight"], p["0.bias"], padding=1)), 2)
        x = F.max_pool2d(F.relu(F.conv2d(x, p["3.weight"], p["3.bias"], padding=1)), 2)
        x = F.relu(F.linear(x.flatten(1), p["7.weight"], p["7.bias"]))
        return F.linear(x, p["9.weight"], p["9.bias"])

    for dtype in (np.float64, np.float32):
        check_against_torch(Sequential(simplecnn((1, 12, 12), 5)), (4, 1, 12, 12), torch_fn, dtype=dtype)


# -- build-time shape errors: name the layer, the shape seen and the shape expected --------------
@pytest.mark.parametrize(
    "layers,shape,words",
    [
        ([Conv2D(4, 3), Dense(10)], (1, 8, 8), ["Dense '1'", "(4, 6, 6)", "(features,)", "Flatten"]),
        ([Conv2D(4, 5)], (1, 3, 3), ["Conv2D '0'", "5x5", "3x3", "(1, 3, 3)"]),
        ([Conv2D(4, 3, groups=3)], (4, 8, 8), ["Conv2D '0'", "groups=3", "(4, 8, 8)"]),
        ([Flatten(), Conv2D(4, 3)], (1, 8, 8), ["Conv2D '1'", "(64,)", "(C, H, W)"]),
        ([MaxPool2D(4)], (2, 3, 3), ["MaxPool2D '0'", "(2, 3, 3)"]),
        ([AdditionBlock([Conv2D(4, 3)], [])], (4, 8, 8), ["AdditionBlock '0'", "(4, 6, 6)", "(4, 8, 8)"]),
        ([ConcatenationBlock([Conv2D(4, 3)], [])], (4, 8, 8), ["ConcatenationBlock '0'", "(H, W)"]),
    ],
)
def test_shape_errors_name_layer_and_shapes(layers, shape, words):
    with pytest.raises(ShapeError) as e:
        Model(layers, shape)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# -- state dict ------------------------------------------------------------------------------
def test_state_dict_names_order_and_round_trip():
    m = Model({"features": Sequential([Conv2D(2, 3), BatchNorm(), ReLU()]), "flat": Flatten(), "fc": Dense(3)}, (1, 5, 5))
    assert list(m.state_dict()) == [
        "features.0.weight", "features.0.bias",
        "features.1.weight", "features.1.bias", "features.1.running_mean", "features.1.running_var",
        "fc.weight", "fc.bias",
    ]
    other = Model({"features": Sequential([Conv2D(2, 3), BatchNorm(), ReLU()]), "flat": Flatten(), "fc": Dense(3)},
                  (1, 5, 5), CPUBackend(seed=7))
    assert other.params_sha256() != m.params_sha256()
    other.load_state_dict({k: v.copy() for k, v in m.state_dict().items()})
    assert other.params_sha256() == m.params_sha256()
    x = np.random.default_rng(0).standard_normal((2, 1, 5, 5)).astype(np.float32)
    np.testing.assert_array_equal(other.forward(x, training=False), m.forward(x, training=False))


def test_load_state_dict_rejects_foreign_state():
    m = models.create("simplecnn")
    sd = {k: v.copy() for k, v in m.state_dict().items()}
    with pytest.raises(ShapeError, match="3.weight has shape"):
        m.load_state_dict({**sd, "3.weight": np.zeros((1, 1, 3, 3), np.float32)})
    with pytest.raises(ShapeError, match="unexpected"):
        m.load_state_dict({**sd, "99.weight": np.zeros(3, np.float32)})
    del sd["0.bias"]
    with pytest.raises(ShapeError, match="missing"):
        m.load_state_dict(sd)
    m.load_state_dict(sd, strict=False)


def test_params_sha256_is_little_endian_bytes_in_state_order():
    import hashlib

    m = models.create("simplemlp")
    h = hashlib.sha256()
    for _, p, _ in m.parameters():
        h.update(p.astype("<f4").tobytes())
    assert m.params_sha256() == h.hexdigest()


def test_same_seed_same_weights_different_seed_different():
    a, b, c = (models.create("simplecnn", backend=CPUBackend(seed=s)) for s in (3, 3, 4))
    assert a.params_sha256() == b.params_sha256() != c.params_sha256()


# -- hooks, modes, summary ------------------------------------------------------------------
def test_grad_ready_hook_fires_in_reverse_order_once_per_layer():
    m = Model(tiny_resnet(), (3, 6, 6), CPUBackend(np.float64))
    seen = []
    m.add_grad_ready_hook(lambda names: seen.append((names, [g.copy() for n, _, g in m.parameters() if n in names])))
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6))
    m.forward(x)
    m.backward(np.ones((2, 3)))
    order = [names for names, _ in seen]
    assert order[0] == ["9.weight", "9.bias"]
    assert order[-1] == ["0.weight", "0.bias"]
    flat = [n for names in order for n in names]
    assert sorted(flat) == sorted(n for n, _, _ in m.parameters())  # every parameter exactly once
    for names, grads in seen:  # grads were final when the hook fired
        final = {n: g for n, _, g in m.parameters()}
        for n, g in zip(names, grads):
            np.testing.assert_array_equal(g, final[n])


def test_train_eval_modes_change_batchnorm_and_dropout():
    m = Model([Flatten(), Dense(8), BatchNorm(), Dropout(0.5), Tanh()], (1, 3, 3))
    x = np.random.default_rng(0).standard_normal((4, 1, 3, 3)).astype(np.float32)
    m.eval()
    y1, y2 = m.forward(x), m.forward(x)
    np.testing.assert_array_equal(y1, y2)
    m.train()
    assert not np.array_equal(m.forward(x), m.forward(x))


def test_summary_lists_layers_params_and_flops():
    m = models.create("simplecnn")
    text = m.summary(file=open("/dev/null", "w"))
    assert "Conv2D(16, 3x3" in text and "(16, 28, 28)" in text and f"{m.count_params():,}" in text
    conv = m.root.children[0][1]
    assert conv.flops() == 2 * 16 * 28 * 28 * 9 + 16 * 28 * 28
    assert m.count_params() == 16 * 9 + 16 + 32 * 16 * 9 + 32 + 1568 * 64 + 64 + 64 * 10 + 10


def test_first_layer_computes_no_input_gradient():
    m = models.create("simplecnn")
    conv = m.root.children[0][1]
    assert conv.need_dx is False and m.root.children[3][1].need_dx is True
    x = np.zeros((2, 1, 28, 28), np.float32)
    m.forward(x)
    m.backward(np.ones((2, 10), np.float32))  # no error, no dx work for the first conv


def test_model_takes_float64_data_in_its_own_dtype():
    """A float32 model given float64 x and dy computes in float32, as if given them rounded to float32
    (a Dense-first model would otherwise run all its layers in float64)."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 1, 6, 6)), rng.standard_normal((3, 4))
    m = Model(simplemlp((1, 6, 6), 4), (1, 6, 6), backend=CPUBackend(np.float32))
    got = m.forward(x, training=True)
    m.backward(dy)
    grads = {k: g.copy() for k, _, g in m.parameters()}
    want = m.forward(x.astype(np.float32), training=True)
    m.backward(dy.astype(np.float32))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    for k, _, g in m.parameters():
        assert g.dtype == np.float32 and np.array_equal(grads[k], g), k


def test_models_registry():
    assert {"simplecnn", "simplemlp"} <= set(models.names())
    assert models.create("simplecnn", input_shape=(3, 16, 16), num_classes=7).output_shape == (7,)
    with pytest.raises(Exception, match="simplecnn"):
        models.create("nosuchnet")
    assert torch.__version__  # the oracle is importable in the test environment


def test_named_paths_reproduce_torchvision_names():
    block = Sequential({
        "": AdditionBlock(
            {"conv1": Conv2D(4, 3, stride=2, padding=1, use_bias=False), "bn1": BatchNorm(), "relu": ReLU()},
            [Conv2D(4, 1, stride=2, use_bias=False), BatchNorm()],
            names=("", "downsample"),
        ),
        "relu": ReLU(),
    })
    m = Model({"layer1": Sequential([block])}, (2, 6, 6))
    assert list(m.state_dict())[:3] == ["layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.bn1.bias"]
    assert "layer1.0.downsample.1.running_var" in m.state_dict()
    with pytest.raises(ShapeError, match="not unique"):
        Model(Sequential({"": Sequential([Dense(2)]), "0": Dense(2)}), (3,))
