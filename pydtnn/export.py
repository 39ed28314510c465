"""ONNX export of a built Model, for inference: BatchNorm uses its running statistics, Dropout is the identity.

    from pydtnn.export import to_onnx
    to_onnx(model, "net.onnx")          # input "input" (N, C, H, W), output "output" (N, classes)

    pydtnn-export net.onnx --checkpoint DIR                  # a checkpoint written by pydtnn-train
    pydtnn-export net.onnx --model resnet18_imagenet --input_shape 3,64,64 [--weights w.safetensors]

The graph is float32 (a float64 model's weights are rounded to float32), NCHW, with a dynamic batch
dimension "N" unless batch_size is given. Initializers carry the state-dict names
(features.0.weight, layer1.0.bn1.running_var); nodes are named after their layer's path. Each layer
type maps to standard operators (opset 13 or later): Conv2D -> Conv, Dense -> Gemm, BatchNorm ->
BatchNormalization, pools -> MaxPool / AveragePool (count_include_pad=1, as pydtnn divides by the
whole window) / GlobalAveragePool, blocks -> Sum / Concat. AdaptiveAvgPool2D is exported for the
input size the model was built for: an AveragePool when the bins are equal, otherwise (overlapping
or repeated bins) a MatMul with the exact bin-averaging matrix.

`onnx` is imported only here, when an export runs: `import pydtnn` does not need it.
"""

import os
import sys

import numpy as np

from pydtnn.errors import ConfigError, PydtnnError
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
    bins = np.zeros((h, w, oh, ow), np.float64)
    for i, (r0, r1) in enumerate(layer.rows):
        for j, (c0, c1) in enumerate(layer.cols):
            bins[r0:r1, c0:c1, i, j] = 1.0 / ((r1 - r0) * (c1 - c0))
    flat = g.node("Reshape", [x, g.constant("shape", np.array([0, c, h * w], np.int64))], name + "/flatten")
    pooled = g.node("MatMul", [flat, g.constant(name + ".bins", bins.reshape(h * w, oh * ow).astype(np.float32))],
                    name + "/bins")
    return g.node("Reshape", [pooled, g.constant("shape", np.array([0, c, oh, ow], np.int64))], name)


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


# -- the model ----------------------------------------------------------------------------------
def to_proto(model, opset=17, batch_size=None):
    """onnx.ModelProto of a built Model, checked with onnx.checker (full check: shapes inferred and compared).

    Raises ConfigError for an opset out of range, a bad batch size, a layer type with no ONNX
    equivalent (naming the layer and its type), a model over protobuf's 2 GB, or a missing onnx.
    """
    proto = _build(model, opset, batch_size)
    _import_onnx().checker.check_model(proto, full_check=True)
    return proto


def to_onnx(model, path, opset=17, batch_size=None):
    """Write `model` (a built Model) to `path` as an ONNX graph for inference; returns the path.

    Input "input" (N, *model.input_shape), output "output" (N, *model.output_shape), float32; N is
    dynamic unless batch_size is given. The graph is checked as to_proto says before the file
    appears, and written under a temporary name in the same folder, then renamed: a failure leaves
    no file (and an older file at `path` as it was).
    """
    from pydtnn.files import write_atomic

    data = _build(model, opset, batch_size).SerializeToString()
    _import_onnx().checker.check_model(data, full_check=True)  # the bytes: serialized once, not twice
    write_atomic(path, data)
    return path


def _build(model, opset, batch_size):
    from pydtnn import __version__
    from pydtnn.model import Model

    onnx = _import_onnx()
    helper = onnx.helper
    if not isinstance(model, Model):
        raise TypeError(f"to_onnx expects a built pydtnn.model.Model, got {type(model).__name__}")
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, (int, np.integer)) or not MIN_OPSET <= opset <= newest:
        raise ConfigError(f"ONNX opset {opset!r} is not supported; expected an integer from {MIN_OPSET} to {newest} "
                          f"(the newest this onnx {onnx.__version__} knows)")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ConfigError(f"batch_size {batch_size!r} is not valid; expected a positive integer, or None for a dynamic batch")
    size = sum(int(np.prod(a.shape)) * 4 for _, a in model.named_state())
    if size > _PROTOBUF_LIMIT:
        raise ConfigError(f"model {model.name!r} has {size / 2**30:.1f} GiB of float32 state; an ONNX file without "
                          f"external data holds at most 2 GiB")

    g = _Graph(onnx)
    y = _export(g, model.root, INPUT)
    if y == INPUT:  # the model is the identity (e.g. only Dropout)
        y = g.node("Identity", [INPUT], OUTPUT)
    for node in g.nodes:  # the last value computed becomes the graph's output; nothing consumes it
        node.output[:] = [OUTPUT if o == y else o for o in node.output]

    batch = "N" if batch_size is None else int(batch_size)
    graph = helper.make_graph(
        g.nodes, model.name,
        [helper.make_tensor_value_info(INPUT, onnx.TensorProto.FLOAT, [batch, *model.input_shape])],
        [helper.make_tensor_value_info(OUTPUT, onnx.TensorProto.FLOAT, [batch, *model.output_shape])],
        initializer=g.initializers,
    )
    opsets = [helper.make_opsetid("", int(opset))]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="pydtnn", producer_version=__version__,
                              doc_string=f"pydtnn model {model.name}, input {model.input_shape}, inference mode")
    proto.ir_version = helper.find_min_ir_version_for(opsets)  # readable by the oldest runtime that has the opset
    return proto


