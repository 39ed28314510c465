"""Layers: one file per family. Images are NCHW, token sequences (N, T, D); parameter names and layouts are
PyTorch's."""

from pydtnn.layers.activation import GELU, LeakyReLU, ReLU, ReLU6, Sigmoid, Softmax, Tanh
from pydtnn.layers.base import Layer
from pydtnn.layers.blocks import AdditionBlock, ConcatenationBlock, Container, Sequential
from pydtnn.layers.conv import Conv2D
from pydtnn.layers.dense import FC, Dense
from pydtnn.layers.dropout import Dropout
from pydtnn.layers.norm import BatchNorm, BatchNormalization, LayerNorm
from pydtnn.layers.pool import (
    AdaptiveAvgPool2D,
    AveragePool2D,
    AvgPool2D,
    GlobalAvgPool2D,
    MaxPool2D,
)
from pydtnn.layers.shape import Flatten
from pydtnn.layers.transformer import (
    ClassToken,
    Embedding,
    MultiHeadAttention,
    PatchEmbedding,
    PositionalEmbedding,
    SequencePool,
    Tokens,
    TransformerBlock,
)

__all__ = [
    "Layer", "Container", "Sequential", "AdditionBlock", "ConcatenationBlock",
    "Conv2D", "Dense", "FC", "MaxPool2D", "AvgPool2D", "AveragePool2D", "GlobalAvgPool2D",
    "AdaptiveAvgPool2D",
    "BatchNorm", "BatchNormalization", "Dropout", "Flatten",
    "ReLU", "ReLU6", "LeakyReLU", "Sigmoid", "Tanh", "Softmax", "GELU",
    "LayerNorm", "Embedding", "PositionalEmbedding", "ClassToken", "SequencePool", "Tokens", "PatchEmbedding",
    "MultiHeadAttention", "TransformerBlock",
]
