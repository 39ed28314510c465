"""Augmentation: random crop with zero padding, horizontal flip, normalization; batched, deterministic."""

import numpy as np
import pytest

from pydtnn.data import (ArrayDataset, Augmentation, AugmentedDataset, ShardedArrayDataset, center_crop, normalize,
                         random_crop, random_flip, with_augmentation)
from pydtnn.errors import ConfigError
from pydtnn.randomness import SampleStreams


def images(n=6, c=3, h=8, w=10, seed=0):
    return np.random.default_rng(seed).integers(1, 256, (n, c, h, w), dtype=np.uint8)  # no zero pixels


@pytest.mark.parametrize("size,padding", [(None, 4), (None, 0), (6, 2), (12, 3)])
def test_random_crop_matches_a_per_sample_reference(size, padding):
    x = images()
    got = random_crop(x, np.random.default_rng(7), size, padding)
    rng = np.random.default_rng(7)  # the same draws, in the documented order: tops, then lefts
    sh, sw = (8, 10) if size is None else (size, size)
    top, left = rng.integers(0, 8 + 2 * padding - sh + 1, 6), rng.integers(0, 10 + 2 * padding - sw + 1, 6)
    padded = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    want = np.stack([padded[i, :, top[i]:top[i] + sh, left[i]:left[i] + sw] for i in range(6)])
    assert got.shape == (6, 3, sh, sw) and got.dtype == x.dtype
    np.testing.assert_array_equal(got, want)


def test_random_crop_is_a_shift_with_black_borders():
    x = images(n=64)
    out = random_crop(x, np.random.default_rng(1), None, 4)
    shifted = 0
    for a, b in zip(x, out):  # each output is the input moved by (dy, dx), zeros where it left the frame
        hits = [(dy, dx) for dy in range(-4, 5) for dx in range(-4, 5)
                if np.array_equal(np.roll(np.pad(a, ((0, 0), (4, 4), (4, 4))), (dy, dx), (1, 2))[:, 4:-4, 4:-4], b)]
        assert len(hits) == 1
        shifted += hits[0] != (0, 0)
    assert shifted > 48  # 1/81 chance per image of no shift
    assert random_crop(x, np.random.default_rng(1), None, 0) is not x
    np.testing.assert_array_equal(random_crop(x, np.random.default_rng(1), None, 0), x)


def test_crop_prob_and_fill():
    x = images()
    np.testing.assert_array_equal(random_crop(x, np.random.default_rng(0), None, 4, prob=0.0), x)  # all centred
    out = random_crop(x.astype(np.float64), np.random.default_rng(3), None, 8, fill=[-1.0, -2.0, -3.0])
    border = np.concatenate([out[:, :, :, 0], out[:, :, :, -1]], axis=2)  # mostly padding with a shift of up to 8
    for ch, v in enumerate([-1.0, -2.0, -3.0]):
        vals = set(np.unique(border[:, ch]).tolist())
        assert v in vals and not ({-1.0, -2.0, -3.0} - {v}) & vals  # each channel padded with its own value


def test_random_flip_matches_reference_and_is_deterministic():
    x = images(n=200)
    out = random_flip(x, np.random.default_rng(5))
    flips = np.random.default_rng(5).random(200) < 0.5
    np.testing.assert_array_equal(out[flips], x[flips][..., ::-1])
    np.testing.assert_array_equal(out[~flips], x[~flips])
    assert 60 < flips.sum() < 140
    np.testing.assert_array_equal(random_flip(x, np.random.default_rng(5)), out)
    np.testing.assert_array_equal(random_flip(x, np.random.default_rng(0), prob=0.0), x)
    np.testing.assert_array_equal(random_flip(x, np.random.default_rng(0), prob=1.0), x[..., ::-1])


def test_augmentation_training_and_evaluation_views():
    x = images()
    aug = Augmentation(flip=True, crop=True, crop_padding=2)
    a, b = aug(x, np.random.default_rng(9)), aug(x, np.random.default_rng(9))
    np.testing.assert_array_equal(a, b)  # a pure function of the Generator
    assert not np.array_equal(a, aug(x, np.random.default_rng(10)))
    assert aug(x, None) is x  # evaluation: untouched
    small = Augmentation(crop=True, crop_size=6, crop_padding=0)
    assert small.output_shape((3, 8, 10)) == (3, 6, 6)
    np.testing.assert_array_equal(small(x, None), x[:, :, 1:7, 2:8])  # evaluation: centre crop
    np.testing.assert_array_equal(center_crop(x, 6), x[:, :, 1:7, 2:8])
    assert small(x, np.random.default_rng(0)).shape == (6, 3, 6, 6)


