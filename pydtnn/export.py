"""ONNX export of a built Model, for inference: BatchNorm uses its running statistics, Dropout is the identity.

    from pydtnn.export import to_onnx
    to_onnx(model, "net.onnx")          # input "input" (N, C, H, W), output "output" (N, classes)

    contract = input_contract("mnist5k", model.input_shape)      # what the input holds, for the metadata
    to_onnx(model, "net.onnx", contract=contract, with_preprocessing=True)   # input: uint8 images as stored

    pydtnn-export net.onnx --checkpoint DIR                  # a checkpoint written by pydtnn-train
    pydtnn-export net.onnx --model resnet18_imagenet --input_shape 3,64,64 [--weights w.safetensors]
    pydtnn-export net.onnx --checkpoint DIR --with_preprocessing     # takes raw uint8 images

The graph is float32 (a float64 model's weights are rounded to float32), NCHW, with a dynamic batch
dimension "N" unless batch_size is given. Initializers carry the state-dict names
(features.0.weight, layer1.0.bn1.running_var); nodes are named after their layer's path. Each layer
type maps to standard operators (opset 13 or later): Conv2D -> Conv, Dense -> Gemm, BatchNorm ->
BatchNormalization, pools -> MaxPool / AveragePool (count_include_pad=1, as pydtnn divides by the
whole window) / GlobalAveragePool, blocks -> Sum / Concat. AdaptiveAvgPool2D is exported for the
input size the model was built for: an AveragePool when the bins are equal, otherwise (overlapping
or repeated bins) a MatMul with the exact bin-averaging matrix.

The input contract: the trainer feeds a model its dataset's uint8 pixels times 1/255, minus a
per-channel mean and divided by a std where the dataset has them (CIFAR, ImageNet), zero-padded
(black) up to the model's input when a family variant was built for larger images (28x28 digits
for a 32x32 network). The graph records that in its metadata_props ("pydtnn.input",
"pydtnn.dataset", "pydtnn.normalization", "pydtnn.padding", "pydtnn.preprocessing") and doc_string;
with_preprocessing puts it into the graph itself (Cast, Pad, Mul, Sub, Div), which then takes the
dataset's images as stored.

`onnx` is imported only here, when an export runs: `import pydtnn` does not need it.
"""

import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from pydtnn.errors import ConfigError, DataError, PydtnnError
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
    LeakyReLU,
    MaxPool2D,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)

MIN_OPSET = 13  # Softmax over one axis (opset 13); Clip with min/max inputs (opset 11)
INPUT, OUTPUT = "input", "output"
_PROTOBUF_LIMIT = 2**31 - 1  # bytes: one ONNX file without external data


def _import_onnx():
    try:
        import onnx
    except ImportError:
        raise ConfigError("ONNX export needs the onnx package: pip install onnx (or pip install -e '.[onnx]')") from None
    return onnx


