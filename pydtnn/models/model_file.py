"""A model from the user's own Python file: custom layers, or a changed zoo model, at the command line.

    # my_model.py                                        (pydtnn-train --model_file my_model.py ...)
    from pydtnn.layers import Conv2D, Dense, Flatten, Layer, ReLU

    class Swish(Layer): ...                              # a layer of the file's own

    def create_model(input_shape, num_classes):          # input_shape: (C, H, W) of the data
        return [Conv2D(8, 3, padding=1), Swish(), Flatten(), Dense(num_classes)]

    model = load("my_model.py", (1, 28, 28), 10, backend)   # a built Model named "my_model"

create_model has a zoo builder's contract (models/__init__.py): it returns the layers unbuilt, as a
list, a dict or a Sequential (models.layers(name, input_shape, num_classes) gives a zoo model's, to
change), and `load` builds them as models.create does, so checkpoints, state dicts and export treat
the model as any other. The file runs as a module of its own (its `if __name__ == "__main__":` part
does not run): the bytes read once, imported through importlib as any module is; it is the user's code,
run only when the user names it (never from a checkpoint or a file of values). Every mistake in it is a ConfigError of one line naming the file, and the line where the file's own code
failed: pydtnn-train exits with code 2.
"""

import importlib.abc
import importlib.util
import inspect
import os
import sys
import types

from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError, PydtnnError
from pydtnn.files import read_bytes
from pydtnn.layers import Layer, Sequential
from pydtnn.model import Model

CONTRACT = ("a Python file defining create_model(input_shape, num_classes) that returns the model's layers "
            "(a list, a dict or a Sequential)")
MODULE_PREFIX = "pydtnn_model_file."  # sys.modules name of a loaded file: never a real module's name
_MAX_BYTES = 16 << 20  # source code; a bigger file is a wrong path (a dataset, a checkpoint)


def load(path, input_shape, num_classes, backend=None):
    """Built Model of the layers create_model(input_shape, num_classes) of the file at `path` returns.

    input_shape: a sample's shape without the batch, (C, H, W) for images; num_classes: the model must
    give (num_classes,) scores per sample. backend: as models.create's (CPU float32 seed 0 by default).
    The model is named after the file's stem (my_model.py: "my_model").
    """
    path = os.fspath(path)
    filename = os.path.abspath(path)
    module = _run(path, filename, _read(path))
    shape, classes = tuple(int(s) for s in input_shape), int(num_classes)
    tree = _as_tree(path, _call_create_model(path, filename, module, shape, classes))
    try:
        model = Model(tree, shape, backend if backend is not None else CPUBackend(), name=_stem(path))
    except Exception as e:  # re-raised below unless the file's code or the user caused it
        error = _user_error(path, filename, e, "building the model raised")
        if error is None:  # not from the file's code nor a user's mistake: ours
            raise
        raise error from None
    want = (shape[0], classes) if len(shape) == 1 else (classes,)  # token windows: a score per token and class
    if tuple(model.output_shape) != want:
        what = "per token" if len(shape) == 1 else "per class of the data"
        raise ConfigError(f"model file {path}: the model gives outputs of shape {model.output_shape} per sample; "
                          f"expected {want}, one score {what}: end it with Dense(num_classes)")
    return model


def _stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def _read(path):
    if not path.endswith(".py"):
        raise ConfigError(f"model file {path} is not a .py file; expected {CONTRACT}")
    try:
        return read_bytes(path, "model file", _MAX_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"model file {path} does not exist; expected {CONTRACT}") from None


class _ReadSource(importlib.abc.InspectLoader):
    """importlib's loader for a file's source already read (safely, once, by files.read_bytes): it is
    compiled once, imported as any module is, and no bytecode is written beside it."""

    def __init__(self, filename, source):
        self.filename, self.source, self.code = filename, source, None

    def is_package(self, fullname):
        return False

    def get_source(self, fullname):
        return importlib.util.decode_source(self.source)

    def get_code(self, fullname):
        if self.code is None:
            self.code = self.source_to_code(self.source, self.filename)
        return self.code


