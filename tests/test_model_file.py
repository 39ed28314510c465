"""Models from a user's Python file (models/model_file.py), and zoo models changed by path (replace, insert)."""

import os
import runpy
import textwrap

import numpy as np
import pytest

from pydtnn import checkpoint, models
from pydtnn.backends import CPUBackend
from pydtnn.data.synthetic import SyntheticDataset
from pydtnn.errors import ConfigError, ShapeError
from pydtnn.layers import Conv2D, Dense, Dropout, ReLU, Sequential
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.models import model_file
from pydtnn.optim import SGD
from pydtnn.testing import check_gradients
from pydtnn.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE, CLASSES = (2, 8, 8), 3

# a layer of the file's own, with a parameter: y = x * a_c, one scale per channel
SCALED_CNN = '''
import numpy as np
from pydtnn.layers import Conv2D, Dense, Flatten, Layer, ReLU


class ChannelScale(Layer):
    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.add_param("weight", self.xp.ones(input_shape[0], dtype))

    def forward(self, x, training=True):
        self.x = x if training else None
        return x * self.params["weight"].reshape(1, -1, 1, 1)

    def backward(self, dy):
        x = self.take_saved("x")
        self.grads["weight"][...] = (dy * x).sum(axis=(0, 2, 3))
        return dy * self.params["weight"].reshape(1, -1, 1, 1)


def create_model(input_shape, num_classes):
    return {"conv": Conv2D(4, 3, padding=1), "scale": ChannelScale(), "relu": ReLU(), "flat": Flatten(),
            "fc": Dense(num_classes)}
'''


def write(tmp_path, text, name="net.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def synthetic(n=64):
    return SyntheticDataset(n, SHAPE, CLASSES, seed=1)


def fit(model, steps=3, lr=0.1):
    trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=lr, momentum=0.9), progress=False)
    trainer.fit(synthetic(), epochs=1, batch_size=16, steps_per_epoch=steps)
    return trainer


def prelu_class():
    """The PReLU layer of examples/custom_layer.py (its training part runs only as a script)."""
    return runpy.run_path(os.path.join(ROOT, "examples", "custom_layer.py"))["PReLU"]


# -- a model file ------------------------------------------------------------------------------
def test_model_file_with_its_own_layer_trains_through_the_trainer(tmp_path):
    path = write(tmp_path, SCALED_CNN, "scaled_cnn.py")
    backend = CPUBackend(dtype=np.float64, seed=2)
    model = model_file.load(path, SHAPE, CLASSES, backend)
    assert type(model) is Model and model.backend is backend and model.name == "scaled_cnn"
    assert type(model.root.children[1][1]).__name__ == "ChannelScale"
    assert model.output_shape == (CLASSES,)
    assert all(a.dtype == np.float64 for _, a in model.named_state())
    trainer = fit(model)
    scale = model.state_dict()["scale.weight"]
    assert np.isfinite(trainer.history[-1]["loss"])
    assert not np.allclose(scale, 1.0)  # its gradient reached the optimizer


def test_model_file_builds_exactly_what_models_create_builds(tmp_path):
    path = write(tmp_path, """
        from pydtnn import models

        def create_model(input_shape, num_classes):
            return models.layers("simplecnn", input_shape, num_classes)
    """, "zoo.py")
    own = model_file.load(path, (1, 28, 28), 10, CPUBackend(seed=5))
    zoo = models.create("simplecnn", backend=CPUBackend(seed=5))
    assert list(own.state_dict()) == list(zoo.state_dict())
    for name, a in zoo.state_dict().items():
        np.testing.assert_array_equal(own.state_dict()[name], a)
    assert own.name == "zoo" and own.count_params() == zoo.count_params()


def test_model_file_checkpoint_loads_into_the_model_the_file_builds_again(tmp_path):
    path = write(tmp_path, SCALED_CNN, "scaled_cnn.py")
    model = model_file.load(path, SHAPE, CLASSES, CPUBackend(seed=0))
    trainer = fit(model, steps=2)
    checkpoint.save(tmp_path / "ckpt", model, trainer.optimizer)
    again = model_file.load(path, SHAPE, CLASSES, CPUBackend(seed=9))
    checkpoint.load(tmp_path / "ckpt", again)
    assert again.params_sha256() == model.params_sha256()


