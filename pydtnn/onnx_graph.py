"""The ONNX graph of a built Model: one exporter per layer type, each writing standard operators.

    g = Graph(onnx)                       # onnx: the imported module (pydtnn.export imports it)
    y = export_layer(g, model.root, INPUT)   # name of the last tensor; g.nodes, g.initializers hold the graph

Each layer type maps to standard operators (opset 13 or later): Conv2D -> Conv, Dense -> Gemm,
BatchNorm -> BatchNormalization (running statistics), pools -> MaxPool / AveragePool
(count_include_pad=1, as pydtnn divides by the whole window) / GlobalAveragePool, blocks -> Sum /
Concat, Dropout -> nothing. AdaptiveAvgPool2D is exported for the input size the model was built
for: an AveragePool when the bins are equal, otherwise (overlapping or repeated bins) a MatMul with
the exact bin-averaging matrix. Initializers are float32 under their state-dict names
(features.0.weight, layer1.0.bn1.running_var); nodes are named after their layer's path.
"""

import numpy as np

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
    LeakyReLU,
    MaxPool2D,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)

INPUT, OUTPUT = "input", "output"  # the graph's tensor names


# -- the graph under construction ---------------------------------------------------------------
class Graph:
    """Nodes and initializers in the order they are made; every tensor name is unique."""

    def __init__(self, onnx, opset=17):
        self.helper, self.numpy_helper = onnx.helper, onnx.numpy_helper
        self.opset = int(opset)  # the graph's opset: some operators differ by version (onnx_transformer.py)
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
        x = export_layer(g, child, x)
    return x


def _addition(g, layer, x):
    outs = [export_layer(g, path, x) for _, path in layer.children]
    if len(outs) == 1:
        return g.node("Identity", outs, _label(layer, "add"))
    return g.node("Sum", outs, _label(layer, "add"))


def _concatenation(g, layer, x):
    outs = [export_layer(g, path, x) for _, path in layer.children]
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
    if len(layer.input_shape) == 2:  # per token: x (N, T, I) @ W.T (+ b), MatMul broadcasting over N
        y = g.node("MatMul", [x, g.node("Transpose", inputs[1:], _label(layer, "dense"), perm=[1, 0])],
                   _label(layer, "dense"))
        if layer.use_bias:
            y = g.node("Add", [y, g.weight(_state_name(layer, "bias"), _numpy(layer, "bias"))], _label(layer, "dense"))
        return y
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
    _, h, w = layer.input_shape
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


def _register_transformer_layers():
    from pydtnn.onnx_transformer import exporters

    _EXPORTERS.update(exporters(_sequential, _state_name, _numpy, _label))


_register_transformer_layers()


def export_layer(g, layer, x):
    """Append `layer`'s nodes to g, reading tensor x; returns the name of its output. ConfigError for a
    layer type with no exporter (a subclass included: it may compute something else)."""
    fn = _EXPORTERS.get(type(layer))
    if fn is None:
        raise ConfigError(f"cannot export layer {layer.path or '(root)'!r} of type {type(layer).__name__} to ONNX; "
                          f"expected one of {', '.join(sorted(t.__name__ for t in _EXPORTERS))}")
    return fn(g, layer, x)


def state_bytes(model):
    """(bytes of the model's state as float32, bytes of the bin-averaging matrices its adaptive pools add)."""
    size = sum(int(np.prod(a.shape)) * 4 for _, a in model.named_state())
    pooling = sum(_adaptive_matrix_bytes(layer) for _, layer in model.root.named_layers()
                  if type(layer) is AdaptiveAvgPool2D)
    return size, pooling
