"""IDX files (as MNIST ships them), the embedded dataset, batching and epoch order."""

import gzip
import time
import tracemalloc
import zlib

import numpy as np
import pytest

from pydtnn import data
from pydtnn.data import ArrayDataset, batch_slices, epoch_order, read_idx, write_idx
from pydtnn.errors import ConfigError, DataError


@pytest.mark.parametrize("name", ["a.idx", "a.idx.gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip(tmp_path, name, dtype):
    a = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5) if dtype != np.uint8 else np.arange(30, dtype=dtype).reshape(2, 3, 5)
    write_idx(tmp_path / name, a)
    b = read_idx(tmp_path / name)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_idx_reads_the_published_layout(tmp_path):
    """Bytes written by hand as the MNIST page documents them: magic 0x00000803, then dims."""
    raw = bytes([0, 0, 8, 3]) + (2).to_bytes(4, "big") + (2).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes(range(12))
    (tmp_path / "x.gz").write_bytes(gzip.compress(raw))
    np.testing.assert_array_equal(read_idx(tmp_path / "x.gz"), np.arange(12, dtype=np.uint8).reshape(2, 2, 3))


@pytest.mark.parametrize(
    "content,words",
    [
        (b"", "bad IDX magic"),
        (b"\x00\x00\x08", "bad IDX magic"),
        (b"\x00\x01\x08\x01\x00\x00\x00\x01\x05", "bad IDX magic"),
        (b"\x00\x00\x08\x02\x00\x00", "truncated IDX header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02", "wrong length"),
        (b"\x1f\x8b\x08\x00garbage", "corrupt gzip"),
    ],
)
def test_idx_bad_files_name_the_problem(tmp_path, content, words):
    (tmp_path / "bad").write_bytes(content)
    with pytest.raises(DataError, match=words):
        read_idx(tmp_path / "bad")


def test_idx_truncated_gzip(tmp_path):
    write_idx(tmp_path / "ok.gz", np.zeros((100, 28, 28), np.uint8))
    raw = (tmp_path / "ok.gz").read_bytes()
    (tmp_path / "cut.gz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="corrupt gzip"):
        read_idx(tmp_path / "cut.gz")
    with pytest.raises(DataError, match="cannot read"):
        read_idx(tmp_path / "missing.gz")


def test_embedded_mnist5k_is_real_balanced_and_disjoint():
    train, test = data.load("mnist5k")
    assert (len(train), len(test)) == (4000, 1000)
    assert train.input_shape == (1, 28, 28) and train.num_classes == 10
    assert np.bincount(train.y).tolist() == [400] * 10 and np.bincount(test.y).tolist() == [100] * 10
    assert train.x.dtype == np.uint8 and train.x.max() == 255  # real digits, not noise or zeros
    train_rows = {r.tobytes() for r in train.x.reshape(4000, -1)}
    assert not any(r.tobytes() in train_rows for r in test.x.reshape(1000, -1))  # held out for real
    x, y = train.get_batch(np.arange(8))
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0 and y.dtype == np.int64


def test_mnist_layout_directory(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 20), ("t10k", 7)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))  # not gzipped
    train, test = data.load("fashion_mnist", str(tmp_path))
    assert (len(train), len(test)) == (20, 7)
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte"):
        data.load("mnist", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="mnist5k"):
        data.load("cifar1000")
    with pytest.raises(ConfigError, match="train_path=DIR"):
        data.load("mnist")


def test_array_dataset_validates_labels_and_values():
    x = np.zeros((3, 1, 2, 2), np.float32)
    with pytest.raises(DataError, match="label 10 of sample 1 out of range; expected 0..9"):
        ArrayDataset(x, np.array([0, 10, 1]), 10)
    with pytest.raises(DataError, match="label -1"):
        ArrayDataset(x, np.array([0, -1, 1]), 10)
    with pytest.raises(DataError, match="labels must be integers, got dtype float64"):  # 1.5 is no class
        ArrayDataset(x, np.array([0.0, 1.5, 1.0]), 10)
    x[1, 0, 0, 1] = np.nan
    with pytest.raises(DataError, match="sample 1 contains NaN or Inf"):
        ArrayDataset(x, np.array([0, 1, 1]), 10)
    with pytest.raises(DataError, match="labels of shape"):
        ArrayDataset(x, np.array([0, 1]), 10)


