"""ONNX exporters of the transformer layers (layers/transformer.py, LayerNorm, GELU), which onnx_graph.py
registers beside its own. Each writes standard operators:

    LayerNorm             LayerNormalization (opset 17 or later; earlier opsets are refused in one line)
    GELU                  0.5 * x * (1 + Erf(x / sqrt 2)), or the tanh form with Tanh, from Mul / Add / Pow
    Embedding             Cast to int64, Gather of the weight's rows
    PositionalEmbedding   Add
    ClassToken            the token Expanded to (N, 1, D) from the input's Shape, Concat on axis 1
    SequencePool          Gather of token 0, or ReduceMean over the tokens
    Tokens                Reshape (N, C, H*W), Transpose
    MultiHeadAttention    MatMul with the transposed projections, Reshape / Transpose into heads, MatMul of
                          q and k^T scaled, the causal mask Added, Softmax over the last axis, MatMul with v
    PatchEmbedding, TransformerBlock   their children in order, as a Sequential
"""

import functools
import math

import numpy as np

from pydtnn.errors import ConfigError
from pydtnn.layers import (
    GELU,
    ClassToken,
    Embedding,
    LayerNorm,
    MultiHeadAttention,
    PatchEmbedding,
    PositionalEmbedding,
    SequencePool,
    Tokens,
    TransformerBlock,
)


class _Helpers:
    """onnx_graph.py's helpers the exporters write with (passed in: that module registers these)."""

    def __init__(self, sequential, state_name, numpy_of, label):
        self.sequential, self.state_name, self.numpy_of, self.label = sequential, state_name, numpy_of, label

    def weight(self, g, layer, key):
        return g.weight(self.state_name(layer, key), self.numpy_of(layer, key))


def _const(g, base, value, dtype=np.float32):
    return g.constant(base, np.array(value, dtype))


def _layernorm(h, g, layer, x):
    if g.opset < 17:
        raise ConfigError(f"cannot export LayerNorm {layer.path!r} at ONNX opset {g.opset}: LayerNormalization "
                          f"needs opset 17 or later; expected --opset 17 or more")
    return g.node("LayerNormalization", [x, h.weight(g, layer, "weight"), h.weight(g, layer, "bias")],
                  h.label(layer, "layernorm"), axis=-1, epsilon=layer.eps)


def _gelu(h, g, layer, x):
    name = h.label(layer, "gelu")
    if layer.approximate == "tanh":
        cube = g.node("Pow", [x, _const(g, "three", 3.0)], name + "/cube")
        inner = g.node("Add", [x, g.node("Mul", [cube, _const(g, "gelu_k", 0.044715)], name + "/k")], name + "/in")
        t = g.node("Tanh", [g.node("Mul", [inner, _const(g, "gelu_c", math.sqrt(2 / math.pi))], name + "/c")],
                   name + "/tanh")
    else:
        t = g.node("Erf", [g.node("Mul", [x, _const(g, "rsqrt2", 1 / math.sqrt(2))], name + "/scaled")],
                   name + "/erf")
    half = g.node("Mul", [x, _const(g, "half", 0.5)], name + "/half")
    return g.node("Mul", [half, g.node("Add", [t, _const(g, "one", 1.0)], name + "/plus1")], name)


def _embedding(h, g, layer, x):
    import onnx

    ids = g.node("Cast", [x], h.label(layer, "embedding") + "/ids", to=onnx.TensorProto.INT64)
    return g.node("Gather", [h.weight(g, layer, "weight"), ids], h.label(layer, "embedding"), axis=0)


def _positional(h, g, layer, x):
    return g.node("Add", [x, h.weight(g, layer, "weight")], h.label(layer, "pos"))


def _class_token(h, g, layer, x):
    name = h.label(layer, "class_token")
    d = layer.input_shape[1]
    token = g.weight(h.state_name(layer, "class_token"), h.numpy_of(layer, "class_token").reshape(1, 1, d))
    batch = g.node("Slice", [g.node("Shape", [x], name + "/shape"), _const(g, "zero_i", [0], np.int64),
                             _const(g, "one_i", [1], np.int64)], name + "/batch")
    shape = g.node("Concat", [batch, _const(g, name + ".rest", [1, d], np.int64)], name + "/to", axis=0)
    return g.node("Concat", [g.node("Expand", [token, shape], name + "/expand"), x], name, axis=1)


def _sequence_pool(h, g, layer, x):
    name = h.label(layer, "pool")
    if layer.mode == "cls":
        return g.node("Gather", [x, _const(g, "zero_s", 0, np.int64)], name, axis=1)
    if g.opset >= 18:  # axes became an input
        return g.node("ReduceMean", [x, _const(g, "one_i", [1], np.int64)], name, keepdims=0)
    return g.node("ReduceMean", [x], name, axes=[1], keepdims=0)


def _tokens(h, g, layer, x):
    c, height, width = layer.input_shape
    name = h.label(layer, "tokens")
    flat = g.node("Reshape", [x, _const(g, "shape", [0, c, height * width], np.int64)], name + "/flatten")
    return g.node("Transpose", [flat], name, perm=[0, 2, 1])


def _linear(h, g, layer, x, key, name):
    w = g.node("Transpose", [h.weight(g, layer, f"{key}_weight")], f"{name}/{key}_wt", perm=[1, 0])
    return g.node("Add", [g.node("MatMul", [x, w], f"{name}/{key}"), h.weight(g, layer, f"{key}_bias")],
                  f"{name}/{key}_b")


def _attention(h, g, layer, x):
    name = h.label(layer, "attention")
    t, d = layer.input_shape
    heads, hd = layer.heads, d // layer.heads
    qkv = g.node("Reshape", [_linear(h, g, layer, x, "in_proj", name),
                             _const(g, "shape", [0, t, 3, heads, hd], np.int64)], name + "/heads")
    qkv = g.node("Transpose", [qkv], name + "/qkv", perm=[2, 0, 3, 1, 4])
    q, k, v = (g.node("Gather", [qkv, _const(g, f"index{i}", i, np.int64)], f"{name}/{n}", axis=0)
               for i, n in enumerate("qkv"))
    scores = g.node("MatMul", [q, g.node("Transpose", [k], name + "/kt", perm=[0, 1, 3, 2])], name + "/qk")
    scores = g.node("Mul", [scores, _const(g, name + ".scale", 1 / math.sqrt(hd))], name + "/scores")
    if layer.causal:
        mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
        scores = g.node("Add", [scores, g.constant(name + ".causal_mask", mask)], name + "/masked")
    a = g.node("Softmax", [scores], name + "/softmax", axis=-1)
    o = g.node("Transpose", [g.node("MatMul", [a, v], name + "/av")], name + "/merge", perm=[0, 2, 1, 3])
    o = g.node("Reshape", [o, _const(g, "shape", [0, t, d], np.int64)], name + "/concat")
    return _linear(h, g, layer, o, "out_proj", name)


def _sequential(h, g, layer, x):
    return h.sequential(g, layer, x)


_BY_TYPE = {LayerNorm: _layernorm, GELU: _gelu, Embedding: _embedding, PositionalEmbedding: _positional,
            ClassToken: _class_token, SequencePool: _sequence_pool, Tokens: _tokens, MultiHeadAttention: _attention,
            PatchEmbedding: _sequential, TransformerBlock: _sequential}


def exporters(sequential, state_name, numpy_of, label):
    """{layer type: exporter(g, layer, x) -> output name}, written with onnx_graph.py's helpers."""
    h = _Helpers(sequential, state_name, numpy_of, label)
    return {cls: functools.partial(fn, h) for cls, fn in _BY_TYPE.items()}
