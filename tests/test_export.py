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


def test_dense_over_tokens(tmp_path):
    """(N, T, F) through two Dense layers, with and without bias: MatMul with the transposed weight (and Add)."""
    model = Model([Dense(6), Tanh(), Dense(3, use_bias=False)], (4, 5), backend=CPUBackend(seed=1))
    check_export(perturb(model), tmp_path / "tokens.onnx")


@pytest.mark.parametrize("opset", [17, 18])
def test_transformers(opset, tmp_path):
    """A ViT (patches, class token, positions, blocks, LayerNorm, class-token pooling), a token model
    (ids through an Embedding, a causal block with tanh GELU, mean pooling: ReduceMean's axes an attribute
    before opset 18 and an input from it) and a GPT (logits at every position), each against onnxruntime at
    several batch sizes."""
    from pydtnn.layers import Embedding, LayerNorm, PositionalEmbedding, SequencePool, TransformerBlock

    vit = models.create("vit_tiny_cifar10", input_shape=(1, 28, 28), backend=CPUBackend(seed=1), depth=2)
    tokens = Model([Embedding(17, 8), PositionalEmbedding(), TransformerBlock(8, 2, causal=True, approximate="tanh"),
                    LayerNorm(), SequencePool("mean"), Dense(5)], (6,), backend=CPUBackend(seed=1))
    gpt = models.create("gpt_nano", input_shape=(12,), num_classes=30, backend=CPUBackend(seed=1), depth=2)
    for i, model in enumerate((vit, tokens, gpt)):
        rng = np.random.default_rng(i)
        for _, _, p in model.parameters():  # LayerNorm's, the biases and the class token away from 1 and 0 too
            p[...] = rng.normal(0, 0.3, p.shape)
        path = tmp_path / f"t{i}.onnx"
        to_onnx(model, path, opset=opset)
        for n in (3, 1):
            x = model.random_input(n, rng, np.float32)
            assert_close(run_onnx(path, x), model.forward(x, training=False))


def test_layernorm_before_opset_17_is_refused_and_nothing_written(tmp_path):
    from pydtnn.layers import LayerNorm

    model = Model([Dense(4), LayerNorm()], (3, 5))
    with pytest.raises(ConfigError, match="LayerNormalization needs opset 17 or later; expected --opset 17 or more"):
        to_onnx(model, tmp_path / "ln.onnx", opset=16)
    assert list(tmp_path.iterdir()) == []


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


