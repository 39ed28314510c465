"""Initializers: the variance each rule promises, the bounds PyTorch uses, and seeding."""

import numpy as np
import pytest

from pydtnn.errors import ConfigError
from pydtnn.initializers import NAMES, initialize

FAN_IN, FAN_OUT = 300, 100
VARIANCE = {"he": 2 / FAN_IN, "glorot": 2 / (FAN_IN + FAN_OUT), "lecun": 1 / FAN_IN}


@pytest.mark.parametrize("rule", sorted(VARIANCE))
@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_variance_and_seeding(rule, dist):
    name = f"{rule}_{dist}"
    a = initialize(name, (400, 500), FAN_IN, FAN_OUT, np.random.default_rng(5), np.float64)
    assert a.shape == (400, 500) and a.dtype == np.float64
    assert abs(a.mean()) < 0.01 * np.sqrt(VARIANCE[rule])
    assert a.var() == pytest.approx(VARIANCE[rule], rel=0.02)
    if dist == "uniform":  # torch.nn.init.kaiming_uniform_/xavier_uniform_ bound: sqrt(3 * variance)
        assert np.abs(a).max() <= np.sqrt(3 * VARIANCE[rule]) and np.abs(a).max() > 0.99 * np.sqrt(3 * VARIANCE[rule])
    b = initialize(name, (400, 500), FAN_IN, FAN_OUT, np.random.default_rng(5), np.float64)
    c = initialize(name, (400, 500), FAN_IN, FAN_OUT, np.random.default_rng(6), np.float64)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_constants_dtype_and_unknown():
    assert (initialize("zeros", (3,), 1, 1, None) == 0).all() and (initialize("ones", (3,), 1, 1, None) == 1).all()
    assert initialize("he_normal", (3, 3), 3, 3, np.random.default_rng(0)).dtype == np.float32
    assert set(NAMES) >= {"he_uniform", "glorot_normal", "lecun_uniform", "zeros", "ones"}
    with pytest.raises(ConfigError, match="unknown initializer 'xavier'"):
        initialize("xavier", (3,), 1, 1, np.random.default_rng(0))


def test_gpt_normal_has_std_002_whatever_the_fans():
    for fans in ((300, 100), (4, 50_000)):
        a = initialize("gpt_normal", (400, 500), *fans, np.random.default_rng(5), np.float64)
        assert a.std() == pytest.approx(0.02, rel=0.01) and abs(a.mean()) < 1e-3