def test_example_model_file_trains_and_its_layer_has_right_gradients():
    path = os.path.join(ROOT, "examples", "my_model.py")
    swish = runpy.run_path(path)["Swish"]
    check_gradients(swish(), (3, 2, 4, 4))  # float64 central differences
    model = model_file.load(path, SHAPE, CLASSES, CPUBackend(seed=0))
    assert model.name == "my_model"
    before = model.params_sha256()
    trainer = fit(model, steps=2, lr=0.05)
    assert np.isfinite(trainer.history[-1]["loss"]) and model.params_sha256() != before


def _fifo(tmp_path):
    path = tmp_path / "pipe.py"
    os.mkfifo(path)
    return str(path)


def _mkdir(tmp_path):
    path = tmp_path / "folder.py"
    path.mkdir()
    return str(path)


RAISES_IN_HELPER = """\
def helper(width):
    raise ValueError(f"width {width} is odd")


def create_model(input_shape, num_classes):
    return helper(7)
"""

LAYER_BUILD_FAILS = """\
from pydtnn.layers import Flatten, Dense, Layer


class Broken(Layer):
    def build(self, input_shape, dtype=None, backend=None):
        raise RuntimeError("no weights for this shape")


def create_model(input_shape, num_classes):
    return [Broken(), Flatten(), Dense(num_classes)]
"""


@pytest.mark.parametrize("make,expected", [
    (lambda tmp: str(tmp / "missing.py"), "does not exist"),
    (_mkdir, "is a directory"),
    (_fifo, "is a FIFO"),
    (lambda tmp: write(tmp, SCALED_CNN, "net.txt"), "is not a .py file"),
    (lambda tmp: write(tmp, "x = 1\ndef create_model(:\n"), ":2: SyntaxError"),
    (lambda tmp: write(tmp, "import numpy\nimport no_such_module_here\n"), ":2: running it raised ModuleNotFoundError"),
    (lambda tmp: write(tmp, "x = 1\n"), "defines no create_model"),
    (lambda tmp: write(tmp, "create_model = 3\n"), "create_model is int 3, not a function"),
    (lambda tmp: write(tmp, "def create_model():\n    return []\n"), ":1: create_model cannot be called"),
    (lambda tmp: write(tmp, RAISES_IN_HELPER), ":2: create_model raised ValueError: width 7 is odd"),
    (lambda tmp: write(tmp, "def create_model(s, n):\n    [n]\n"),
     "returned None (does create_model end with return?)"),
    (lambda tmp: write(tmp, "def create_model(s, n):\n    return 3\n"), "returned int 3"),
    (lambda tmp: write(tmp, "def create_model(s, n):\n    return []\n"), "returned no layers"),
    (lambda tmp: write(tmp, "from pydtnn.layers import ReLU, Flatten\ndef create_model(s, n):\n"
                            "    return [ReLU, Flatten()]\n"), "layer '0' is type"),
    (lambda tmp: write(tmp, "from pydtnn import models\ndef create_model(s, n):\n"
                            "    return models.create('simplemlp', s, n)\n"), "returned a built Model"),
    (lambda tmp: write(tmp, "from pydtnn.layers import Dense\ndef create_model(s, n):\n    return [Dense(n)]\n"),
     "building the model raised ShapeError"),
    (lambda tmp: write(tmp, LAYER_BUILD_FAILS), ":6: building the model raised RuntimeError: no weights"),
    (lambda tmp: write(tmp, "from pydtnn.layers import Flatten, Dense\ndef create_model(s, n):\n"
                            "    return [Flatten(), Dense(5)]\n"), "outputs of shape (5,) per sample; expected (3,)"),
], ids=[
    "missing", "directory", "fifo", "not_py", "syntax_error", "top_level_raises", "no_create_model",
    "create_model_not_callable", "create_model_signature", "create_model_raises", "returns_none",
    "returns_int", "returns_empty", "layer_class_not_instance", "returns_built_model", "does_not_fit_data",
    "layer_build_raises", "wrong_output_shape"
])
def test_each_mistake_in_a_model_file_is_one_line_naming_the_file(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as e:
        model_file.load(path, SHAPE, CLASSES)
    message = str(e.value)
    assert "\n" not in message and path in message and expected in message, message


def test_a_file_is_run_as_a_module_not_as_a_script(tmp_path):
    path = write(tmp_path, SCALED_CNN + "\nif __name__ == '__main__':\n    raise SystemExit('ran as a script')\n")
    assert model_file.load(path, SHAPE, CLASSES).name == "net"


# -- changing a zoo model by path --------------------------------------------------------------
def resnet20(seed=0):
    return models.create("resnet20_cifar10", input_shape=(3, 8, 8), backend=CPUBackend(seed=seed))


def test_replace_relu_of_resnet20_with_prelu_trains_and_checkpoints(tmp_path):
    PReLU = prelu_class()
    model = resnet20()
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    old = model.replace("layer1.0.relu", PReLU())
    assert type(old) is ReLU
    state = model.state_dict()
    names = list(state)
    assert set(names) - set(before) == {"layer1.0.relu.weight"}
    assert names.index("layer1.0.relu.weight") + 1 == names.index("layer1.1.conv1.weight")  # at its place in the tree
    for name, value in before.items():  # the rest of the model keeps its values
        np.testing.assert_array_equal(state[name], value)
    trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.1, momentum=0.9), progress=False)
    trainer.fit(SyntheticDataset(48, (3, 8, 8), 10, seed=1), epochs=1, batch_size=16, steps_per_epoch=3)
    assert not np.allclose(model.state_dict()["layer1.0.relu.weight"], 0.25)  # trained from PReLU's 0.25
    checkpoint.save(tmp_path / "ckpt", model, trainer.optimizer)
    again = resnet20(seed=3)
    again.replace("layer1.0.relu", PReLU())
    checkpoint.load(tmp_path / "ckpt", again)
    assert again.params_sha256() == model.params_sha256()
    with pytest.raises(ShapeError, match="layer1.0.relu.weight"):  # the unchanged zoo model is another architecture
        checkpoint.load(tmp_path / "ckpt", resnet20())