def train_checkpoint(ckpt, model, batch):
    """Two steps of pydtnn-train on the embedded digits, checkpointed into ckpt."""
    train = subprocess.run([sys.executable, "-m", "pydtnn", "--model", model, "--num_epochs", "1",
                            "--steps_per_epoch", "2", "--batch_size", str(batch), "--checkpoint_dir", str(ckpt),
                            "--progress", "false"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert train.returncode == 0, train.stderr[-3000:]


def test_cli_from_a_checkpoint(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "net.onnx"
    train_checkpoint(ckpt, "simplecnn", 16)
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


# -- the output: checked before any work ----------------------------------------------------------
def one_error_line(capsys):
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pydtnn: error: "), out.err
    return lines[0]


def saved_checkpoint(directory, model, config, data_shape=None):
    """A checkpoint as pydtnn-train leaves it: the three files, and config.json beside them."""
    import json

    checkpoint.save(directory, model, meta={"config": config})
    effective = {"input_shape": list(model.input_shape)}
    if data_shape is not None:
        effective["data_shape"] = list(data_shape)
    (directory / "config.json").write_text(json.dumps({**config, "effective": effective}))
    return directory


def contents(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "meta.json", "config.json",
                                  "model.safetensors.tmp", "meta.json.tmp", "config.json.tmp", "link-to-meta"])
def test_output_that_is_a_file_of_the_checkpoint_is_refused(tmp_path, capsys, name):
    ckpt = saved_checkpoint(tmp_path / "ckpt", models.create("simplemlp"), {"model": "simplemlp"})
    (tmp_path / "link-to-meta").symlink_to(ckpt / "meta.json")
    before = contents(ckpt)
    out = tmp_path / name if name == "link-to-meta" else ckpt / name
    assert main([str(out), "--checkpoint", str(ckpt)]) == 2
    assert "checkpoint file" in one_error_line(capsys)
    assert contents(ckpt) == before


@pytest.mark.parametrize("output,weights", [("w.safetensors", "w.safetensors"), ("hard.onnx", "w.safetensors"),
                                            ("net.onnx", "net.onnx.tmp")])
def test_output_that_is_the_weights_file_is_refused(tmp_path, capsys, output, weights):
    """The weights themselves, a hard link to them, or weights named like the output's temporary file
    (which writing the output would replace first)."""
    from safetensors.numpy import save_file

    model = models.create("simplemlp")
    save_file({k: np.ascontiguousarray(v) for k, v in model.state_dict().items()}, str(tmp_path / weights))
    if output == "hard.onnx":
        os.link(tmp_path / weights, tmp_path / output)
    before = contents(tmp_path)
    assert main([str(tmp_path / output), "--model", "simplemlp", "--weights", str(tmp_path / weights)]) == 2
    assert "weights file" in one_error_line(capsys)
    assert contents(tmp_path) == before


def test_missing_output_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was built before the output was checked")

    monkeypatch.setattr(models, "create", never)
    out = tmp_path / "no" / "such" / "net.onnx"
    assert main([str(out), "--model", "simplemlp"]) == 2
    assert str(tmp_path / "no" / "such") in one_error_line(capsys)
    assert os.listdir(tmp_path) == []


def test_output_that_is_a_fifo_is_refused(tmp_path, capsys):
    os.mkfifo(tmp_path / "net.onnx")
    assert main([str(tmp_path / "net.onnx"), "--model", "simplemlp"]) == 2
    assert "FIFO" in one_error_line(capsys)
    assert os.listdir(tmp_path) == ["net.onnx"]


# -- an input shape too large for the machine -------------------------------------------------------
def test_a_parameter_larger_than_memory_is_refused_before_it_is_allocated():
    """Layer.init compares the parameter's bytes with the memory available; 10^12 inputs to 4096 units
    (16 PB of float32) exceed any machine, so nothing is allocated before the error."""
    from pydtnn.errors import ShapeError

    with pytest.raises(ShapeError, match=r"Dense.*\(4096, 1000000000000\).*smaller input shape"):
        Dense(4096).build((10**12,))


def test_cli_input_shape_too_large_for_memory_is_one_line(tmp_path, capsys):
    out = tmp_path / "net.onnx"
    assert main([str(out), "--model", "simplemlp", "--input_shape", "1,100000,100000"]) == 2
    line = one_error_line(capsys)
    assert "Dense" in line and "(256, 10000000000)" in line and "smaller input shape" in line, line
    assert os.listdir(tmp_path) == []


def test_adaptive_pooling_matrix_over_the_protobuf_limit_is_refused_before_it_is_made():
    """7x7 bins of a 9999x9999 input overlap: the exact matrix would be 18 GiB."""
    model = Model([Conv2D(1, 1), AdaptiveAvgPool2D((7, 7))], (1, 9999, 9999))
    with pytest.raises(ConfigError, match=r"adaptive-pooling matrices for input \(1, 9999, 9999\).*smaller input"):
        to_proto(model)


@pytest.mark.slow
def test_cli_vgg16_for_huge_images_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "net.onnx"), "--model", "vgg16_imagenet", "--input_shape", "3,100000,100000"]) == 2
    line = one_error_line(capsys)
    assert "100000" in line and "smaller input shape" in line, line
    assert os.listdir(tmp_path) == []


# -- the input contract ------------------------------------------------------------------------
def padded_digits_checkpoint(tmp_path):
    """resnet20 trained (here: perturbed) on the embedded digits, as pydtnn-train builds it: 28x28 images
    zero-padded to the 32x32 of its CIFAR-10 variant, one input channel."""
    from pydtnn import data
    from pydtnn.models.families import resolve

    _, test = data.load("mnist5k")
    choice, model = resolve("resnet20", test.input_shape, test.num_classes,
                            build=lambda name, shape: models.create(name, input_shape=shape, num_classes=10,
                                                                    backend=CPUBackend(seed=4)))
    model = perturb(model)
    ckpt = saved_checkpoint(tmp_path / "ckpt", model, {"model": "resnet20", "dataset": "mnist5k"})
    return ckpt, model, choice, test


