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
        m = nn.Linear(layer.input_shape[0], layer.units, bias=layer.use_bias)
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