# -- pydtnn-export ------------------------------------------------------------------------------
def model_from_checkpoint(directory):
    """The Model saved in a checkpoint directory (its architecture, input shape, classes and dtype), weights loaded.

    The manifest names the architecture and its input shape; the number of classes is the one
    whose state-dict fingerprint matches the checkpoint's (the dataset's default, or the size of
    the classifier's last tensor).
    """
    from pydtnn import checkpoint, models
    from pydtnn.backends import CPUBackend

    manifest = checkpoint.read_manifest(directory)
    where = os.path.join(directory, checkpoint.META_FILE)
    saved = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    name = saved.get("name")
    if not isinstance(name, str) or name == "model":  # a Model built by hand: fall back on the run's flags
        from pydtnn.run import saved_config

        name = saved_config(directory).get("model")
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
    for classes in candidates:
        model = models.create(name, input_shape=shape, num_classes=classes, backend=CPUBackend(dtype=dtype))
        if state is None or checkpoint.fingerprint(model) == state:
            break
    checkpoint.load(directory, model)  # validates everything; a different architecture is a ShapeError naming it
    return model


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
    from pydtnn.cli import Parser, positive_int

    p = Parser(prog="pydtnn-export", allow_abbrev=False,
               description="Write a pydtnn model (a checkpoint, or a zoo architecture) as an ONNX graph for inference.")
    p.add_argument("output", help="ONNX file to write (replaced atomically)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory written by pydtnn-train --checkpoint_dir")
    src.add_argument("--model", help="zoo architecture (pydtnn-train --list_models), untrained unless --weights")
    p.add_argument("--input_shape", "--input-shape", dest="input_shape", type=_shape,
                   help="with --model: C,H,W without the batch (default: the architecture's dataset)")
    p.add_argument("--num_classes", "--num-classes", dest="num_classes", type=positive_int,
                   help="with --model: number of classes (default: the architecture's dataset)")
    p.add_argument("--weights", help="with --model: a .safetensors state dict (ours or PyTorch's, same names)")
    p.add_argument("--opset", type=positive_int, default=17, help=f"ONNX opset, {MIN_OPSET} or later (default 17)")
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=positive_int, default=None,
                   help="fixed batch dimension (default: dynamic)")
    return p


def export_from_args(args):
    """Build (or load) the model the flags name and write it; returns (model, path)."""
    from pydtnn import checkpoint, models
    from pydtnn.backends import CPUBackend

    _import_onnx()  # before a model is built: say what is missing first
    if args.checkpoint is not None:
        extra = [f"--{k}" for k in ("input_shape", "num_classes", "weights") if getattr(args, k) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} only go with --model; a checkpoint already holds its shape, "
                              f"classes and weights")
        model = model_from_checkpoint(args.checkpoint)
    else:
        model = models.create(args.model, input_shape=args.input_shape, num_classes=args.num_classes,
                              backend=CPUBackend())
        if args.weights is not None:
            checkpoint.load_weights(args.weights, model)
    return model, to_onnx(model, args.output, args.opset, args.batch_size)


def main(argv=None):
    """`pydtnn-export`: 0 on success; 2 and one line `pydtnn: error: ...` on a user error, no file written."""
    try:
        args = build_parser().parse_args(argv)
        model, path = export_from_args(args)
    except PydtnnError as e:
        print(f"pydtnn: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("pydtnn: error: interrupted", file=sys.stderr, flush=True)
        return 130
    batch = "N" if args.batch_size is None else args.batch_size
    print(f"pydtnn-export: wrote {path} ({model.name}, input ({batch}, {', '.join(map(str, model.input_shape))}), "
          f"output ({batch}, {', '.join(map(str, model.output_shape))}), opset {args.opset}, "
          f"{os.path.getsize(path) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
