"""Pooling layers the model zoo needs: MaxPool2D(ceil_mode=True) and AdaptiveAvgPool2D.

Float64 finite differences, and forward/backward against PyTorch in float64 and float32.
"""

import numpy as np
import pytest
import torch.nn.functional as F

from pydtnn.layers import AdaptiveAvgPool2D, MaxPool2D
from pydtnn.testing import check_against_torch, check_gradients

DTYPES = [np.float64, np.float32]


def both_checks(make, x_shape, torch_fn):
    check_gradients(make(), x_shape)
    for dtype in DTYPES:
        check_against_torch(make(), x_shape, torch_fn, dtype=dtype)


CEIL_CASES = [
    # (x_shape, pool_size, stride, padding): GoogLeNet's windows and the corner cases of the rule
    ((2, 3, 12, 12), 3, 2, 0),  # 12 -> 6 (floor would give 5)
    ((2, 2, 11, 10), 3, 2, 0),  # odd/even sizes
    ((1, 2, 7, 7), 2, 2, 0),  # 7 -> 4
    ((2, 2, 6, 7), 3, 1, 1),  # stride 1: same as floor
    ((2, 2, 5, 5), 3, 2, 1),  # padded
    ((2, 2, 5, 5), 2, 2, 1),  # last window would start in the bottom padding: dropped (4 -> 3)
    ((1, 3, 9, 8), (3, 2), (3, 2), 0),
    ((1, 2, 5, 5), 1, 3, 0),  # stride larger than the window: 5 -> 2, no padding needed
]


@pytest.mark.parametrize("x_shape,k,s,p", CEIL_CASES)
def test_maxpool2d_ceil(x_shape, k, s, p):
    both_checks(
        lambda: MaxPool2D(k, stride=s, padding=p, ceil_mode=True),
        x_shape,
        lambda x, _: F.max_pool2d(x, k, s, p, ceil_mode=True),
    )


def test_maxpool2d_ceil_output_size():
    layer = MaxPool2D(3, stride=2, ceil_mode=True)
    layer.build((64, 112, 112))
    assert layer.output_shape == (64, 56, 56)


@pytest.mark.parametrize(
    "x_shape,size",
    [
        ((2, 3, 7, 7), 7),  # identity
        ((2, 3, 14, 14), 7),  # even bins
        ((2, 3, 10, 9), (4, 3)),  # overlapping bins
        ((2, 2, 3, 2), 5),  # upsampling: rows repeat
        ((1, 4, 1, 1), (6, 6)),  # AlexNet/VGG on a tiny input
    ],
)
def test_adaptive_avgpool2d(x_shape, size):
    both_checks(lambda: AdaptiveAvgPool2D(size), x_shape, lambda x, _: F.adaptive_avg_pool2d(x, size))
