"""The same network in PyTorch, built from a pydtnn Model and given its weights: for side-by-side runs.

    tmodel = to_torch(model)      # torch.nn.Module, same layers, same parameters, same output
"""

import numpy as np
import torch
from torch import nn

from pydtnn import layers as L


class _Sum(nn.Module):
    def __init__(self, paths):
        super().__init__()
        self.paths = nn.ModuleList(paths)

    def forward(self, x):
        out = self.paths[0](x)
        for p in self.paths[1:]:
            out = out + p(x)
        return out


class _Concat(_Sum):
    def forward(self, x):
        return torch.cat([p(x) for p in self.paths], dim=1)


class _Embedding(nn.Embedding):
    """nn.Embedding over ids given as floats (as pydtnn's data pipeline gives them)."""

    def forward(self, x):
        return super().forward(x.long())


class _Learned(nn.Module):
    """A learned tensor `weight` added (positions) or prepended (a class token) to (N, T, D) tokens."""

    def __init__(self, shape, name, prepend):
        super().__init__()
        self.name, self.prepend = name, prepend
        setattr(self, name, nn.Parameter(torch.zeros(shape)))

    def forward(self, x):
        w = getattr(self, self.name)
        return torch.cat([w.expand(x.shape[0], 1, -1), x], dim=1) if self.prepend else x + w


class _Tokens(nn.Module):
    def forward(self, x):
        return x.flatten(2).transpose(1, 2)


class _Pool(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, x):
        return x[:, 0] if self.mode == "cls" else x.mean(dim=1)


class _Attention(nn.Module):
    """Self-attention as a PyTorch user writes it (nanoGPT's): one input projection, the heads through
    F.scaled_dot_product_attention (causal or not, dropout on the weights), the output projection;
    pydtnn's parameter names and order."""

    def __init__(self, d, heads, causal, dropout):
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.in_proj_weight = nn.Parameter(torch.zeros(3 * d, d))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
        self.out_proj_weight = nn.Parameter(torch.zeros(d, d))
        self.out_proj_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        n, t, d = x.shape
        qkv = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                       is_causal=self.causal)
        return nn.functional.linear(o.transpose(1, 2).reshape(n, t, d), self.out_proj_weight, self.out_proj_bias)


def _transformer_module(layer):
    """The torch module of a transformer layer (pydtnn.layers.transformer, LayerNorm, GELU), else None."""
    if isinstance(layer, L.Embedding):
        return _Embedding(layer.vocab_size, layer.dim)
    if isinstance(layer, L.PositionalEmbedding):
        return _Learned(layer.input_shape, "weight", prepend=False)
    if isinstance(layer, L.ClassToken):
        return _Learned((1, layer.input_shape[1]), "class_token", prepend=True)
    if isinstance(layer, L.Tokens):
        return _Tokens()
    if isinstance(layer, L.SequencePool):
        return _Pool(layer.mode)
    if isinstance(layer, L.MultiHeadAttention):
        return _Attention(layer.input_shape[1], layer.heads, layer.causal, layer.dropout)
    if isinstance(layer, L.LayerNorm):
        return nn.LayerNorm(layer.input_shape[-1], layer.eps)
    if isinstance(layer, L.GELU):
        return nn.GELU(approximate=layer.approximate)
    return None


def _convert(layer, dtype):
    """torch module for one pydtnn layer (weights copied), with parameters of `dtype`."""
    if isinstance(layer, L.Sequential):
        return nn.Sequential(*[_convert(child, dtype) for _, child in layer.children])
    if isinstance(layer, (L.AdditionBlock, L.ConcatenationBlock)):
        paths = [_convert(p, dtype) for _, p in layer.children]
        return _Sum(paths) if isinstance(layer, L.AdditionBlock) else _Concat(paths)
    if isinstance(layer, L.Conv2D):
        g = layer.geometry
        symmetric = g.pt == g.pb and g.pl == g.pr  # what nn.Conv2d pads itself; else an explicit ZeroPad2d
        m = nn.Conv2d(g.c, layer.filters, layer.kernel_size, layer.stride, (g.pt, g.pl) if symmetric else 0,
                      layer.dilation, layer.groups, bias=layer.use_bias)
        if not symmetric:
            m = nn.Sequential(nn.ZeroPad2d((g.pl, g.pr, g.pt, g.pb)), m)
    elif isinstance(layer, L.Dense):
        m = nn.Linear(layer.input_shape[-1], layer.units, bias=layer.use_bias)
    elif _transformer_module(layer) is not None:
        m = _transformer_module(layer)
    elif isinstance(layer, L.BatchNorm):
        m = (nn.BatchNorm1d if len(layer.input_shape) == 1 else nn.BatchNorm2d)(layer.input_shape[0], layer.eps,
                                                                                 layer.momentum)
    elif isinstance(layer, L.MaxPool2D):
        m = nn.MaxPool2d(layer.pool_size, layer.stride, layer.padding, ceil_mode=layer.ceil_mode)
    elif isinstance(layer, L.AvgPool2D):
        m = nn.AvgPool2d(layer.pool_size, layer.stride, layer.padding)
    elif isinstance(layer, L.GlobalAvgPool2D):
        m = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    elif isinstance(layer, L.AdaptiveAvgPool2D):
        m = nn.AdaptiveAvgPool2d(layer.output_size)
    elif isinstance(layer, L.Flatten):
        m = nn.Flatten()
    elif isinstance(layer, L.Dropout):
        m = nn.Dropout(layer.rate)
    else:
        m = {L.ReLU: nn.ReLU, L.ReLU6: nn.ReLU6, L.Sigmoid: nn.Sigmoid, L.Tanh: nn.Tanh}[type(layer)]()
    m = m.to(dtype)
    target = m[-1] if isinstance(m, nn.Sequential) and isinstance(layer, L.Conv2D) else m
    with torch.no_grad():
        for name, value in list(layer.params.items()) + list(layer.buffers.items()):
            getattr(target, name).copy_(torch.from_numpy(np.array(value)))
    return m


def to_torch(model):
    """torch.nn.Module computing what `model` (a built pydtnn Model) computes, from the same weights.

    Its parameters() come in the order of model.parameters(), with the same shapes and dtype.
    """
    dtype = torch.float64 if model.backend.dtype == np.float64 else torch.float32
    return _convert(model.root, dtype)