# -- the graph under construction ---------------------------------------------------------------
class _Graph:
    """Nodes and initializers in the order they are made; every tensor name is unique."""

    def __init__(self, onnx):
        self.helper, self.numpy_helper = onnx.helper, onnx.numpy_helper
        self.nodes, self.initializers, self.used = [], [], {INPUT}
        self._constants = {}

    def fresh(self, base):
        name, i = base or "t", 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name

    def weight(self, name, array):
        """A float32 initializer under its state-dict name."""
        self.used.add(name)
        self.initializers.append(self.numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name))
        return name

    def constant(self, base, array):
        """A constant initializer (shapes, clip bounds), shared between nodes that use the same value."""
        array = np.asarray(array)
        key = (base, array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.fresh(base)
            self.initializers.append(self.numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def node(self, op, inputs, base, **attrs):
        """Append one node; returns the name of its (single) output."""
        out = self.fresh(base)
        self.nodes.append(self.helper.make_node(op, list(inputs), [out], name=out, **attrs))
        return out


def _state_name(layer, key):
    return f"{layer.path}.{key}" if layer.path else key


def _numpy(layer, key, buffers=False):
    a = (layer.buffers if buffers else layer.params)[key]
    return layer.backend.to_numpy(a)


def _label(layer, what):
    return layer.path or what


# -- one exporter per layer type: (graph, layer, input name) -> output name ---------------------
def _sequential(g, layer, x):
    for _, child in layer.children:
        x = _export(g, child, x)
    return x


def _addition(g, layer, x):
    outs = [_export(g, path, x) for _, path in layer.children]
    if len(outs) == 1:
        return g.node("Identity", outs, _label(layer, "add"))
    return g.node("Sum", outs, _label(layer, "add"))


def _concatenation(g, layer, x):
    outs = [_export(g, path, x) for _, path in layer.children]
    return g.node("Concat", outs, _label(layer, "concat"), axis=1)


def _conv(g, layer, x):
    geo = layer.geometry
    inputs = [x, g.weight(_state_name(layer, "weight"), _numpy(layer, "weight"))]
    if layer.use_bias:
        inputs.append(g.weight(_state_name(layer, "bias"), _numpy(layer, "bias")))
    return g.node("Conv", inputs, _label(layer, "conv"), kernel_shape=[geo.kh, geo.kw], strides=[geo.sh, geo.sw],
                  dilations=[geo.dh, geo.dw], pads=[geo.pt, geo.pl, geo.pb, geo.pr], group=layer.groups)


def _dense(g, layer, x):
    inputs = [x, g.weight(_state_name(layer, "weight"), _numpy(layer, "weight"))]
    if layer.use_bias:
        inputs.append(g.weight(_state_name(layer, "bias"), _numpy(layer, "bias")))
    return g.node("Gemm", inputs, _label(layer, "dense"), transB=1)


def _batchnorm(g, layer, x):
    inputs = [x] + [g.weight(_state_name(layer, k), _numpy(layer, k)) for k in ("weight", "bias")]
    inputs += [g.weight(_state_name(layer, k), _numpy(layer, k, buffers=True)) for k in ("running_mean", "running_var")]
    return g.node("BatchNormalization", inputs, _label(layer, "batchnorm"), epsilon=layer.eps)


def _pool(op, **extra):
    def export(g, layer, x):
        # the geometry holds the padding actually applied, ceil_mode's extra bottom/right rows included
        geo = layer.geometry
        return g.node(op, [x], _label(layer, "pool"), kernel_shape=[geo.kh, geo.kw], strides=[geo.sh, geo.sw],
                      pads=[geo.pt, geo.pl, geo.pb, geo.pr], **extra)

    return export


def _global_avgpool(g, layer, x):
    y = g.node("GlobalAveragePool", [x], _label(layer, "avgpool") + "/pool")
    return g.node("Flatten", [y], _label(layer, "avgpool"), axis=1)


def _adaptive_avgpool(g, layer, x):
    """Exact for the built input size: nothing, a global or a uniform average pool, or, when bins
    differ in size or overlap, a MatMul of the (N, C, H*W) view with the bin-averaging matrix."""
    c, h, w = layer.input_shape
    oh, ow = layer.output_size
    name = _label(layer, "avgpool")
    if layer.identity:
        return x
    if (oh, ow) == (1, 1):
        return g.node("GlobalAveragePool", [x], name)
    if h % oh == 0 and w % ow == 0:
        k = [h // oh, w // ow]
        return g.node("AveragePool", [x], name, kernel_shape=k, strides=k)
    bins = np.zeros((h, w, oh, ow), np.float32)
    for i, (r0, r1) in enumerate(layer.rows):
        for j, (c0, c1) in enumerate(layer.cols):
            bins[r0:r1, c0:c1, i, j] = 1.0 / ((r1 - r0) * (c1 - c0))
    flat = g.node("Reshape", [x, g.constant("shape", np.array([0, c, h * w], np.int64))], name + "/flatten")
    pooled = g.node("MatMul", [flat, g.constant(name + ".bins", bins.reshape(h * w, oh * ow))], name + "/bins")
    return g.node("Reshape", [pooled, g.constant("shape", np.array([0, c, oh, ow], np.int64))], name)


def _adaptive_matrix_bytes(layer):
    """Bytes of the float32 bin-averaging matrix _adaptive_avgpool stores for `layer` (0 when it needs none)."""
    c, h, w = layer.input_shape
    oh, ow = layer.output_size
    if layer.identity or (oh, ow) == (1, 1) or (h % oh == 0 and w % ow == 0):
        return 0
    return h * w * oh * ow * 4


def _clip6(g, layer, x):
    lo, hi = g.constant("zero", np.array(0, np.float32)), g.constant("six", np.array(6, np.float32))
    return g.node("Clip", [x, lo, hi], _label(layer, "relu6"))


def _simple(op, what, **attrs):
    def export(g, layer, x):
        return g.node(op, [x], _label(layer, what), **attrs)

    return export


def _leaky_relu(g, layer, x):
    return g.node("LeakyRelu", [x], _label(layer, "leakyrelu"), alpha=layer.alpha)


def _identity(g, layer, x):
    return x


_EXPORTERS = {  # exact types: a subclass may compute something else, so it is refused, not guessed
    Sequential: _sequential,
    AdditionBlock: _addition,
    ConcatenationBlock: _concatenation,
    Conv2D: _conv,
    Dense: _dense,
    BatchNorm: _batchnorm,
    MaxPool2D: _pool("MaxPool"),
    AvgPool2D: _pool("AveragePool", count_include_pad=1),
    GlobalAvgPool2D: _global_avgpool,
    AdaptiveAvgPool2D: _adaptive_avgpool,
    Dropout: _identity,
    Flatten: _simple("Flatten", "flatten", axis=1),
    ReLU: _simple("Relu", "relu"),
    ReLU6: _clip6,
    LeakyReLU: _leaky_relu,
    Sigmoid: _simple("Sigmoid", "sigmoid"),
    Tanh: _simple("Tanh", "tanh"),
    Softmax: _simple("Softmax", "softmax", axis=1),
}


def _export(g, layer, x):
    fn = _EXPORTERS.get(type(layer))
    if fn is None:
        raise ConfigError(f"cannot export layer {layer.path or '(root)'!r} of type {type(layer).__name__} to ONNX; "
                          f"expected one of {', '.join(sorted(t.__name__ for t in _EXPORTERS))}")
    return fn(g, layer, x)


# -- what the input holds ----------------------------------------------------------------------
@dataclass(frozen=True)
class InputContract:
    """What the graph's input holds: a dataset's images as the trainer fed them to the model.

    The model's float32 input is (pixels * scale - mean) / std per channel, where pixels are the
    dataset's uint8 images of data_shape (C, H, W), zero-padded (black pixels, before normalization)
    by pads = (top, left, bottom, right) rows and columns, centred, up to the model's input shape.
    mean, std: (C,) tuples, or None where the dataset applies none. scale None: data without pixels
    (synthetic), of which only the name is known.
    """

    dataset: str
    data_shape: tuple
    scale: float = None
    mean: tuple = None
    std: tuple = None
    pads: tuple = (0, 0, 0, 0)

    def input_shape(self):
        """(C, H, W) of the model's input: data_shape plus the padding."""
        c, h, w = self.data_shape
        t, left, b, r = self.pads
        return c, h + t + b, w + left + r

    def formula(self):
        """The float input in words: 'pixels / 255, minus mean (...), divided by std (...) per channel'."""
        inverse = 1 / self.scale
        parts = [f"pixels / {round(inverse)}" if abs(inverse - round(inverse)) < 1e-9 * inverse
                 else f"pixels * {self.scale:g}"]
        if self.mean is not None:
            parts.append(f"minus mean ({', '.join(f'{m:g}' for m in self.mean)})")
        if self.std is not None:
            parts.append(f"divided by std ({', '.join(f'{v:g}' for v in self.std)})")
        return ", ".join(parts) + (" per channel" if self.mean is not None or self.std is not None else "")

    def padding(self):
        """The padding in words: 'to 1x32x32 (2 rows top, 2 bottom, 2 columns left, 2 right)'; '' when none."""
        if not any(self.pads):
            return ""
        t, left, b, r = self.pads
        return (f"to {_dims(self.input_shape(), 'x')} ({t} rows top, {b} bottom, {left} columns left, "
                f"{r} right)")


def _dims(shape, sep=", "):
    return sep.join(str(int(s)) for s in shape)


def describe_input(contract, input_shape, with_preprocessing=False, batch="N"):
    """One sentence: what the graph's input "input" holds (dtype, layout, shape, and the pixels' transform)."""
    if contract is None:
        return (f"float32 NCHW ({batch}, {_dims(input_shape)}); the data the model was trained on is not recorded "
                f"(export with --dataset NAME to record it)")
    if contract.scale is None:
        return f"float32 NCHW ({batch}, {_dims(input_shape)}): {contract.dataset} data as generated, not normalized"
    if with_preprocessing:
        pad = f"zero-pads them (black pixels), centred, {contract.padding()}, then " if any(contract.pads) else ""
        return (f"uint8 NCHW ({batch}, {_dims(contract.data_shape)}): {contract.dataset} images as stored, pixels "
                f"0..255; the graph itself {pad}computes {contract.formula()}")
    pad = (f"; {_dims(contract.data_shape, 'x')} images zero-padded (black pixels, before normalization), centred, "
           f"{contract.padding()}") if any(contract.pads) else ""
    return f"float32 NCHW ({batch}, {_dims(input_shape)}): {contract.dataset} images, {contract.formula()}{pad}"


def metadata(contract, input_shape, with_preprocessing=False):
    """The graph's metadata_props: "pydtnn.input" (describe_input), and where the data is known
    "pydtnn.dataset", "pydtnn.preprocessing" ("in the graph" or "outside the graph"), and as JSON
    "pydtnn.normalization" {scale, mean, std} (float input = (pixels * scale - mean) / std per
    channel; null: not applied) and "pydtnn.padding" {data_shape, input_shape, top, left, bottom, right}."""
    props = {"pydtnn.input": describe_input(contract, input_shape, with_preprocessing)}
    if contract is None:
        return props
    props["pydtnn.dataset"] = contract.dataset
    if contract.scale is None:
        return props
    t, left, b, r = contract.pads
    props["pydtnn.preprocessing"] = "in the graph" if with_preprocessing else "outside the graph"
    props["pydtnn.normalization"] = json.dumps({"scale": contract.scale,
                                               "mean": None if contract.mean is None else list(contract.mean),
                                               "std": None if contract.std is None else list(contract.std)})
    props["pydtnn.padding"] = json.dumps({"data_shape": list(contract.data_shape),
                                          "input_shape": list(contract.input_shape()),
                                          "top": t, "left": left, "bottom": b, "right": r})
    return props


@dataclass(frozen=True)
class _Pixels:
    """How a dataset's loader turns its uint8 images (usually of `shape`) into the model's input."""

    scale: float
    mean: tuple
    std: tuple
    shape: tuple
    classes: int


def _pixels(dataset):
    """_Pixels of `dataset` (a pydtnn.data name), read from its loader's constants; None for synthetic
    data (no pixels). ConfigError for a name pydtnn.data does not know."""
    from pydtnn.data import cifar, imagenet
    from pydtnn.data.datasets import NAMES, SHAPES
    from pydtnn.suggest import did_you_mean

    if dataset in cifar.LAYOUTS:
        spec = cifar.LAYOUTS[dataset]
        return _Pixels(1 / 255, spec["mean"], spec["std"], *SHAPES[dataset])
    if dataset == "imagenet":  # ImageFolder's evaluation view: shorter side resized to 256, centre 224x224 crop
        return _Pixels(1 / 255, imagenet.IMAGENET_MEAN, imagenet.IMAGENET_STD, SHAPES[dataset][0], None)
    if dataset in ("mnist5k", "mnist", "fashion_mnist"):  # IDX files: grey images, scaled only
        return _Pixels(1 / 255, None, None, *SHAPES[dataset])
    if dataset == "synthetic":
        return None
    raise ConfigError(f"unknown dataset {dataset!r}{did_you_mean(str(dataset), NAMES) or ';'} expected one of "
                      f"{', '.join(NAMES)}")


def input_contract(dataset, input_shape, data_shape=None):
    """InputContract of a model taking `input_shape` (C, H, W), trained on `dataset` (a pydtnn.data name).

    data_shape: (C, H, W) of the dataset's images; by default its usual size where the trainer pads
    that to input_shape (models/families.py's rule), else input_shape itself (the trainer builds the
    model for the data's own size unless it pads). The padding is the one pydtnn.data.pad's
    PaddedDataset applies. ConfigError for an unknown dataset, or images the trainer could not have
    given this model (other channels, larger than its input).
    """
    from pydtnn.data.dataset import ArrayDataset
    from pydtnn.data.pad import PaddedDataset
    from pydtnn.models.families import MAX_PAD_AREA

    input_shape = tuple(int(s) for s in input_shape)
    pixels = _pixels(dataset)
    if pixels is None:
        return InputContract(dataset, input_shape)
    if len(input_shape) != 3 or input_shape[0] != pixels.shape[0]:
        raise ConfigError(f"dataset {dataset} has {_dims(pixels.shape, 'x')} images; the model takes input "
                          f"{input_shape}, not images of {pixels.shape[0]} channel{'s' * (pixels.shape[0] > 1)}: "
                          f"give the dataset it was trained on")
    if data_shape is None:
        (_, h, w), (_, h2, w2) = pixels.shape, input_shape
        fits = h <= h2 and w <= w2 and h2 * w2 <= MAX_PAD_AREA * h * w
        data_shape = pixels.shape if fits else input_shape
    data_shape = tuple(int(s) for s in data_shape)
    images = ArrayDataset(np.zeros((1, *data_shape), np.uint8), np.zeros(1, np.int64), 1, pixels.scale,
                          pixels.mean, pixels.std, name=dataset)
    padded = PaddedDataset(images, input_shape)  # the trainer's padding; ConfigError for shapes it cannot pad
    _, h, w = data_shape
    pads = (padded.top, padded.left, input_shape[1] - h - padded.top, input_shape[2] - w - padded.left)
    return InputContract(dataset, data_shape, pixels.scale, pixels.mean, pixels.std, pads)


def _preprocessing(g, contract, x, float_type):
    """Nodes from uint8 images (N, *data_shape) to the model's float32 input, in the trainer's order:
    Cast, Pad (zeros: black pixels), Mul by scale, Sub mean, Div std (float32, as the data loaders do)."""
    x = g.node("Cast", [x], "preprocessing/cast", to=float_type)
    if any(contract.pads):
        t, left, b, r = contract.pads
        x = g.node("Pad", [x, g.constant("preprocessing.pads", np.array([0, 0, t, left, 0, 0, b, r], np.int64))],
                   "preprocessing/pad")
    x = g.node("Mul", [x, g.constant("preprocessing.scale", np.array(contract.scale, np.float32))],
               "preprocessing/scale")
    c = contract.data_shape[0]
    if contract.mean is not None:
        mean = np.array(contract.mean, np.float32).reshape(1, c, 1, 1)
        x = g.node("Sub", [x, g.constant("preprocessing.mean", mean)], "preprocessing/mean")
    if contract.std is not None:
        std = np.array(contract.std, np.float32).reshape(1, c, 1, 1)
        x = g.node("Div", [x, g.constant("preprocessing.std", std)], "preprocessing/std")
    return x


# -- the model ----------------------------------------------------------------------------------
def to_proto(model, opset=17, batch_size=None, contract=None, with_preprocessing=False):
    """onnx.ModelProto of a built Model, checked with onnx.checker (full check: shapes inferred and compared).

    contract: the InputContract of the data the model was trained on (None: not known), recorded in
    the graph's metadata_props (see metadata) and doc_string. with_preprocessing: the graph takes
    the dataset's uint8 images (N, *contract.data_shape) and applies the contract itself.
    Raises ConfigError for an opset out of range, a bad batch size, a layer type with no ONNX
    equivalent (naming the layer and its type), a model over protobuf's 2 GB, a missing onnx, or
    with_preprocessing without a contract of pixels that pad to the model's input shape.
    """
    proto = _build(model, opset, batch_size, contract, with_preprocessing)
    _import_onnx().checker.check_model(proto, full_check=True)
    return proto


def to_onnx(model, path, opset=17, batch_size=None, contract=None, with_preprocessing=False):
    """Write `model` (a built Model) to `path` as an ONNX graph for inference; returns the path.

    Input "input" (N, *model.input_shape) float32, or with_preprocessing (N, *contract.data_shape)
    uint8; output "output" (N, *model.output_shape) float32; N is dynamic unless batch_size is given.
    The graph is checked as to_proto says before the file appears, and written under a temporary
    name in the same folder, then renamed: a failure leaves no file (and an older file at `path` as
    it was). The folder must exist.
    """
    from pydtnn.files import write_atomic

    data = _build(model, opset, batch_size, contract, with_preprocessing).SerializeToString()
    _import_onnx().checker.check_model(data, full_check=True)  # the bytes: serialized once, not twice
    write_atomic(path, data)
    return path


def _build(model, opset, batch_size, contract=None, with_preprocessing=False):
    from pydtnn import __version__
    from pydtnn.model import Model

    onnx = _import_onnx()
    helper = onnx.helper
    if not isinstance(model, Model):
        raise TypeError(f"to_onnx expects a built pydtnn.model.Model, got {type(model).__name__}")
    if contract is not None and not isinstance(contract, InputContract):
        raise TypeError(f"contract: expected an InputContract (input_contract()), got {type(contract).__name__}")
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, (int, np.integer)) or not MIN_OPSET <= opset <= newest:
        raise ConfigError(f"ONNX opset {opset!r} is not supported; expected an integer from {MIN_OPSET} to {newest} "
                          f"(the newest this onnx {onnx.__version__} knows)")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ConfigError(f"batch_size {batch_size!r} is not valid; expected a positive integer, or None for a dynamic batch")
    if with_preprocessing:
        if contract is None or contract.scale is None:
            raise ConfigError(f"preprocessing in the graph needs the images the model was trained on; "
                              f"{'synthetic data has no pixels' if contract is not None else 'no dataset is known'}: "
                              f"expected a dataset of images ({_image_datasets()})")
        if tuple(contract.input_shape()) != tuple(model.input_shape):
            raise ConfigError(f"{contract.dataset} images {_dims(contract.data_shape, 'x')} padded by {contract.pads} "
                              f"give {_dims(contract.input_shape(), 'x')}; the model takes "
                              f"{_dims(model.input_shape, 'x')}")
    size = sum(int(np.prod(a.shape)) * 4 for _, a in model.named_state())
    pooling = sum(_adaptive_matrix_bytes(layer) for _, layer in model.root.named_layers()
                  if type(layer) is AdaptiveAvgPool2D)
    if size + pooling > _PROTOBUF_LIMIT:  # checked before the graph allocates any of it
        what = f" and {pooling / 2**30:.1f} GiB of adaptive-pooling matrices for input {model.input_shape}"
        what *= bool(pooling)
        raise ConfigError(f"model {model.name!r} has {size / 2**30:.1f} GiB of float32 state{what}; an ONNX file "
                          f"without external data holds at most 2 GiB: export it for a smaller input shape")

    g = _Graph(onnx)
    x = _preprocessing(g, contract, INPUT, onnx.TensorProto.FLOAT) if with_preprocessing else INPUT
    y = _export(g, model.root, x)
    if y == x:  # the model is the identity (e.g. only Dropout)
        y = g.node("Identity", [x], OUTPUT)
    for node in g.nodes:  # the last value computed becomes the graph's output; nothing consumes it
        node.output[:] = [OUTPUT if o == y else o for o in node.output]

    batch = "N" if batch_size is None else int(batch_size)
    if with_preprocessing:
        given = helper.make_tensor_value_info(INPUT, onnx.TensorProto.UINT8, [batch, *contract.data_shape])
    else:
        given = helper.make_tensor_value_info(INPUT, onnx.TensorProto.FLOAT, [batch, *model.input_shape])
    graph = helper.make_graph(
        g.nodes, model.name, [given],
        [helper.make_tensor_value_info(OUTPUT, onnx.TensorProto.FLOAT, [batch, *model.output_shape])],
        initializer=g.initializers,
    )
    opsets = [helper.make_opsetid("", int(opset))]
    described = describe_input(contract, model.input_shape, with_preprocessing, batch)
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="pydtnn", producer_version=__version__,
                              doc_string=f"pydtnn model {model.name}, inference mode. Input: {described}")
    helper.set_model_props(proto, metadata(contract, model.input_shape, with_preprocessing))
    proto.ir_version = helper.find_min_ir_version_for(opsets)  # readable by the oldest runtime that has the opset
    return proto


def _image_datasets():
    """The names of pydtnn.data's datasets of images (all but synthetic data), comma-separated."""
    from pydtnn.data.datasets import NAMES

    return ", ".join(n for n in NAMES if _pixels(n) is not None)


# -- pydtnn-export ------------------------------------------------------------------------------
def model_from_checkpoint(directory, manifest=None, model_file=None):
    """The Model saved in a checkpoint directory (its architecture, input shape, classes and dtype), weights loaded.

    The manifest (read from the directory unless given) names the architecture and its input shape;
    the number of classes is the one whose state-dict fingerprint matches the checkpoint's (the
    dataset's default, or the size of the classifier's last tensor). A model trained from a model file
    (--model_file) is rebuilt by `model_file`, which the caller gives: a checkpoint never names code to run.
    """
    from pydtnn import checkpoint, models
    from pydtnn.backends import CPUBackend

    if manifest is None:
        manifest = checkpoint.read_manifest(directory)
    where = os.path.join(directory, checkpoint.META_FILE)
    saved_file = _saved_flags(manifest, where).get("model_file")
    if isinstance(saved_file, str) and model_file is None:
        raise ConfigError(f"checkpoint {directory} holds the model of --model_file {saved_file[:300]}; a checkpoint "
                          f"never runs code by itself: give --model_file {saved_file[:300]} to export it")
    if model_file is not None:
        from pydtnn.models import model_file as from_file

        def create(name, input_shape, num_classes, backend):
            return from_file.load(model_file, input_shape, num_classes if num_classes is not None else 10, backend)
    else:
        create = None
    saved = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    name = saved.get("name")
    if not isinstance(name, str) or name == "model":  # a Model built by hand: fall back on the run's flags
        name = _saved_flags(manifest, where).get("model")
    if not isinstance(name, str):
        raise ConfigError(f"{where} does not name the model's architecture; export with --model NAME --weights "
                          f"{os.path.join(directory, checkpoint.MODEL_FILE)}")
    shape, dtype, state = saved.get("input_shape"), saved.get("dtype", "float32"), saved.get("state")
    if not (isinstance(shape, list) and shape and all(isinstance(s, int) and s > 0 for s in shape)):
        raise ConfigError(f"{where}: model input_shape {shape!r} is not a list of positive integers")
    if dtype not in ("float32", "float64"):
        raise ConfigError(f"{where}: model dtype {dtype!r}; expected float32 or float64")
    candidates = [None]
    if isinstance(state, list) and state and isinstance(state[-1], list) and len(state[-1]) > 1:
        last = state[-1][1]
        if isinstance(last, list) and last and isinstance(last[0], int) and last[0] > 0:
            candidates.append(last[0])
    if create is not None and len(candidates) < 2:
        raise ConfigError(f"{where}: cannot tell the classes of the model of --model_file {model_file} (its state "
                          f"ends in no classifier tensor)")
    for classes in candidates[1:] if create is not None else candidates:  # a file has no default classes
        if create is not None:
            model = create(name, shape, classes, CPUBackend(dtype=dtype))
        else:
            model = models.create(name, input_shape=shape, num_classes=classes, backend=CPUBackend(dtype=dtype))
        if state is None or checkpoint.fingerprint(model) == state:
            break
    checkpoint.load(directory, model)  # validates everything; a different architecture is a ShapeError naming it
    return model


def _saved_flags(manifest, where):
    """The run's flags stored in a checkpoint's manifest (meta "config"); {} when it has none."""
    config = manifest["meta"].get("config", {})
    if not isinstance(config, dict):
        raise DataError(f"{where} is corrupt: its 'config' is a {type(config).__name__}; expected an object of "
                        f"flag values")
    return config


def trained_on(manifest, where):
    """The dataset a checkpoint's run trained on ("synthetic" with --use_synthetic_data); None if not recorded."""
    config = _saved_flags(manifest, where)
    if config.get("use_synthetic_data") is True:
        return "synthetic"
    dataset = config.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise DataError(f"{where} is corrupt: its config's dataset is {dataset!r:.80}; expected a name")
    return dataset


def recorded_data_shape(directory):
    """(C, H, W) of the training images as a run recorded them in the checkpoint's config.json
    ("effective": {"data_shape": ...}); None where the file or the value is absent."""
    from pydtnn.cli import CONFIG_LIMIT
    from pydtnn.files import read_bytes

    from pydtnn.checkpoint import CONFIG_FILE

    path = os.path.join(directory, CONFIG_FILE)  # written beside the checkpoint by pydtnn.resume.save_checkpoint
    try:
        raw = read_bytes(path, "checkpoint configuration", CONFIG_LIMIT, DataError)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise DataError(f"{path} is not valid JSON; expected the configuration pydtnn-train writes") from None
    effective = doc.get("effective") if isinstance(doc, dict) else None
    shape = effective.get("data_shape") if isinstance(effective, dict) else None
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
        raise DataError(f"{path}: effective data_shape {shape!r:.80} is not [C, H, W] of positive integers")
    return tuple(shape)


def _shape(text):
    import argparse

    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected C,H,W (positive integers, e.g. 3,32,32), got {text!r}")
    return shape


def build_parser():
    from pydtnn.cli import Parser, parse_bool, positive_int
    from pydtnn.data.datasets import NAMES

    p = Parser(prog="pydtnn-export", allow_abbrev=False,
               description="Write a pydtnn model (a checkpoint, or a zoo architecture) as an ONNX graph for inference.")
    p.add_argument("output", help="ONNX file to write (replaced atomically; its folder must exist)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory written by pydtnn-train --checkpoint_dir")
    src.add_argument("--model", help="zoo architecture (pydtnn-train --list_models), untrained unless --weights")
    p.add_argument("--input_shape", "--input-shape", dest="input_shape", type=_shape,
                   help="with --model: C,H,W without the batch (default: the architecture's dataset, or what "
                        "--dataset's images become, as pydtnn-train builds it)")
    p.add_argument("--num_classes", "--num-classes", dest="num_classes", type=positive_int,
                   help="with --model: number of classes (default: the architecture's dataset)")
    p.add_argument("--weights", help="with --model: a .safetensors state dict (ours or PyTorch's, same names)")
    p.add_argument("--model_file", "--model-file", dest="model_file",
                   help="with --checkpoint: the Python file the model was trained from (pydtnn-train --model_file)")
    p.add_argument("--dataset", choices=NAMES, metavar="NAME",
                   help=f"the data the model was trained on ({', '.join(NAMES)}), recorded in the graph's metadata; "
                        f"a checkpoint records its own")
    p.add_argument("--with_preprocessing", "--with-preprocessing", dest="with_preprocessing", type=parse_bool,
                   nargs="?", const=True, default=False, metavar="BOOL",
                   help="the graph takes the dataset's uint8 images (N, C, H, W) as stored and itself scales, "
                        "normalizes and pads them as training did (default false: float32 input, preprocessed)")
    p.add_argument("--opset", type=positive_int, default=17, help=f"ONNX opset, {MIN_OPSET} or later (default 17)")
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=positive_int, default=None,
                   help="fixed batch dimension (default: dynamic)")
    return p


