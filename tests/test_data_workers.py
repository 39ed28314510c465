"""--data_workers: a batch assembled by several threads equals the one-thread batch, to the bit, for every kind
of dataset, and training with them ends with the same parameters."""

import json
import subprocess
import sys

import numpy as np
import pytest
from test_datasets import write_imagenet

from pydtnn import data
from pydtnn.data.augment import Augmentation, AugmentedDataset
from pydtnn.data.dataset import ArrayDataset
from pydtnn.data.pad import PaddedDataset
from pydtnn.data.streamed import ShardedArrayDataset
from pydtnn.data.synthetic import SyntheticDataset
from pydtnn.data.workers import BatchWorkers, check_workers, takes_out
from pydtnn.errors import ConfigError, DataError
from pydtnn.randomness import SampleStreams


def batches(dataset, idx, workers, rng_of=lambda idx: SampleStreams(3, 1, idx), dtype=np.float32):
    with BatchWorkers(workers) as pool:
        return pool.get_batch(dataset, idx, dtype, rng_of(idx))


def assert_same_for_any_workers(dataset, idx, rng_of=lambda idx: SampleStreams(3, 1, idx)):
    x1, y1 = batches(dataset, idx, 1, rng_of)
    assert np.isfinite(x1).all() and x1.std() > 0
    for n in (2, 3, 5):
        x, y = batches(dataset, idx, n, rng_of)
        assert x.dtype == x1.dtype and x.flags.c_contiguous
        np.testing.assert_array_equal(x, x1, err_msg=f"{n} workers")
        np.testing.assert_array_equal(y, y1, err_msg=f"{n} workers")
    return x1


def test_imagenet_folder_training_and_evaluation_views_are_the_same_for_any_workers(tmp_path):
    write_imagenet(tmp_path)
    train, val = data.load("imagenet", str(tmp_path), size=16, resize=20)
    idx = np.array([10, 0, 3, 7, 1, 9, 2, 8, 5, 4, 6])  # the gray JPEG and the PNG among them
    x = assert_same_for_any_workers(train, idx)
    assert not np.array_equal(x, train.get_batch(idx)[0])  # the training view is random
    assert_same_for_any_workers(train, idx, rng_of=lambda idx: None)  # the evaluation view
    assert_same_for_any_workers(val, np.arange(3), rng_of=lambda idx: None)


@pytest.mark.parametrize("kind", ["synthetic", "shards", "array", "padded"])
def test_augmented_datasets_are_the_same_for_any_workers(kind):
    rng = np.random.default_rng(0)
    aug = Augmentation(flip=True, crop=True, crop_padding=3, crop_size=10)
    if kind == "synthetic":
        dataset = SyntheticDataset(40, (3, 12, 12), 4).with_augmentation(aug)
    elif kind == "shards":
        shards = [rng.integers(0, 256, (n, 3, 12, 12), dtype=np.uint8) for n in (17, 23)]
        dataset = ShardedArrayDataset(shards, rng.integers(0, 4, 40), 4, ["a", "b"], "shards",
                                      mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25)).with_augmentation(aug)
    elif kind == "array":
        dataset = AugmentedDataset(ArrayDataset(rng.integers(0, 256, (40, 3, 12, 12)), rng.integers(0, 4, 40), 4,
                                                scale=1 / 255, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2)), aug)
    else:
        dataset = PaddedDataset(ArrayDataset(rng.standard_normal((40, 1, 9, 9)), rng.integers(0, 4, 40), 4),
                                (1, 13, 13))
    idx = rng.permutation(40)[:31]
    assert takes_out(dataset)
    x = assert_same_for_any_workers(dataset, idx)
    assert x.shape == (31,) + tuple(dataset.input_shape)


class NoOut:
    """A user's dataset whose get_batch has no out= argument."""

    input_shape, num_classes = (2, 3, 3), 5

    def __init__(self):
        self.x = np.random.default_rng(1).standard_normal((30, 2, 3, 3))

    def __len__(self):
        return 30

    def get_batch(self, idx, dtype=np.float32, rng=None):
        x = self.x[idx].astype(dtype)
        if rng is not None:
            x = x + rng.random(len(idx)).astype(dtype)[:, None, None, None]
        return x, np.asarray(idx) % 5