def test_normalization():
    x = np.arange(2 * 2 * 1 * 1, dtype=np.uint8).reshape(2, 2, 1, 1) * 10
    ds = ArrayDataset(x, np.array([0, 1]), 2, scale=0.1, mean=[1.0, 2.0], std=[2.0, 4.0])
    got = ds.get_batch(np.array([0, 1]), np.float64)[0].reshape(2, 2)
    np.testing.assert_allclose(got, [[(0 - 1) / 2, (1 - 2) / 4], [(2 - 1) / 2, (3 - 2) / 4]])


def test_epoch_order_and_batches():
    a, b = epoch_order(10, 0, 0), epoch_order(10, 0, 1)
    assert sorted(a) == list(range(10)) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, epoch_order(10, 0, 0))  # pure function of (seed, epoch)
    assert batch_slices(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert batch_slices(10, 4, drop_last=True) == [(0, 4), (4, 8)]
    assert batch_slices(8, 4) == [(0, 4), (4, 8)] and batch_slices(3, 8) == [(0, 3)]


def idx_header(code, *dims):
    return bytes([0, 0, code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_header_whose_size_overflows_int64_is_a_data_error(tmp_path, gz):
    """65536^4 bytes is 2^64: an int64 product wraps to 0 and would match a header-only file."""
    raw = idx_header(0x08, 65536, 65536, 65536, 65536)
    (tmp_path / "huge").write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(DataError, match=r"\(65536, 65536, 65536, 65536\)"):
        read_idx(tmp_path / "huge")


def gzip_of_zeros(header, megabytes):
    """gzip bytes of `header` then `megabytes` MiB of zeros, compressed without holding them."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(header)] + [z.compress(bytes(1 << 20)) for _ in range(megabytes)]
    return b"".join(out + [z.flush()])


def test_idx_gzip_bomb_is_refused_without_decompressing_it(tmp_path):
    """A 256 KB file that inflates to 256 MiB behind a header of 2 x 28 x 28: at most the array
    the header declares (plus one byte) is ever decompressed."""
    (tmp_path / "bomb.gz").write_bytes(gzip_of_zeros(idx_header(0x08, 2, 28, 28), 256))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="bomb.gz: wrong length"):
            read_idx(tmp_path / "bomb.gz")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak:,} bytes allocated"


def test_idx_gzip_claiming_more_than_it_can_hold_fails_at_once(tmp_path):
    """A 1 KB gzip file cannot inflate to more than ~1 MB (deflate's ratio is at most 1032:1)."""
    (tmp_path / "claims.gz").write_bytes(gzip.compress(idx_header(0x08, 100000, 1000, 1000) + bytes(1000)))
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"claims.gz: .*\(100000, 1000, 1000\).*100,000,000,000 bytes"):
        read_idx(tmp_path / "claims.gz")
    assert time.perf_counter() - start < 1.0
    (tmp_path / "claims").write_bytes(idx_header(0x0E, 2**32 - 1, 2**32 - 1) + bytes(8))
    with pytest.raises(DataError, match="wrong length 20 bytes"):
        read_idx(tmp_path / "claims")


def test_idx_gzip_members_padding_and_trailing_data(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = idx_header(0x08, 2, 3, 4) + a.tobytes()
    (tmp_path / "two.gz").write_bytes(gzip.compress(raw[:10]) + gzip.compress(raw[10:]) + bytes(7))
    np.testing.assert_array_equal(read_idx(tmp_path / "two.gz"), a)  # members and zero padding, as gzip reads them
    (tmp_path / "junk.gz").write_bytes(gzip.compress(raw) + b"junk")
    with pytest.raises(DataError, match="junk.gz: corrupt gzip"):
        read_idx(tmp_path / "junk.gz")
    (tmp_path / "long.gz").write_bytes(gzip.compress(raw + b"x"))
    with pytest.raises(DataError, match="long.gz: wrong length: more than 40 bytes"):
        read_idx(tmp_path / "long.gz")
    (tmp_path / "crc.gz").write_bytes(gzip.compress(raw)[:-8] + bytes(8))
    with pytest.raises(DataError, match="crc.gz: corrupt gzip"):
        read_idx(tmp_path / "crc.gz")