def inputs_of(args):
    """[(what, path)] of every file the command reads: each file of the checkpoint (and of a checkpoint
    given as --weights), under its name and its temporary name, or the --weights file."""
    from pydtnn.checkpoint import ALL_FILES, TMP

    def checkpoint_files(directory, what):
        return [(what, os.path.join(directory, name + tmp)) for name in ALL_FILES for tmp in ("", TMP)]

    if args.checkpoint is not None:
        return checkpoint_files(args.checkpoint, "checkpoint file") + [("model file", args.model_file)] * bool(
            args.model_file)
    if args.weights is not None and os.path.isdir(args.weights):
        return checkpoint_files(args.weights, "weights checkpoint file")
    return [("weights file", args.weights)] if args.weights is not None else []


def export_from_args(args):
    """Check the output, build (or load) the model the flags name and write it; returns (model, input
    contract or None, path)."""
    from pydtnn import checkpoint
    from pydtnn.files import TMP, check_distinct, check_writable

    if args.model_file is not None and args.checkpoint is None:
        raise ConfigError(f"--model_file {args.model_file} goes with --checkpoint (the model a checkpoint was trained "
                          f"from); with --model, export a zoo architecture")
    check_writable(args.output, "ONNX file")  # before any work: a bad output path costs nothing
    check_distinct([("ONNX file", args.output), ("ONNX file's temporary name", args.output + TMP)], inputs_of(args))
    _import_onnx()  # before a model is built: say what is missing first
    if args.checkpoint is not None:
        extra = [f"--{k}" for k in ("input_shape", "num_classes", "weights") if getattr(args, k) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} only go with --model; a checkpoint already holds its shape, "
                              f"classes and weights")
        manifest = checkpoint.read_manifest(args.checkpoint)
        where = os.path.join(args.checkpoint, checkpoint.META_FILE)
        dataset = trained_on(manifest, where)
        if args.dataset is not None and dataset is not None and args.dataset != dataset:
            raise ConfigError(f"--dataset {args.dataset}: the checkpoint {args.checkpoint} was trained on {dataset}; "
                              f"leave --dataset out")
        dataset = dataset or args.dataset
        _check_preprocessing(args, dataset, f"the checkpoint {args.checkpoint} does not say what data it was "
                                            f"trained on")
        model = model_from_checkpoint(args.checkpoint, manifest, args.model_file)
        contract = None if dataset is None else input_contract(dataset, model.input_shape,
                                                               recorded_data_shape(args.checkpoint))
    else:
        _check_preprocessing(args, args.dataset, "--model does not say what data it was trained on")
        model = _zoo_model(args)
        contract = None if args.dataset is None else input_contract(args.dataset, model.input_shape)
    return model, contract, to_onnx(model, args.output, args.opset, args.batch_size, contract, args.with_preprocessing)