def _run(path, filename, source):
    """The file's module, imported (its top level run) under a name no real module has."""
    name = MODULE_PREFIX + _stem(path)
    loader = _ReadSource(filename, source)
    try:
        loader.get_code(name)
    except SyntaxError as e:
        line = f":{e.lineno}" if e.lineno else ""
        raise ConfigError(f"model file {path}{line}: {type(e).__name__}: {_one_line(e.msg)}; expected Python "
                          f"source") from None
    except ValueError as e:  # null bytes (Python 3.11)
        raise ConfigError(f"model file {path} is not Python source: {_one_line(e)}") from None
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, filename, loader=loader))
    sys.modules[name] = module  # where classes defined in it are looked up (dataclasses, inspect)
    try:
        loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (the file's code may raise anything: the user's mistake)
        sys.modules.pop(name, None)
        raise _user_error(path, filename, e, "running it raised", always=True) from None
    return module


def _call_create_model(path, filename, module, shape, classes):
    create = module.__dict__.get("create_model")
    if create is None:
        raise ConfigError(f"model file {path} defines no create_model; expected {CONTRACT}")
    if not callable(create):
        raise ConfigError(f"model file {path}: create_model is {_kind(create)}, not a function; expected {CONTRACT}")
    try:
        inspect.signature(create).bind(shape, classes)
    except TypeError as e:
        line = f":{create.__code__.co_firstlineno}" if isinstance(create, types.FunctionType) else ""
        raise ConfigError(f"model file {path}{line}: create_model cannot be called as create_model(input_shape, "
                          f"num_classes): {e}") from None
    except ValueError:  # no signature to read: the call itself says
        pass
    try:
        return create(shape, classes)
    except Exception as e:  # noqa: BLE001 (as above)
        raise _user_error(path, filename, e, "create_model raised", always=True) from None


def _as_tree(path, result):
    """The Sequential that create_model's result stands for; ConfigError if it is not layers."""
    expected = "expected the model's layers: a list, a dict or a Sequential"
    if isinstance(result, Sequential):
        return result
    if isinstance(result, Model):
        raise ConfigError(f"model file {path}: create_model returned a built Model; return its layers instead "
                          f"(a list, a dict or a Sequential), which are built on the run's backend")
    if isinstance(result, Layer):
        raise ConfigError(f"model file {path}: create_model returned one {result.describe()}; {expected} "
                          f"(e.g. [layer])")
    if isinstance(result, dict):
        items = list(result.items())
    elif isinstance(result, (list, tuple)):
        items = [(c if isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) else (str(i), c))
                 for i, c in enumerate(result)]
    else:
        hint = " (does create_model end with return?)" if result is None else ""
        raise ConfigError(f"model file {path}: create_model returned {_kind(result)}{hint}; {expected}")
    if not items:
        raise ConfigError(f"model file {path}: create_model returned no layers; {expected}")
    for name, layer in items:
        if not isinstance(layer, Layer):
            hint = f" (a class: create one, {layer.__name__}(...))" if isinstance(layer, type) else ""
            raise ConfigError(f"model file {path}: create_model's layer {name!r} is {_kind(layer)}, not a "
                              f"Layer{hint}; {expected} of Layer instances")
    return Sequential(result)


def _user_error(path, filename, error, doing, always=False):
    """ConfigError naming the file, the deepest line of the file's own code that `error` passed through,
    and the error; None where the error passed through none and is no user's mistake (unless always)."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None and not always and not isinstance(error, PydtnnError):
        return None
    text = _one_line(error)
    return ConfigError(f"model file {path}{f':{line}' if line else ''}: {doing} {type(error).__name__}"
                       f"{': ' + text if text else ''}")


def _one_line(value):
    return " ".join(str(value).split())


def _kind(value):
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