def test_a_dataset_without_out_is_copied_in_share_by_share():
    dataset = NoOut()
    assert not takes_out(dataset)
    assert_same_for_any_workers(dataset, np.arange(29, 3, -1))


class FloatTargets(NoOut):
    """Regression targets: float, two per sample."""

    def get_batch(self, idx, dtype=np.float32, rng=None):
        x, _ = super().get_batch(idx, dtype, rng)
        return x, np.stack([np.asarray(idx) * 0.25, np.asarray(idx) * -1.5], axis=1)


def test_targets_keep_their_dtype_and_shape():
    dataset = FloatTargets()
    x1, y1 = batches(dataset, np.arange(20), 1)
    x3, y3 = batches(dataset, np.arange(20), 3)
    assert y3.dtype == y1.dtype == np.float64 and y3.shape == (20, 2)
    np.testing.assert_array_equal(y3, y1)
    np.testing.assert_array_equal(x3, x1)


def test_a_plain_generator_is_not_split():
    """One Generator for the whole batch draws in order: splitting it would change the batch."""
    dataset = NoOut()
    idx = np.arange(20)
    want = dataset.get_batch(idx, rng=np.random.default_rng(4))[0]
    got = batches(dataset, idx, 4, rng_of=lambda idx: np.random.default_rng(4))[0]
    np.testing.assert_array_equal(got, want)


def test_a_shares_error_reaches_the_caller(tmp_path):
    write_imagenet(tmp_path)
    train, _ = data.load("imagenet", str(tmp_path), size=16, resize=20)
    (tmp_path / "train" / "n03" / "n03_2.JPEG").write_bytes(b"not a jpeg at all")
    with pytest.raises(DataError, match="n03_2.JPEG: cannot decode image"):
        batches(train, np.arange(11), 3)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_worker_counts_are_checked(bad):
    with pytest.raises(ConfigError, match=f"data_workers must be a positive integer .*got {bad!r}"):
        check_workers(bad)


def test_training_with_workers_ends_where_one_worker_ends():
    from pydtnn import losses, models, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.trainer import Trainer

    aug = Augmentation(flip=True, crop=True, crop_padding=2)
    train = SyntheticDataset(96, (3, 8, 8), 4).with_augmentation(aug)
    digests = []
    for workers in (1, 3):
        backend = CPUBackend(np.float64, seed=0)
        model = models.create("simplemlp", input_shape=(3, 8, 8), num_classes=4, backend=backend)
        t = Trainer(model, losses.create("categorical_cross_entropy"),
                    optim.create("sgd", model.parameters(), backend=backend, lr=0.05), progress=False,
                    data_workers=workers)
        history = t.fit(train, epochs=2, batch_size=16)
        digests.append((t.step.params_sha256(), history[-1]["loss"], t.evaluate(SyntheticDataset(20, (3, 8, 8), 4, split=1))))
    assert digests[0] == digests[1]


def test_cli_refuses_zero_workers_in_one_line():
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--data_workers", "0"], check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "--data_workers" in line and "'0'" in line, r.stderr


def test_cli_trains_with_workers(tmp_path):
    """pydtnn-train --data_workers 2 on the default data: the same metrics file as one worker."""
    runs = []
    for n in (1, 2):
        out = tmp_path / f"m{n}.jsonl"
        r = subprocess.run([sys.executable, "-m", "pydtnn", "--model", "simplemlp", "--num_epochs", "1",
                            "--steps_per_epoch", "4", "--flip_images", "true", "--progress", "false",
                            "--data_workers", str(n), "--metrics_file", str(out)],
                           check=False, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append([{k: v for k, v in json.loads(line).items() if "time" not in k and "per_second" not in k}
                     for line in out.read_text().splitlines()])
    assert runs[0] and runs[0] == runs[1]