def test_insert_adds_a_step_and_every_name_and_value_stays():
    model = models.create("simplecnn", backend=CPUBackend(seed=0))
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    model.insert("7", Dropout(0.5), name="drop")
    model.insert("9", Dense(32), name="extra", after=True)
    assert [p for p, _ in model.layers()] == ["0", "1", "2", "3", "4", "5", "6", "drop", "7", "8", "9", "extra"]
    assert model.output_shape == (32,)
    for name, value in before.items():
        np.testing.assert_array_equal(model.state_dict()[name], value)


def test_unbuilt_zoo_tree_changed_in_a_model_file(tmp_path):
    path = write(tmp_path, """
        from pydtnn import models
        from pydtnn.layers import LeakyReLU

        def create_model(input_shape, num_classes):
            tree = models.layers("resnet20_cifar10", input_shape, num_classes)
            tree.replace("relu", LeakyReLU(0.1))
            tree.insert("fc", LeakyReLU(0.2), name="act", after=True)
            return tree
    """, "leaky_resnet.py")
    model = model_file.load(path, (3, 8, 8), 10)
    kinds = {p: (type(l).__name__, getattr(l, "alpha", None)) for p, l in model.layers()}
    assert kinds["relu"] == ("LeakyReLU", 0.1) and kinds["act"] == ("LeakyReLU", 0.2)
    assert [p for p, _ in model.layers()][-2:] == ["fc", "act"]
    assert list(model.state_dict()) == list(resnet20().state_dict())


@pytest.mark.parametrize("path,expected", [
    ("layer1.5.relu", "no layer 'layer1.5.relu': 'layer1' holds 0, 1, 2"),
    ("rleu", "no layer 'rleu': the top level holds conv1, bn1, relu, layer1, layer2, layer3, avgpool, fc"),
    ("layer2.0.conv3", "no layer 'layer2.0.conv3': 'layer2.0' holds conv1, bn1, relu1, conv2, bn2, downsample, relu"),
    ("fc.relu", "no layer 'fc.relu': 'fc' is Dense"),
    ("", "expected the dotted path of a layer in the tree (such as 'conv1'), got ''"),
])
def test_wrong_path_is_one_line_naming_the_path_and_what_is_there(path, expected):
    model = resnet20()
    digest = model.params_sha256()
    for change in (lambda: model.replace(path, ReLU()), lambda: model.insert(path, ReLU())):
        with pytest.raises(ConfigError) as e:
            change()
        assert "\n" not in str(e.value) and str(e.value).startswith("resnet20_cifar10: ") and expected in str(e.value)
    with pytest.raises(ConfigError) as e:  # the same on an unbuilt tree
        models.layers("resnet20_cifar10").replace(path, ReLU())
    assert expected in str(e.value)
    assert model.params_sha256() == digest


