"""ONNX export: every zoo family and every layer type runs in onnxruntime as model.forward(x, training=False) does."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pydtnn import checkpoint, models
from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError
from pydtnn.layers import (
    AdaptiveAvgPool2D,
    AdditionBlock,
    AvgPool2D,
    BatchNorm,
    ConcatenationBlock,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool2D,
    Layer,
    LeakyReLU,
    MaxPool2D,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)
from pydtnn.model import Model

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from pydtnn.export import main, to_onnx, to_proto  # noqa: E402  (after the guards)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def perturb(model, seed=0):
    """BatchNorm with non-trivial statistics and affine parameters, so that exporting them matters."""
    rng = np.random.default_rng(seed)
    for _, layer in model.layers():
        if isinstance(layer, BatchNorm):
            c = layer.params["weight"].shape
            layer.params["weight"][...] = rng.uniform(0.5, 1.5, c)
            layer.params["bias"][...] = rng.normal(0, 0.2, c)
            layer.buffers["running_mean"][...] = rng.normal(0, 0.3, c)
            layer.buffers["running_var"][...] = rng.uniform(0.5, 2.0, c)
    return model


def run_onnx(path, x):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(["output"], {"input": x})[0]


def assert_close(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * max(float(np.abs(ref).max()), 1e-3))


def check_export(model, path, batches=(3, 1), seed=2):
    """Export, then compare onnxruntime with pydtnn's inference at several batch sizes (the batch is dynamic)."""
    to_onnx(model, path)
    rng = np.random.default_rng(seed)
    for n in batches:
        x = rng.normal(size=(n, *model.input_shape)).astype(np.float32)
        assert_close(run_onnx(path, x), model.forward(x, training=False))


ZOO = [
    ("simplecnn", {}),
    ("simplemlp", {}),
    ("lenet5", {}),
    ("alexnet_cifar10", {}),
    ("vgg11bn_cifar10", {}),
    ("resnet20_cifar10", {}),
    ("densenet_cifar10", {"block_config": (2, 2, 2)}),
    ("googlenet_cifar10", {"input_shape": (3, 16, 16)}),  # ceil-mode max pools: 16 -> 8 -> 4
    ("mobilenetv1_cifar10", {"alpha": 0.25}),  # depthwise, 'same' padding, ReLU6
    ("resnet18_imagenet", {"input_shape": (3, 64, 64)}),
    ("inceptionv3_imagenet", {"input_shape": (3, 75, 75), "num_classes": 10}),  # its smallest input
    ("mobilenetv1_imagenet", {"input_shape": (3, 64, 64), "alpha": 0.25}),  # stride-2 'same': pads bottom/right
    ("densenet121_imagenet", {"input_shape": (3, 32, 32), "num_classes": 10}),
    ("googlenet_imagenet", {"input_shape": (3, 64, 64), "num_classes": 10}),
]
SLOW_ZOO = [  # 60 and 130 million parameters, mostly in the classifier
    ("alexnet_imagenet", {"input_shape": (3, 63, 63), "num_classes": 10}),  # adaptive 1x1 -> 6x6 (repeated bins)
    ("vgg11_imagenet", {"input_shape": (3, 32, 32), "num_classes": 10}),  # adaptive 1x1 -> 7x7
]


@pytest.mark.parametrize("name,options", [pytest.param(*z, id=z[0]) for z in ZOO]
                         + [pytest.param(*z, id=z[0], marks=pytest.mark.slow) for z in SLOW_ZOO])
def test_zoo_model_matches_onnxruntime(name, options, tmp_path):
    model = perturb(models.create(name, backend=CPUBackend(seed=1), **options))
    check_export(model, tmp_path / f"{name}.onnx")


