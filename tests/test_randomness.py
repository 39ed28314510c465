"""Per-sample random streams (pydtnn.randomness): a sample's draws depend on (seed, epoch, stream, sample)
alone, never on the batch around it, the process holding it or the step it falls in."""

import numpy as np
import pytest

from pydtnn import data
from pydtnn.backends import CPUBackend
from pydtnn.randomness import AUGMENT, SampleStreams, layer_stream


def test_a_samples_draws_do_not_depend_on_its_batch():
    whole = SampleStreams(7, 2, [3, 11, 40, 41])
    u, k = whole.random(4), whole.integers(0, 1000, 4)
    for i, idx in enumerate([3, 11, 40, 41]):
        alone = SampleStreams(7, 2, [idx])
        assert alone.random(1)[0] == u[i] and alone.integers(0, 1000, 1)[0] == k[i]
    tail = whole.rows(None, 2, 4)
    fresh = SampleStreams(7, 2, [40, 41])
    np.testing.assert_array_equal(tail.uniform_rows((2, 5)), fresh.uniform_rows((2, 5)))


def test_seed_epoch_sample_and_stream_each_change_the_draws():
    base = SampleStreams(7, 2, [3]).random(1)[0]
    for other in (SampleStreams(8, 2, [3]), SampleStreams(7, 3, [3]), SampleStreams(7, 2, [4]),
                  SampleStreams(7, 2, [3], stream=layer_stream("features.3"))):
        assert other.random(1)[0] != base
    assert layer_stream("a.1") != layer_stream("a.2") != AUGMENT
    u = SampleStreams(0, 0, np.arange(2000)).random(2000)
    assert 0.45 < u.mean() < 0.55 and u.min() >= 0 and u.max() < 1


def test_one_value_per_sample_is_asked():
    with pytest.raises(ValueError, match="3 values asked of the streams of 2 samples"):
        SampleStreams(0, 0, [1, 2]).random(3)


def test_dropout_masks_follow_the_samples_when_the_trainer_sets_their_streams():
    backend = CPUBackend("float64", seed=0)
    backend.sample_streams = SampleStreams(5, 1, [10, 20, 30, 40])
    whole = backend.dropout_mask((4, 3, 8), 0.5, np.float64, layer_stream("7"))
    backend.sample_streams = SampleStreams(5, 1, [30, 40])
    half = backend.dropout_mask((2, 3, 8), 0.5, np.float64, layer_stream("7"))
    np.testing.assert_array_equal(whole[2:], half)
    assert set(np.unique(whole)) == {0.0, 2.0}
    other_layer = backend.dropout_mask((2, 3, 8), 0.5, np.float64, layer_stream("8"))
    assert not np.array_equal(half, other_layer)
    backend.sample_streams = None  # outside a training step: the backend's Generator
    a = backend.dropout_mask((2, 3, 8), 0.5, np.float64, layer_stream("7"))
    assert not np.array_equal(a, half)


def test_flips_and_crops_of_a_sample_are_the_same_in_any_batch():
    train, _ = data.load("mnist5k")
    train = data.with_augmentation(train.subset(np.arange(8)), flip=True, crop=True, crop_padding=3)
    x, _ = train.get_batch(np.arange(8), rng=SampleStreams(1, 0, np.arange(8)))
    part, _ = train.get_batch(np.array([5, 6]), rng=SampleStreams(1, 0, [5, 6]))
    np.testing.assert_array_equal(x[5:7], part)
    again, _ = train.get_batch(np.arange(8), rng=SampleStreams(1, 1, np.arange(8)))  # the next epoch
    assert not np.array_equal(x, again)