@pytest.mark.parametrize("kwargs,words", [
    (dict(flip_prob=1.5), "flip_prob must be a probability"),
    (dict(crop_prob=-0.1), "crop_prob must be a probability"),
    (dict(crop_padding=-1), "crop_padding must be a non-negative integer"),
    (dict(crop_size=0), "crop_size must be a positive integer"),
])
def test_augmentation_rejects_bad_settings(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        Augmentation(**kwargs)


def test_crop_larger_than_padded_image():
    with pytest.raises(ConfigError, match="crop size 20 exceeds the padded image 12x14"):
        random_crop(images(), np.random.default_rng(0), 20, 2)


def test_normalize_per_channel():
    x = np.full((2, 3, 2, 2), 51, np.uint8)
    out = normalize(x, np.float32, 1 / 255, mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 0.1))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0, :, 0, 0], [(0.2 - 0.1) / 0.5, (0.2 - 0.2) / 0.25, (0.2 - 0.3) / 0.1], atol=1e-6)


MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def test_in_memory_and_streamed_datasets_augment_alike():
    """Wrapping an ArrayDataset (augmenting normalized floats, padding with normalized black) equals
    augmenting raw pixels before normalization, as the streamed datasets do."""
    x, y = images(n=10, h=8, w=8), np.arange(10) % 3
    in_memory = with_augmentation(ArrayDataset(x, y, 3, scale=1 / 255, mean=MEAN, std=STD), flip=True, crop=True)
    streamed = with_augmentation(ShardedArrayDataset([x], y, 3, ["mem"], "mem", 1 / 255, MEAN, STD), flip=True,
                                 crop=True)
    assert isinstance(in_memory, AugmentedDataset) and isinstance(streamed, ShardedArrayDataset)
    idx = np.array([0, 3, 4, 9])
    rng = SampleStreams(0, 1, idx)  # what the trainer passes for a training batch
    xa, ya = in_memory.get_batch(idx, np.float64, rng=SampleStreams(0, 1, idx))
    xb, yb = streamed.get_batch(idx, np.float64, rng=rng)
    np.testing.assert_allclose(xa, xb, atol=1e-12)
    np.testing.assert_array_equal(ya, yb)
    assert (xa == -np.array(MEAN).reshape(1, 3, 1, 1) / np.array(STD).reshape(1, 3, 1, 1)).any()  # some black padding
    plain = ArrayDataset(x, y, 3, scale=1 / 255, mean=MEAN, std=STD).get_batch(idx)[0]
    np.testing.assert_array_equal(in_memory.get_batch(idx)[0], plain)  # no rng: evaluation view, unaugmented
    np.testing.assert_allclose(streamed.get_batch(idx)[0], plain, rtol=1e-6)
    sub = in_memory.subset(np.array([1, 2]))
    assert isinstance(sub, AugmentedDataset) and len(sub) == 2 and sub.input_shape == (3, 8, 8)


def test_with_augmentation_without_flip_or_crop_is_the_dataset_itself():
    ds = ArrayDataset(images(), np.zeros(6, int), 1)
    assert with_augmentation(ds) is ds


def test_crop_padding_or_size_beyond_the_image_is_refused_when_attached():
    """--crop_images_padding 100000 would allocate N x C x 200008 x 200010 pixels at the first batch."""
    x, y = images(h=8, w=10), np.zeros(6, int)
    for ds in (ArrayDataset(x, y, 1), ShardedArrayDataset([x], y, 1, ["mem"], "mem")):
        with pytest.raises(ConfigError, match=r"crop_padding=100000 .*8x10.*expected at most 10"):
            with_augmentation(ds, crop=True, crop_padding=100000)
        with pytest.raises(ConfigError, match="crop size 30 exceeds the padded image 12x14"):
            with_augmentation(ds, crop=True, crop_padding=2, crop_size=30)
        assert with_augmentation(ds, crop=True, crop_padding=10).input_shape == (3, 8, 10)
        assert with_augmentation(ds, flip=True, crop_padding=100000).input_shape == (3, 8, 10)  # no crop: unused
    with pytest.raises(ConfigError, match="crop_padding=11"):
        Augmentation(crop=True, crop_padding=11).output_shape((3, 8, 10))
    with pytest.raises(ConfigError, match="crop_padding=11"):
        random_crop(x, np.random.default_rng(0), None, 11)