def layers_model(input_shape=(4, 11, 10)):
    """Every leaf layer type and option that the zoo uses, and some it does not."""
    return Model([
        Conv2D(6, 3, stride=2, padding="same"),                            # asymmetric padding (odd total)
        BatchNorm(), LeakyReLU(0.2),
        Conv2D(6, (3, 5), padding=(2, 4), dilation=2, groups=3, use_bias=False),
        BatchNorm(eps=1e-3), ReLU6(),
        Conv2D(6, 3, padding=1, groups=6),                                 # depthwise
        Sigmoid(),
        MaxPool2D(3, stride=2, padding=1, ceil_mode=True),
        Conv2D(8, 1), Tanh(),
        AvgPool2D(3, stride=1, padding=1),                                 # zero padding counted in the mean
        Softmax(),                                                         # over channels of a 4-D tensor
        AdaptiveAvgPool2D((2, 3)),
        Flatten(), Dropout(0.5), Dense(7, use_bias=False), BatchNorm(), ReLU(), Dense(5), Softmax(),
    ], input_shape, backend=CPUBackend(seed=3))


def test_every_layer_type(tmp_path):
    check_export(perturb(layers_model()), tmp_path / "layers.onnx")


@pytest.mark.parametrize("hw,out", [((8, 8), (4, 4)), ((7, 9), (3, 4)), ((2, 3), (3, 5)), ((5, 6), (1, 1)),
                                    ((4, 4), (4, 4)), ((6, 5), (2, 5))])
def test_adaptive_average_pooling_at_the_built_size(hw, out, tmp_path):
    model = Model([Conv2D(3, 1), AdaptiveAvgPool2D(out)], (2, *hw), backend=CPUBackend(seed=1))
    check_export(model, tmp_path / "adaptive.onnx")


def test_blocks(tmp_path):
    """Addition of three paths (one the identity), a one-path addition, nested concatenations."""
    model = Model([
        Conv2D(4, 3, padding=1),
        AdditionBlock([Conv2D(4, 3, padding=1), BatchNorm()], [], [Conv2D(4, 1), ReLU()]),
        AdditionBlock([Conv2D(4, 1)]),
        ConcatenationBlock([], [Conv2D(2, 1)], ConcatenationBlock([MaxPool2D(3, stride=1, padding=1)], [Tanh()])),
        GlobalAvgPool2D(), Dense(3),
    ], (3, 6, 6), backend=CPUBackend(seed=1))
    check_export(perturb(model), tmp_path / "blocks.onnx")


def test_identity_model(tmp_path):
    model = Model([Dropout(0.3)], (2, 3, 3))
    check_export(model, tmp_path / "identity.onnx")


def test_initializers_carry_state_dict_names():
    model = perturb(models.create("resnet20_cifar10", backend=CPUBackend(seed=1)))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in to_proto(model).graph.initializer}
    state = model.state_dict()
    assert set(state) <= set(inits)
    for name, value in state.items():
        np.testing.assert_array_equal(inits[name], value, err_msg=name)
    assert "layer2.0.downsample.1.running_var" in inits


def test_fixed_batch_and_opset(tmp_path):
    model = models.create("lenet5", backend=CPUBackend(seed=1))
    proto = to_proto(model, opset=13, batch_size=4)
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [4, 1, 28, 28] and proto.opset_import[0].version == 13
    dynamic = to_proto(model).graph.output[0].type.tensor_type.shape.dim
    assert dynamic[0].dim_param == "N" and dynamic[1].dim_value == 10
    for bad in (12, 10_000, "17"):
        with pytest.raises(ConfigError, match="opset"):
            to_proto(model, opset=bad)
    with pytest.raises(ConfigError, match="batch_size"):
        to_proto(model, batch_size=0)


class Scale(Layer):
    def forward(self, x, training=True):
        return 2 * x


def test_unknown_layer_type_is_refused_and_nothing_written(tmp_path):
    model = Model({"body": Sequential({"conv": Conv2D(2, 1), "twice": Scale()})}, (1, 4, 4))
    path = tmp_path / "m.onnx"
    path.write_bytes(b"previous")
    with pytest.raises(ConfigError, match=r"'body\.twice'.*Scale"):
        to_onnx(model, path)
    assert path.read_bytes() == b"previous" and os.listdir(tmp_path) == ["m.onnx"]


def test_unwritable_path_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot write"):
        to_onnx(models.create("simplemlp"), tmp_path / "file" / "m.onnx")
    assert os.listdir(tmp_path) == ["file"]