def props(path):
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_metadata_and_success_line_state_the_input_contract(tmp_path, capsys):
    import json

    from pydtnn.data.pad import PaddedDataset

    ckpt, model, choice, test = padded_digits_checkpoint(tmp_path)
    assert main([str(tmp_path / "net.onnx"), "--checkpoint", str(ckpt)]) == 0
    said = capsys.readouterr().out
    meta = props(tmp_path / "net.onnx")
    pad = PaddedDataset(test, choice.input_shape)
    (c, h, w), (_, h2, w2) = test.input_shape, choice.input_shape
    assert meta["pydtnn.dataset"] == "mnist5k" and meta["pydtnn.preprocessing"] == "outside the graph"
    assert json.loads(meta["pydtnn.normalization"]) == {"scale": test.scale, "mean": None, "std": None}
    assert json.loads(meta["pydtnn.padding"]) == {
        "data_shape": [c, h, w], "input_shape": list(choice.input_shape), "top": pad.top, "left": pad.left,
        "bottom": h2 - h - pad.top, "right": w2 - w - pad.left}
    assert meta["pydtnn.input"].startswith("float32 NCHW (N, 1, 32, 32): mnist5k images, pixels / 255")
    assert "1x28x28 images zero-padded" in meta["pydtnn.input"]
    assert meta["pydtnn.input"] in onnx.load(str(tmp_path / "net.onnx")).doc_string
    assert meta["pydtnn.input"] in said


def cifar_folder(folder, per_file=3, seed=0):
    """CIFAR-10 binary files of random records, laid out as the loader reads them."""
    from pydtnn.data.cifar import LAYOUTS, PIXELS

    rng = np.random.default_rng(seed)
    folder.mkdir()
    for name in LAYOUTS["cifar10"]["train"] + LAYOUTS["cifar10"]["test"]:
        records = rng.integers(0, 256, (per_file, 1 + PIXELS), dtype=np.uint8)
        records[:, 0] %= 10
        (folder / name).write_bytes(records.tobytes())
    return folder


@pytest.mark.parametrize("dataset", ["mnist5k", "cifar10"])
def test_with_preprocessing_takes_raw_images_as_the_trainer_does(tmp_path, capsys, dataset):
    """uint8 images as stored, through the graph, give what the model gives on the batches the data
    pipeline makes of them: scaling, the per-channel normalization (CIFAR) and the zero padding (digits)."""
    from pydtnn import data
    from pydtnn.data.cifar import LAYOUTS, read_records
    from pydtnn.data.pad import PaddedDataset

    if dataset == "mnist5k":
        ckpt, model, choice, test = padded_digits_checkpoint(tmp_path)
        raw = test.x[:6]
        batch = PaddedDataset(test, choice.input_shape).get_batch(np.arange(6))[0]
    else:
        folder = cifar_folder(tmp_path / "cifar")
        _, test = data.load("cifar10", str(folder))
        model = perturb(models.create("resnet20_cifar10", backend=CPUBackend(seed=4)))
        ckpt = saved_checkpoint(tmp_path / "ckpt", model, {"model": "resnet20", "dataset": "cifar10"})
        raw = np.ascontiguousarray(read_records(folder / LAYOUTS["cifar10"]["test"][0])[0])
        batch = test.get_batch(np.arange(len(raw)))[0]
    out = tmp_path / "net.onnx"
    assert main([str(out), "--checkpoint", str(ckpt), "--with_preprocessing"]) == 0
    assert "uint8 NCHW (N, " + ", ".join(map(str, raw.shape[1:])) in capsys.readouterr().out
    graph_input = onnx.load(str(out)).graph.input[0].type.tensor_type
    assert graph_input.elem_type == onnx.TensorProto.UINT8
    assert [d.dim_value for d in graph_input.shape.dim[1:]] == list(raw.shape[1:])
    assert props(out)["pydtnn.preprocessing"] == "in the graph"
    assert_close(run_onnx(out, raw), model.forward(batch, training=False))


