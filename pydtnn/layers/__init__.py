"""Layers: one file per family. All tensors are NCHW; parameter names and layouts are PyTorch's."""

from pydtnn.layers.activation import LeakyReLU, ReLU, ReLU6, Sigmoid, Softmax, Tanh
from pydtnn.layers.base import Layer
from pydtnn.layers.blocks import AdditionBlock, ConcatenationBlock, Container, Sequential
from pydtnn.layers.conv import Conv2D
from pydtnn.layers.dense import FC, Dense
from pydtnn.layers.dropout import Dropout
from pydtnn.layers.norm import BatchNorm, BatchNormalization
from pydtnn.layers.pool import (
    AdaptiveAvgPool2D,
    AveragePool2D,
    AvgPool2D,
    GlobalAvgPool2D,
    MaxPool2D,
)
from pydtnn.layers.shape import Flatten

__all__ = [
    "Layer", "Container", "Sequential", "AdditionBlock", "ConcatenationBlock",
    "Conv2D", "Dense", "FC", "MaxPool2D", "AvgPool2D", "AveragePool2D", "GlobalAvgPool2D",
    "AdaptiveAvgPool2D",
    "BatchNorm", "BatchNormalization", "Dropout", "Flatten",
    "ReLU", "ReLU6", "LeakyReLU", "Sigmoid", "Tanh", "Softmax",
]