def test_onnx_is_imported_lazily_and_its_absence_is_one_clear_error():
    code = ("import sys; sys.modules['onnx'] = None\n"
            "import pydtnn, pydtnn.export, pydtnn.models\n"
            "from pydtnn.errors import ConfigError\n"
            "try:\n"
            "    pydtnn.export.to_onnx(pydtnn.models.create('simplemlp'), 'never.onnx')\n"
            "except ConfigError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "pip install onnx" in r.stdout and not os.path.exists(os.path.join(ROOT, "never.onnx"))


# -- pydtnn-export ------------------------------------------------------------------------------
def export_cli(*args):
    return subprocess.run([sys.executable, "-m", "pydtnn.export", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def assert_user_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pydtnn: error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_cli_from_a_checkpoint(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "net.onnx"
    train = subprocess.run([sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--num_epochs", "1",
                            "--steps_per_epoch", "2", "--batch_size", "16", "--checkpoint_dir", str(ckpt),
                            "--progress", "false"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert train.returncode == 0, train.stderr[-3000:]
    r = export_cli(out, "--checkpoint", ckpt)
    assert r.returncode == 0, r.stderr
    assert "simplecnn" in r.stdout
    model = models.create("simplecnn")
    checkpoint.load(ckpt, model)
    x = np.random.default_rng(0).normal(size=(5, 1, 28, 28)).astype(np.float32)
    assert_close(run_onnx(out, x), model.forward(x, training=False))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "net.onnx"]

    assert_user_error(export_cli(tmp_path / "other.onnx", "--checkpoint", ckpt, "--num_classes", "3"), "--num_classes")
    assert_user_error(export_cli(tmp_path / "other.onnx", "--checkpoint", tmp_path / "missing"), "checkpoint")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "net.onnx"]


def test_cli_checkpoint_with_other_classes_and_dtype(tmp_path):
    """The number of classes (not in the manifest) comes from the saved state; float64 is exported as float32."""
    model = perturb(models.create("resnet20_cifar10", input_shape=(3, 16, 16), num_classes=4,
                                  backend=CPUBackend(dtype="float64", seed=5)))
    checkpoint.save(tmp_path / "ckpt", model, meta={"config": {"model": "resnet20_cifar10"}})
    assert main([str(tmp_path / "net.onnx"), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    x = np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)
    assert_close(run_onnx(tmp_path / "net.onnx", x), model.forward(x, training=False).astype(np.float32))


def test_cli_model_with_shape_classes_weights(tmp_path, capsys):
    from safetensors.numpy import save_file

    trained = perturb(models.create("resnet20_cifar10", input_shape=(3, 24, 24), num_classes=7,
                                    backend=CPUBackend(seed=9)))
    save_file({k: np.ascontiguousarray(v) for k, v in trained.state_dict().items()}, str(tmp_path / "w.safetensors"))
    out = tmp_path / "net.onnx"
    assert main([str(out), "--model", "resnet20_cifar10", "--input_shape", "3,24,24", "--num_classes", "7",
                 "--weights", str(tmp_path / "w.safetensors"), "--opset", "13"]) == 0
    assert "(N, 7)" in capsys.readouterr().out
    x = np.random.default_rng(0).normal(size=(3, 3, 24, 24)).astype(np.float32)
    assert_close(run_onnx(out, x), trained.forward(x, training=False))
    assert main([str(tmp_path / "fixed.onnx"), "--model", "lenet5", "--batch_size", "2"]) == 0
    assert onnx.load(str(tmp_path / "fixed.onnx")).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2


def test_cli_user_errors_leave_no_file(tmp_path, capsys):
    out = tmp_path / "net.onnx"
    assert_user_error(export_cli(out, "--model", "no_such_net"), "no_such_net")
    assert os.listdir(tmp_path) == []
    for args, word in ((["--model", "simplecnn", "--input_shape", "1,a"], "input_shape"),
                       (["--model", "simplecnn", "--opset", "7"], "opset"),
                       (["--model", "simplecnn", "--input_shape", "1,2,2"], "MaxPool2D"),  # too small to build
                       (["--model", "simplecnn", "--weights", str(tmp_path / "none.safetensors")], "none.safetensors"),
                       ([], "--model")):
        assert main([str(out), *args]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pydtnn: error: ") and word in lines[0], (args, lines)
    assert os.listdir(tmp_path) == []