def test_with_preprocessing_for_a_zoo_model_needs_a_dataset_of_images(tmp_path, capsys, monkeypatch):
    from pydtnn import data
    from pydtnn.data.pad import PaddedDataset
    from pydtnn.models.families import resolve

    out = tmp_path / "net.onnx"
    create = models.create
    monkeypatch.setattr(models, "create", lambda *a, **k: pytest.fail("a model was built before the flags were "
                                                                      "checked"))
    for args, word in ((["--model", "resnet20", "--with_preprocessing"], "--dataset"),
                       (["--model", "resnet20", "--dataset", "synthetic", "--with_preprocessing"], "synthetic"),
                       (["--model", "resnet20", "--dataset", "mnist55", "--with_preprocessing"], "mnist5k")):
        assert main([str(out), *args]) == 2, args
        assert word in one_error_line(capsys), args
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(models, "create", create)

    # with --dataset, the model is the one pydtnn-train builds for that data (28x28 padded to 32x32)
    assert main([str(out), "--model", "resnet20", "--dataset", "mnist5k", "--with_preprocessing"]) == 0
    _, test = data.load("mnist5k")
    choice, model = resolve("resnet20", test.input_shape, 10,
                            build=lambda name, shape: models.create(name, input_shape=shape, num_classes=10))
    batch = PaddedDataset(test, choice.input_shape).get_batch(np.arange(4))[0]
    assert_close(run_onnx(out, test.x[:4]), model.forward(batch, training=False))

    # without --dataset the contract is unknown, and says so
    assert main([str(tmp_path / "plain.onnx"), "--model", "lenet5"]) == 0
    assert "not recorded" in props(tmp_path / "plain.onnx")["pydtnn.input"]
    assert "pydtnn.dataset" not in props(tmp_path / "plain.onnx")


def test_checkpoint_without_a_dataset_takes_dataset_flag(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, models.create("lenet5"), meta={"config": {"model": "lenet5"}})
    assert main([str(tmp_path / "a.onnx"), "--checkpoint", str(ckpt), "--with_preprocessing"]) == 2
    assert "--dataset" in one_error_line(capsys)
    assert main([str(tmp_path / "a.onnx"), "--checkpoint", str(ckpt), "--dataset", "fashion_mnist",
                 "--with_preprocessing"]) == 0
    assert props(tmp_path / "a.onnx")["pydtnn.dataset"] == "fashion_mnist"
    trained = saved_checkpoint(tmp_path / "trained", models.create("lenet5"), {"model": "lenet5", "dataset": "mnist"})
    assert main([str(tmp_path / "b.onnx"), "--checkpoint", str(trained), "--dataset", "cifar10"]) == 2
    assert "trained on mnist" in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["a.onnx", "ckpt", "trained"]


def test_recorded_data_shape_decides_the_padding(tmp_path):
    """ImageNet shards of 28x28 images, padded by the trainer to resnet20's 32x32: config.json's
    effective data_shape says so, where the dataset's usual size (224x224) cannot."""
    import json

    model = models.create("resnet20_cifar10")
    config = {"model": "resnet20", "dataset": "imagenet"}
    recorded = saved_checkpoint(tmp_path / "recorded", model, config, data_shape=(3, 28, 28))
    unrecorded = saved_checkpoint(tmp_path / "unrecorded", model, config)
    assert main([str(tmp_path / "a.onnx"), "--checkpoint", str(recorded)]) == 0
    assert main([str(tmp_path / "b.onnx"), "--checkpoint", str(unrecorded)]) == 0
    a, b = (json.loads(props(tmp_path / f)["pydtnn.padding"]) for f in ("a.onnx", "b.onnx"))
    assert a["data_shape"] == [3, 28, 28] and (a["top"], a["left"], a["bottom"], a["right"]) == (2, 2, 2, 2)
    assert b["data_shape"] == [3, 32, 32] and (b["top"], b["left"], b["bottom"], b["right"]) == (0, 0, 0, 0)
    from pydtnn.data.imagenet import IMAGENET_MEAN, IMAGENET_STD

    norm = json.loads(props(tmp_path / "a.onnx")["pydtnn.normalization"])
    assert norm["mean"] == list(IMAGENET_MEAN) and norm["std"] == list(IMAGENET_STD)


@pytest.mark.slow
def test_cli_trained_checkpoint_with_preprocessing(tmp_path):
    """pydtnn-train on the digits with a family that pads them, then the export takes raw digits."""
    from pydtnn import data
    from pydtnn.data.pad import PaddedDataset

    ckpt, out = tmp_path / "ckpt", tmp_path / "net.onnx"
    train_checkpoint(ckpt, "resnet20", 8)
    r = export_cli(out, "--checkpoint", ckpt, "--with_preprocessing")
    assert r.returncode == 0, r.stderr
    assert "uint8 NCHW (N, 1, 28, 28): mnist5k images" in r.stdout
    from pydtnn.export import model_from_checkpoint

    model = model_from_checkpoint(str(ckpt))
    _, test = data.load("mnist5k")
    batch = PaddedDataset(test, model.input_shape).get_batch(np.arange(5))[0]
    assert_close(run_onnx(out, test.x[:5]), model.forward(batch, training=False))