def _check_preprocessing(args, dataset, unknown):
    """ConfigError, before a model is built, where --with_preprocessing has no images to start from."""
    if not args.with_preprocessing:
        return
    if dataset is None:
        raise ConfigError(f"--with_preprocessing needs the dataset the model was trained on, and {unknown}: give "
                          f"--dataset NAME ({_image_datasets()})")
    if _pixels(dataset) is None:
        raise ConfigError(f"--with_preprocessing needs a dataset of images; {dataset} data is generated as floats, "
                          f"with no pixels to preprocess: export without --with_preprocessing")


def _zoo_model(args):
    """The --model architecture: for --input_shape (or its default), or, given --dataset alone, the
    variant and input shape pydtnn-train builds for that data (families.resolve, padding included)."""
    from pydtnn import checkpoint, models
    from pydtnn.backends import CPUBackend
    from pydtnn.models.families import resolve, variant

    pixels = None if args.dataset is None or args.input_shape is not None else _pixels(args.dataset)
    if pixels is None:
        model = models.create(args.model, input_shape=args.input_shape, num_classes=args.num_classes,
                              backend=CPUBackend())
    else:
        classes = args.num_classes or pixels.classes or models.defaults(variant(args.model, pixels.shape))[1]
        _, model = resolve(args.model, pixels.shape, classes,
                           build=lambda name, shape: models.create(name, input_shape=shape, num_classes=classes,
                                                                   backend=CPUBackend()))
    if args.weights is not None:
        checkpoint.load_weights(args.weights, model)
    return model


def main(argv=None):
    """`pydtnn-export`: 0 on success; 2 and one line `pydtnn: error: ...` on a user error, no file written."""
    try:
        args = build_parser().parse_args(argv)
        model, contract, path = export_from_args(args)
    except PydtnnError as e:
        print(f"pydtnn: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("pydtnn: error: interrupted", file=sys.stderr, flush=True)
        return 130
    batch = "N" if args.batch_size is None else args.batch_size
    given = describe_input(contract, model.input_shape, args.with_preprocessing, batch)
    print(f"pydtnn-export: wrote {path} ({model.name}, input {given}; output ({batch}, "
          f"{', '.join(map(str, model.output_shape))}), opset {args.opset}, {os.path.getsize(path) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