def test_layer_that_does_not_fit_leaves_the_model_as_it_was():
    model = models.create("simplecnn", backend=CPUBackend(seed=0))
    x = np.random.default_rng(0).standard_normal((2, 1, 28, 28)).astype(np.float32)
    y, digest = model.forward(x, training=False), model.params_sha256()
    with pytest.raises(ShapeError):
        model.replace("7", Conv2D(8, 3))  # after Flatten: a convolution cannot take (1568,)
    assert type(dict(model.layers())["7"]) is Dense and model.params_sha256() == digest
    np.testing.assert_array_equal(model.forward(x, training=False), y)


def test_insert_where_it_cannot_go_says_why():
    model = resnet20()
    with pytest.raises(ConfigError, match="'layer1.0.identity': it is a path of AdditionBlock"):
        model.insert("layer1.0.identity", ReLU())
    with pytest.raises(ConfigError, match="'avgpool' is already a layer; pass another name="):
        model.insert("fc", ReLU(), name="avgpool")
    with pytest.raises(ConfigError, match="already in the tree at 'relu'"):
        model.replace("fc", dict(model.layers())["relu"])
    tree = Sequential([ReLU()])
    with pytest.raises(TypeError, match="expected a Layer"):
        tree.replace("0", "relu")


# -- from the command line -------------------------------------------------------------------------
def _cli(*args, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pydtnn", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _one_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [s for s in r.stderr.splitlines() if "error:" in s]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_model_file_trains_resumes_and_exports_only_when_named_again(tmp_path):
    """A checkpoint never runs code by itself: resuming or exporting a model-file model takes --model_file again."""
    import subprocess
    import sys

    example = os.path.join(ROOT, "examples", "my_model.py")
    r = _cli("--model_file", example, "--num_epochs", "1", "--steps_per_epoch", "2", "--checkpoint_dir", "ck",
             "--progress", "false", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"pydtnn: model my_model from --model_file {example}, " in r.stderr
    _one_error(_cli("--resume", "ck", "--num_epochs", "2", cwd=tmp_path), "give --model_file", example)
    r = _cli("--resume", "ck", "--num_epochs", "2", "--model_file", example, "--progress", "false", cwd=tmp_path)
    assert r.returncode == 0 and "epoch 2:" in r.stdout, r.stderr[-3000:]
    export = [sys.executable, "-m", "pydtnn.export", "m.onnx", "--checkpoint", "ck"]
    r = subprocess.run(export, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    _one_error(r, "give --model_file")
    r = subprocess.run(export + ["--model_file", example], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    _one_error(r, "of type Swish to ONNX")  # rebuilt from the file; its own layer has no ONNX operator
    _one_error(_cli("--model", "vgg16", "--model_file", example, cwd=tmp_path), "both name the model")
    _one_error(_cli("--simulate", "--model_file", example, cwd=tmp_path), "no cost formula", "Swish")


def test_a_file_of_values_never_names_code_to_run(tmp_path):
    """A checkpoint's config.json is a valid --config file: a model_file in it would run its Python."""
    (tmp_path / "evil.py").write_text("raise SystemExit('ran')\n")
    (tmp_path / "config.json").write_text('{"model_file": "evil.py", "effective": {}}')
    _one_error(_cli("--config", "config.json", "--num_epochs", "1", cwd=tmp_path), "model_file", "runs Python",
               "on the command line")


def test_a_model_file_named_after_a_family_takes_no_recipe(tmp_path):
    """vgg16.py is the user's model, not VGG-16: the plain defaults, and no word on how VGG starts."""
    import shutil

    shutil.copy(os.path.join(ROOT, "examples", "my_model.py"), tmp_path / "vgg16.py")
    r = _cli("--model_file", "vgg16.py", "--num_epochs", "1", "--steps_per_epoch", "1", "--progress", "false",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "one process, batch 64" in r.stderr and "learning rate 0.05;" in r.stderr, r.stderr
    assert "what to expect" not in r.stderr and "schedules: none" in r.stderr
