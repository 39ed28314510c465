"""The PyTorch twin used by benchmarks/scaling.py computes what the pydtnn model computes."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from torch_equivalent import to_torch  # noqa: E402

from pydtnn import models  # noqa: E402


@pytest.mark.parametrize("name", ["simplecnn", "resnet20_cifar10", "mobilenetv1_cifar10", "googlenet_cifar10"])
def test_torch_twin_matches_forward_and_gradients(name):
    model = models.create(name)
    twin = to_torch(model).eval()
    x = np.random.default_rng(0).standard_normal((2,) + model.input_shape).astype(np.float32)
    y = model.forward(x, training=False)
    ty = twin(torch.tensor(x))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-4, atol=1e-5 * np.abs(y).max())
    assert sum(p.numel() for p in twin.parameters()) == model.count_params()
