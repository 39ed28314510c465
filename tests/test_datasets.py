"""Datasets in their published formats, downloads with checksums, validation splits, and a real run.

Every loader test writes small files in the exact published format first (CIFAR binary records,
JPEG folder trees, .npy shards), so no test needs the network or the full datasets, except the
Fashion-MNIST training test, which reads the Debian package `dataset-fashion-mnist`.
"""

import builtins
import contextlib
import errno
import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest

from pydtnn import data
from pydtnn.data import (ArrayDataset, ImageFolder, ShardedArrayDataset, cache_dir, download, extract_tar,
                         resolve_validation, split_validation)
from pydtnn.data import datasets as registry
from pydtnn.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from pydtnn.data.imagenet import IMAGENET_MEAN, IMAGENET_STD
from pydtnn.errors import ConfigError, DataError
from pydtnn.randomness import SampleStreams

FASHION_DIR = "/usr/share/datasets/fashion-mnist"


def one_line_error(exc_type, fn, *words):
    """fn() raises exc_type with a one-line message containing every word; returns the message."""
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


# -- MNIST-layout IDX files -----------------------------------------------------------------------------
def write_mnist(root, n=6, gz=True):
    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("t10k", 3)):
        data.write_idx(root / f"{split}-images-idx3-ubyte{'.gz' if gz else ''}",
                       rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        data.write_idx(root / f"{split}-labels-idx1-ubyte", np.arange(count, dtype=np.uint8))


def test_idx_directory_errors_name_the_file(tmp_path):
    write_mnist(tmp_path)
    train, test = data.load("mnist", str(tmp_path))
    assert (len(train), len(test), train.input_shape) == (6, 3, (1, 28, 28))
    images = tmp_path / "train-images-idx3-ubyte.gz"
    raw = images.read_bytes()
    images.write_bytes(raw[:-7])
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(images), "corrupt gzip")
    images.write_bytes(gzip.compress(b"\x00\x00\x08\x03" + bytes(12) + bytes(5)))
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(images), "wrong length")
    images.write_bytes(gzip.compress(b"PK\x03\x04 not idx"))
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(images), "bad IDX magic")
    images.write_bytes(raw)
    labels = tmp_path / "train-labels-idx1-ubyte"
    data.write_idx(labels, np.array([0, 1, 2, 3, 4, 10], np.uint8))
    one_line_error(DataError, lambda: data.load("fashion_mnist", str(tmp_path)), str(labels),
                   "label 10 of sample 5 out of range; expected 0..9")
    data.write_idx(labels, np.arange(5, dtype=np.uint8))
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(labels), "same N")
    data.write_idx(labels, np.arange(6, dtype=np.uint8))
    floats = np.random.default_rng(0).random((6, 28, 28)).astype(np.float32)
    floats[4, 3, 3] = np.nan
    images.unlink()
    data.write_idx(tmp_path / "train-images-idx3-ubyte", floats)
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), "train-images-idx3-ubyte",
                   "sample 4 contains NaN")
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path / "missing")), "no train-images-idx3-ubyte[.gz]",
                   "t10k-labels-idx1-ubyte")


# -- CIFAR binary ---------------------------------------------------------------------------------
def cifar_records(labels, seed, label_bytes=1):
    """(bytes, images (N, 3, 32, 32)) in the published record layout: label byte(s), then the R, G and
    B planes of 32x32 row-major pixels."""
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, (len(labels), 3, 32, 32), dtype=np.uint8)
    out = bytearray()
    for lab, img in zip(labels, imgs):
        lab = lab if isinstance(lab, tuple) else (lab,)
        assert len(lab) == label_bytes
        out += bytes(lab)
        for plane in img:  # R, G, B
            for row in plane:
                out += bytes(row.tolist())
    return bytes(out), imgs


def write_cifar10(root, counts=(3, 2, 4, 1, 2), test_count=3):
    folder = root / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    images, labels = [], []
    for i, n in enumerate(counts, 1):
        lab = [(7 * i + k) % 10 for k in range(n)]
        raw, imgs = cifar_records(lab, i)
        (folder / f"data_batch_{i}.bin").write_bytes(raw)
        images.append(imgs), labels.extend(lab)
    raw, test_imgs = cifar_records([9, 0, 5][:test_count], 99)
    (folder / "test_batch.bin").write_bytes(raw)
    (folder / "batches.meta.txt").write_text("airplane\nautomobile\n")
    return folder, np.concatenate(images), np.array(labels), test_imgs


def test_cifar10_binary_layout(tmp_path):
    folder, images, labels, test_imgs = write_cifar10(tmp_path)
    for path in (tmp_path, folder):  # the extraction root or the folder itself
        train, test = data.load("cifar10", str(path))
        assert (len(train), len(test)) == (12, 3) and train.input_shape == (3, 32, 32) and train.num_classes == 10
        np.testing.assert_array_equal(train.y, labels)
        np.testing.assert_array_equal(test.y, [9, 0, 5])
    assert all(isinstance(s.base, np.memmap) or isinstance(s, np.memmap) for s in train.shards)  # not read into RAM
    idx = np.array([0, 2, 3, 9, 11])  # across batch files
    x, y = train.get_batch(idx, np.float64)
    want = (images[idx] / 255 - np.reshape(CIFAR10_MEAN, (1, 3, 1, 1))) / np.reshape(CIFAR10_STD, (1, 3, 1, 1))
    np.testing.assert_allclose(x, want, rtol=1e-12)
    np.testing.assert_array_equal(y, labels[idx])
    sub = train.subset(np.array([11, 0]))
    np.testing.assert_allclose(sub.get_batch(np.array([0, 1]), np.float64)[0], want[[4, 0]], rtol=1e-12)
    assert x.dtype == np.float64 and train.get_batch(idx)[0].dtype == np.float32


def test_cifar10_separate_test_path_and_missing_files(tmp_path):
    folder, *_ = write_cifar10(tmp_path / "a")
    other = tmp_path / "b"
    other.mkdir()
    (other / "test_batch.bin").write_bytes(cifar_records([1, 2, 3, 4], 5)[0])
    train, test = data.load("cifar10", str(folder), str(other))
    assert len(test) == 4
    one_line_error(DataError, lambda: data.load("cifar10", str(tmp_path / "none")), "no data_batch_1.bin",
                   "cifar-10-batches-bin/", "data_batch_5.bin", "test_batch.bin", "1 label byte + 3072 pixel bytes")
    (folder / "data_batch_4.bin").unlink()
    one_line_error(DataError, lambda: data.load("cifar10", str(folder)), "no data_batch_4.bin")
    one_line_error(ConfigError, lambda: data.load("cifar10"), "train_path=DIR", "cifar-10-batches-bin")


def test_cifar10_truncated_file_and_bad_label(tmp_path):
    folder, *_ = write_cifar10(tmp_path)
    raw = (folder / "data_batch_2.bin").read_bytes()
    (folder / "data_batch_2.bin").write_bytes(raw[:-100])
    one_line_error(DataError, lambda: data.load("cifar10", str(folder)), "data_batch_2.bin",
                   f"wrong length {len(raw) - 100}", "multiple of 3073")
    (folder / "data_batch_2.bin").write_bytes(raw)
    bad = cifar_records([1, 2, 3, 10], 4)[0]
    (folder / "data_batch_3.bin").write_bytes(bad)
    one_line_error(DataError, lambda: data.load("cifar10", str(folder)), "data_batch_3.bin",
                   "label 10 of sample 3 out of range; expected 0..9")
    (folder / "test_batch.bin").write_bytes(b"")
    (folder / "data_batch_3.bin").write_bytes(raw)
    one_line_error(DataError, lambda: data.load("cifar10", str(folder)), "test_batch.bin", "wrong length 0")


def test_cifar100_binary_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    raw, imgs = cifar_records([(3, 71), (19, 99), (0, 5)], 1, label_bytes=2)
    (folder / "train.bin").write_bytes(raw)
    (folder / "test.bin").write_bytes(cifar_records([(1, 1)], 2, label_bytes=2)[0])
    train, test = data.load("cifar100", str(tmp_path))
    assert train.num_classes == 100 and len(test) == 1
    np.testing.assert_array_equal(train.y, [71, 99, 5])
    x, _ = train.get_batch(np.arange(3), np.float64)
    np.testing.assert_allclose(x[:, 1] * 0.2564 + 0.4865, imgs[:, 1] / 255, atol=1e-12)  # green plane, CIFAR-100 stats
    (folder / "train.bin").write_bytes(cifar_records([(3, 100)], 1, label_bytes=2)[0])
    one_line_error(DataError, lambda: data.load("cifar100", str(folder)), "train.bin",
                   "label 100 of sample 0 out of range; expected 0..99")
    (folder / "train.bin").write_bytes(raw[:3073])  # a CIFAR-10-sized record
    one_line_error(DataError, lambda: data.load("cifar100", str(folder)), "wrong length 3073", "multiple of 3074")


# -- ImageNet folder tree ---------------------------------------------------------------------------
def write_image(path, w, h, mode="RGB", fmt="JPEG", seed=0):
    from PIL import Image

    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy + seed * 40) % 256],
                   -1).astype(np.uint8)
    Image.fromarray(rgb).convert(mode).save(path, fmt, quality=95)


def write_imagenet(root):
    for split, per_class in (("train", 3), ("val", 1)):
        for c, cls in enumerate(["n02", "n01", "n03"]):  # sorted order: n01 -> 0, n02 -> 1, n03 -> 2
            d = root / split / cls
            d.mkdir(parents=True)
            for k in range(per_class):
                write_image(d / f"{cls}_{k}.JPEG", 40 + 7 * k, 30 + 11 * c, seed=k + c)
    write_image(root / "train" / "n01" / "gray.jpg", 33, 45, mode="L")
    write_image(root / "train" / "n03" / "png.png", 50, 20, fmt="PNG")
    (root / "train" / "n03" / "notes.txt").write_text("not an image")


def test_imagenet_folder_tree(tmp_path):
    from PIL import Image

    write_imagenet(tmp_path)
    train, val = data.load("imagenet", str(tmp_path), size=16, resize=20)
    assert isinstance(train, ImageFolder) and train.classes == ["n01", "n02", "n03"]
    assert (len(train), len(val), train.num_classes, train.input_shape) == (11, 3, 3, (3, 16, 16))
    np.testing.assert_array_equal(train.y, [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(val.y, [0, 1, 2])
    x, y = train.get_batch(np.arange(11))
    assert x.shape == (11, 3, 16, 16) and x.dtype == np.float32 and np.isfinite(x).all()
    # evaluation view = shorter side to 20, centre 16x16 crop, ImageNet normalization
    img = Image.open(tmp_path / "val" / "n02" / "n02_0.JPEG").convert("RGB")
    w, h = img.size
    s = 20 / min(w, h)
    resized = np.asarray(img.resize((round(w * s), round(h * s)), Image.Resampling.BILINEAR), np.float64)
    t, l = (resized.shape[0] - 16) // 2, (resized.shape[1] - 16) // 2
    crop = resized[t:t + 16, l:l + 16].transpose(2, 0, 1) / 255
    want = (crop - np.reshape(IMAGENET_MEAN, (3, 1, 1))) / np.reshape(IMAGENET_STD, (3, 1, 1))
    got = val.get_batch(np.array([1]), np.float64)[0][0]
    assert np.abs(got - want).mean() < 0.05  # same crop; resampling differs only in sub-pixel detail
    # training view: random-resized crop + flip, a pure function of the batch Generator
    a = train.get_batch(np.arange(11), rng=SampleStreams(0, 0, np.arange(11)))[0]
    b = train.get_batch(np.arange(11), rng=SampleStreams(0, 0, np.arange(11)))[0]
    np.testing.assert_array_equal(a, b)
    assert a.shape == x.shape and not np.array_equal(a, x)
    assert not np.array_equal(a, train.get_batch(np.arange(11), rng=SampleStreams(0, 1, np.arange(11)))[0])
    assert not any(isinstance(v, np.ndarray) and v.dtype == np.uint8 for v in vars(train).values())  # no pixels kept


def test_imagenet_folder_errors(tmp_path):
    write_imagenet(tmp_path)
    (tmp_path / "val" / "n99").mkdir()
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "class folder n99", "3 training classes")
    (tmp_path / "val" / "n99").rmdir()
    bad = tmp_path / "train" / "n02" / "n02_1.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    train, _ = data.load("imagenet", str(tmp_path), size=16, resize=20)
    one_line_error(DataError, lambda: train.get_batch(np.array([5])), str(bad), "cannot decode image")
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path / "val")),
                   "neither train/ nor train_images_000.npy",
                   "ROOT/train/<class>/*.JPEG", "train_images_000.npy")
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path), str(tmp_path / "missing")), "no val/")
    one_line_error(DataError, lambda: ImageFolder(tmp_path / "nothing"), "cannot read image folder")
    one_line_error(ConfigError, lambda: data.load("imagenet"), "train_path=ROOT")


# -- ImageNet .npy shards ---------------------------------------------------------------------------
def write_shards(root, prefix, sizes, dtype=np.uint8, seed=0, hw=(6, 5)):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i, n in enumerate(sizes):
        x = rng.integers(0, 256, (n, 3) + hw).astype(dtype)
        if dtype != np.uint8:
            x /= 255
        y = rng.integers(0, 1000, n)
        np.save(root / f"{prefix}_images_{i:03d}.npy", x)
        np.save(root / f"{prefix}_labels_{i:03d}.npy", y)
        xs.append(x), ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def test_imagenet_npy_shards(tmp_path):
    x, y = write_shards(tmp_path, "train", [4, 3, 5])
    vx, vy = write_shards(tmp_path, "val", [2], seed=1)
    train, val = data.load("imagenet", str(tmp_path))
    assert isinstance(train, ShardedArrayDataset) and (len(train), len(val)) == (12, 2)
    assert train.num_classes == 1000 and train.input_shape == (3, 6, 5)
    assert all(isinstance(s, np.memmap) for s in train.shards)
    idx = np.array([1, 4, 6, 7, 11])
    got, labels = train.get_batch(idx, np.float64)
    want = (x[idx] / 255 - np.reshape(IMAGENET_MEAN, (1, 3, 1, 1))) / np.reshape(IMAGENET_STD, (1, 3, 1, 1))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_array_equal(labels, y[idx])
    np.testing.assert_array_equal(val.y, vy)
    (tmp_path / "classes.txt").write_text("a\nb\n")  # a 2-class subset: labels up to 999 are now out of range
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "train_labels_000.npy",
                   "out of range; expected 0..1")


def test_npy_shards_float_nan_and_corrupt_files(tmp_path):
    write_shards(tmp_path, "train", [3, 4], dtype=np.float32)
    write_shards(tmp_path, "test", [2], dtype=np.float32)
    arr = np.load(tmp_path / "train_images_001.npy")
    arr[2, 1, 0, 0] = np.nan
    np.save(tmp_path / "train_images_001.npy", arr)
    train, test = data.load("imagenet", str(tmp_path))  # no val_ shards: test_ ones
    assert len(test) == 2 and train.scale == 1.0
    assert np.isfinite(train.get_batch(np.array([0, 1, 2, 3]))[0]).all()
    one_line_error(DataError, lambda: train.get_batch(np.array([0, 5])), "train_images_001.npy",
                   "sample 2 contains NaN or Inf")
    raw = (tmp_path / "train_images_001.npy").read_bytes()
    (tmp_path / "train_images_001.npy").write_bytes(raw[: len(raw) // 2])
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "train_images_001.npy",
                   "not a readable .npy array")
    np.save(tmp_path / "train_images_001.npy", np.array([{"pickled": 1}] * 4, dtype=object), allow_pickle=True)
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "train_images_001.npy",
                   "not a readable .npy array")
    np.save(tmp_path / "train_images_001.npy", np.zeros((4, 1, 2, 2), np.uint8))
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "shape (4, 1, 2, 2)",
                   "expected N x 3 x H x W")
    np.save(tmp_path / "train_images_001.npy", np.zeros((5, 3, 6, 5), np.float32))
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "train_labels_001.npy", "expected (5,)")
    (tmp_path / "train_labels_001.npy").unlink()
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "no train_labels_001.npy")
    (tmp_path / "train_images_001.npy").rename(tmp_path / "train_images_002.npy")
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), "numbered 000, 002")


# -- synthetic -------------------------------------------------------------------------------------
def test_synthetic_is_deterministic_nonzero_and_learnable():
    train, test = data.load("synthetic", input_shape=(2, 9, 7), num_classes=4, train_size=400, test_size=100, seed=3)
    assert (len(train), len(test), train.input_shape, train.num_classes) == (400, 100, (2, 9, 7), 4)
    x, y = train.get_batch(np.arange(400))
    assert x.dtype == np.float32 and (x != 0).all() and x.std() > 0.5
    again = data.load("synthetic", input_shape=(2, 9, 7), num_classes=4, train_size=400, test_size=100, seed=3)[0]
    np.testing.assert_array_equal(again.get_batch(np.arange(400))[0], x)
    np.testing.assert_array_equal(train.get_batch(np.array([5, 17]))[0], x[[5, 17]])  # independent of the batch
    np.testing.assert_array_equal(train.subset(np.array([17, 5])).get_batch(np.array([0]))[0], x[[17]])
    other = data.load("synthetic", input_shape=(2, 9, 7), num_classes=4, train_size=400, seed=4)[0]
    assert not np.array_equal(other.get_batch(np.arange(4))[0], x[:4])
    # learnable: nearest class centroid of the training images classifies the test images
    centroids = np.stack([x[y == c].mean(0).ravel() for c in range(4)])
    tx, ty = test.get_batch(np.arange(100))
    pred = np.argmin(((tx.reshape(100, 1, -1) - centroids) ** 2).sum(-1), axis=1)
    assert (pred == ty).mean() > 0.9
    one_line_error(ConfigError, lambda: data.load("synthetic", input_shape=(3, 0, 4)), "input_shape (C, H, W)")


# -- registry ----------------------------------------------------------------------------------------
def test_unknown_names_and_options():
    msg = one_line_error(ConfigError, lambda: data.load("cifar1000"), "unknown dataset 'cifar1000'")
    for name in ("mnist5k", "mnist", "fashion_mnist", "cifar10", "cifar100", "imagenet", "synthetic"):
        assert name in msg and name in data.NAMES
    one_line_error(ConfigError, lambda: data.load("synthetic", colour=True), "no option colour", "input_shape")
    one_line_error(ConfigError, lambda: data.load("mnist", size=3), "no option size", "no options")
    one_line_error(ConfigError, lambda: data.fetch("imagenet"), "cannot be downloaded", "cifar10")


# -- downloads -----------------------------------------------------------------------------------------
def sha(b):
    return hashlib.sha256(b).hexdigest()


def test_download_file_url_checksum_and_cache(tmp_path, monkeypatch):
    src = tmp_path / "src" / "blob.bin"
    src.parent.mkdir()
    payload = os.urandom(3 << 20)  # several chunks
    src.write_bytes(payload)
    dest = tmp_path / "cache"
    path = download(src.as_uri(), str(dest), sha(payload), size=len(payload), progress=False)
    assert path == str(dest / "blob.bin") and (dest / "blob.bin").read_bytes() == payload
    src.unlink()  # already there and verified: no download
    assert download(src.as_uri(), str(dest), sha(payload), progress=False) == path
    monkeypatch.setenv("PYDTNN_DATA_DIR", str(tmp_path / "env"))
    assert cache_dir() == str(tmp_path / "env")
    monkeypatch.delenv("PYDTNN_DATA_DIR")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "pydtnn")


def test_download_checksum_mismatch_leaves_nothing(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(b"hello")
    dest = tmp_path / "dest"
    one_line_error(DataError, lambda: download(src.as_uri(), str(dest), sha(b"other"), progress=False),
                   "SHA-256 " + sha(b"hello"), "does not match", "discarded")
    assert os.listdir(dest) == []  # no file, no temporary left behind
    one_line_error(DataError, lambda: download(src.as_uri(), str(dest), None, size=6, progress=False),
                   "5 bytes, expected 6")
    assert os.listdir(dest) == []
    (dest / "a.bin").write_bytes(b"tampered")  # a wrong file already in place is reported, not trusted
    one_line_error(DataError, lambda: download(src.as_uri(), str(dest), sha(b"hello"), progress=False),
                   str(dest / "a.bin"), "does not match", "delete it")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_over_http_from_localhost(tmp_path):
    served = tmp_path / "www"
    served.mkdir()
    payload = os.urandom(100_000)
    (served / "f.gz").write_bytes(payload)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(served)))
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        path = download([f"{base}/missing.gz", f"{base}/f.gz"], str(tmp_path / "d"), sha(payload), filename="f.gz",
                        progress=False, timeout=5)  # the first mirror 404s, the second serves
        assert open(path, "rb").read() == payload
        one_line_error(DataError,
                       lambda: download(f"{base}/f.gz", str(tmp_path / "e"), sha(b"x"), progress=False, timeout=5),
                       "does not match")
        assert os.listdir(tmp_path / "e") == []
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_download_unreachable_says_where_to_put_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PYDTNN_DATA_DIR", str(tmp_path))
    one_line_error(DataError, lambda: download("http://127.0.0.1:1/x.tar.gz", progress=False, timeout=5),
                   "cannot download http://127.0.0.1:1/x.tar.gz", f"put x.tar.gz into {tmp_path} by hand")
    monkeypatch.setitem(registry.REMOTE, "cifar10", [(("http://127.0.0.1:1/",), "cifar-10-binary.tar.gz", None, None)])
    one_line_error(DataError, lambda: data.load("cifar10", download=True), "cannot download",
                   f"put cifar-10-binary.tar.gz into {tmp_path / 'cifar10'}", "train_path=DIR",
                   "cifar-10-batches-bin/", "data_batch_1.bin")
    assert not (tmp_path / "cifar10" / "cifar-10-binary.tar.gz").exists()


def test_fetch_and_extract_cifar10_archive(tmp_path, monkeypatch):
    write_cifar10(tmp_path / "src")
    archive = tmp_path / "cifar-10-binary.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-bin", arcname="cifar-10-batches-bin")
    blob = archive.read_bytes()
    monkeypatch.setenv("PYDTNN_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.REMOTE, "cifar10", [((tmp_path.as_uri() + "/",), archive.name, len(blob), sha(blob))])
    train, test = data.load("cifar10", download=True)
    assert (len(train), len(test)) == (12, 3)
    assert data.fetch("cifar10") == str(tmp_path / "cache" / "cifar10" / "cifar-10-batches-bin")
    assert sorted(os.listdir(tmp_path / "cache" / "cifar10")) == ["cifar-10-batches-bin", "cifar-10-binary.tar.gz"]


def test_fetch_mnist_layout(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    entries = []
    for stem, arr in (("train-images-idx3-ubyte", np.ones((5, 28, 28), np.uint8)),
                      ("train-labels-idx1-ubyte", np.arange(5, dtype=np.uint8)),
                      ("t10k-images-idx3-ubyte", np.ones((2, 28, 28), np.uint8)),
                      ("t10k-labels-idx1-ubyte", np.arange(2, dtype=np.uint8))):
        data.write_idx(src / f"{stem}.gz", arr)
        blob = (src / f"{stem}.gz").read_bytes()
        entries.append(((src.as_uri() + "/",), f"{stem}.gz", len(blob), sha(blob)))
    monkeypatch.setitem(registry.REMOTE, "fashion_mnist", entries)
    root = data.fetch("fashion_mnist", root=str(tmp_path / "c"), progress=False)
    train, test = data.load("fashion_mnist", root)
    assert (len(train), len(test)) == (5, 2)


def test_extract_tar_rejects_corrupt_and_unsafe_archives(tmp_path):
    (tmp_path / "bad.tar.gz").write_bytes(gzip.compress(b"not a tar at all" * 100)[:50])
    one_line_error(DataError, lambda: extract_tar(tmp_path / "bad.tar.gz", tmp_path / "out"), "bad.tar.gz",
                   "corrupt or unreadable tar")
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    one_line_error(DataError, lambda: extract_tar(evil, tmp_path / "out2"), "evil.tar")
    assert not (tmp_path / "escaped.txt").exists()
    assert [n for n in os.listdir(tmp_path / "out2")] == []  # the temporary folder is gone too


# -- validation splits ---------------------------------------------------------------------------------
def small_dataset(n=50):
    rng = np.random.default_rng(0)
    return ArrayDataset(rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8), np.arange(n) % 5, 5, scale=1 / 255,
                        name="toy")


@pytest.mark.parametrize("make", [small_dataset, lambda: ShardedArrayDataset(
    [np.arange(50 * 3 * 2 * 2, dtype=np.uint8).reshape(50, 3, 2, 2)], np.arange(50) % 5, 5, ["mem"], "toy")])
def test_split_validation(make):
    ds = make()
    tr, va = split_validation(ds, 0.2, seed=1)
    assert (len(tr), len(va)) == (40, 10) and va.num_classes == 5
    xt, yt = tr.get_batch(np.arange(40))
    xv, yv = va.get_batch(np.arange(10))
    full, fy = ds.get_batch(np.arange(50))
    rows = {r.tobytes(): i for i, r in enumerate(full.reshape(50, -1))}
    got = [rows[r.tobytes()] for r in np.concatenate([xt, xv]).reshape(50, -1)]
    assert sorted(got) == list(range(50))  # disjoint and covering
    np.testing.assert_array_equal(np.concatenate([yt, yv]), fy[got])
    tr2, va2 = split_validation(ds, 0.2, seed=1)
    np.testing.assert_array_equal(va2.get_batch(np.arange(10))[0], xv)  # fixed by the seed
    assert not np.array_equal(split_validation(ds, 0.2, seed=2)[1].get_batch(np.arange(10))[0], xv)
    assert split_validation(ds, 0.0) == (ds, None)


def test_split_validation_stratified_and_bad_fractions():
    ds = small_dataset(100)
    tr, va = split_validation(ds, 0.3, seed=0, stratify=True)
    assert np.bincount(va.y).tolist() == [6] * 5 and np.bincount(tr.y).tolist() == [14] * 5
    for bad in (-0.1, 1.0, 1.5, True, "0.2"):
        one_line_error(ConfigError, lambda: split_validation(ds, bad), "validation_split must be a fraction in [0, 1)")
    one_line_error(ConfigError, lambda: split_validation(small_dataset(3), 0.1),
                   "leaves 3 for training and 0 for validation")


def test_resolve_validation_rules():
    train, test = small_dataset(20), small_dataset(5)
    assert resolve_validation(train, test) == (train, None)
    assert resolve_validation(train, test, test_as_validation=True) == (train, test)
    tr, va = resolve_validation(train, test, validation_split=0.25, seed=0)
    assert (len(tr), len(va)) == (15, 5)
    one_line_error(ConfigError, lambda: resolve_validation(train, test, 0.2, True),
                   "validation_split=0.2 and test_as_validation=True are exclusive")
    one_line_error(ConfigError, lambda: resolve_validation(train, None, test_as_validation=True), "needs a test set")


# -- refused at load time ------------------------------------------------------------------------------
@contextlib.contextmanager
def deadline(seconds=5):
    """TimeoutError inside the block once it has run `seconds` (e.g. blocked opening a FIFO)."""
    def expire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def not_a_file(path, kind):
    """Put a FIFO, a directory or a symlink to /dev/zero at `path`; returns what the error must call it."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    if kind == "directory":
        path.mkdir()
        return "a directory"
    os.symlink("/dev/zero", path)
    return "a character device"


def deny_reading(monkeypatch, path):
    """Opening `path` fails with EACCES, as after chmod 000 for anyone but root (the tests run as root)."""
    path, real_os_open, real_open = os.fspath(path), os.open, builtins.open

    def check(p):
        if not isinstance(p, int) and os.fspath(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "open", lambda p, *a, **k: check(p) or real_os_open(p, *a, **k))
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: check(p) or real_open(p, *a, **k))


@pytest.mark.parametrize("case", ["idx train", "idx test", "cifar file", "npy shard", "image folder", "val folder"])
def test_an_empty_training_or_test_set_is_refused_at_load(tmp_path, case):
    if case.startswith("idx"):
        write_mnist(tmp_path)
        split = "train" if case == "idx train" else "t10k"
        bad = tmp_path / f"{split}-images-idx3-ubyte.gz"
        data.write_idx(bad, np.zeros((0, 28, 28), np.uint8))
        data.write_idx(tmp_path / f"{split}-labels-idx1-ubyte", np.zeros(0, np.uint8))
        args = ("mnist", str(tmp_path))
    elif case == "cifar file":
        folder, *_ = write_cifar10(tmp_path)
        bad = folder / "data_batch_3.bin"
        bad.write_bytes(b"")
        args = ("cifar10", str(folder))
    elif case == "npy shard":
        write_shards(tmp_path, "train", [3, 2])
        write_shards(tmp_path, "val", [2])
        bad = tmp_path / "train_images_001.npy"
        np.save(bad, np.zeros((0, 3, 6, 5), np.uint8))
        np.save(tmp_path / "train_labels_001.npy", np.zeros(0, np.int64))
        args = ("imagenet", str(tmp_path))
    else:
        write_imagenet(tmp_path)
        bad = tmp_path / ("train" if case == "image folder" else "val")
        for f in bad.glob("*/*"):
            f.unlink()
        args = ("imagenet", str(tmp_path))
    one_line_error(DataError, lambda: data.load(*args), str(bad), "0 samples")


def test_train_and_test_of_different_shapes_or_classes_are_refused_at_load(tmp_path, monkeypatch):
    train_dir, test_dir = tmp_path / "train", tmp_path / "test"
    train_dir.mkdir(), test_dir.mkdir()
    write_mnist(train_dir)
    data.write_idx(test_dir / "t10k-images-idx3-ubyte", np.zeros((3, 32, 32), np.uint8))
    data.write_idx(test_dir / "t10k-labels-idx1-ubyte", np.arange(3, dtype=np.uint8))
    one_line_error(DataError, lambda: data.load("mnist", str(train_dir), str(test_dir)),
                   "(1, 28, 28)", "(1, 32, 32)", str(train_dir), str(test_dir))
    write_shards(train_dir, "train", [3])
    write_shards(test_dir, "val", [2], hw=(8, 8))
    one_line_error(DataError, lambda: data.load("imagenet", str(train_dir), str(test_dir)),
                   "(3, 6, 5)", "(3, 8, 8)", str(train_dir), str(test_dir))
    x = np.zeros((4, 1, 2, 2), np.uint8)
    pair = (ArrayDataset(x, np.arange(4), 10), ArrayDataset(x, np.arange(4), 5))
    monkeypatch.setitem(registry.LOADERS, "mnist", lambda train_path=None, test_path=None: pair)
    one_line_error(DataError, lambda: data.load("mnist", "/data/tr", "/data/te"), "10 classes", "5 classes",
                   "/data/tr", "/data/te")


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
def test_idx_images_of_other_integer_types_are_refused(tmp_path, dtype):
    write_mnist(tmp_path)
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    data.write_idx(bad, np.full((6, 28, 28), 100, dtype))
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(bad), np.dtype(dtype).name, "uint8")


def test_idx_float_images_are_used_as_they_are_and_must_lie_in_0_1(tmp_path):
    write_mnist(tmp_path)
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    x = np.random.default_rng(0).random((6, 28, 28)).astype(np.float32)
    x[0, 0, 0], x[5, 1, 1] = -1e-4, 1 + 1e-4  # rounding in someone's preprocessing: tolerated
    data.write_idx(bad, x)
    train, _ = data.load("mnist", str(tmp_path))
    np.testing.assert_allclose(train.get_batch(np.arange(6))[0][:, 0], x, rtol=1e-6)  # not divided by 255
    x[3] *= 255
    data.write_idx(bad, x)
    one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(bad), "sample 3",
                   f"{x[3].min():g}", f"{x[3].max():g}", "[0, 1]")


def test_npy_shards_of_other_dtypes_or_out_of_range_floats_are_refused(tmp_path):
    write_shards(tmp_path, "train", [3, 4])
    write_shards(tmp_path, "val", [2])
    bad = tmp_path / "train_images_001.npy"
    np.save(bad, np.full((4, 3, 6, 5), 1000, np.uint16))
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), str(bad), "uint16", "uint8")
    write_shards(tmp_path, "train", [3, 4], dtype=np.float32)
    x = np.load(bad)
    x[2] *= 255
    np.save(bad, x)
    train, _ = data.load("imagenet", str(tmp_path))  # memory-mapped: checked as its batches are read
    assert train.get_batch(np.arange(5))[0].shape == (5, 3, 6, 5)
    one_line_error(DataError, lambda: train.get_batch(np.array([0, 5])), str(bad), "sample 2",
                   f"{x[2].max():g}", "[0, 1]")
    header = b"{'descr': '|u1', 'fortran_order': False, 'shape': (99999999999999999999999, 3, 6, 5), }"
    header += b" " * (117 - len(header)) + b"\n"
    bad.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(100))
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), str(bad), "not a readable .npy array")


@pytest.mark.parametrize("kind", ["fifo", "directory", "/dev/zero"])
def test_idx_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    write_mnist(tmp_path)
    path = tmp_path / "train-labels-idx1-ubyte"
    word = not_a_file(path, kind)
    with deadline():
        one_line_error(DataError, lambda: data.load("mnist", str(tmp_path)), str(path), word)
        one_line_error(DataError, lambda: data.read_idx(path), str(path), word)


@pytest.mark.parametrize("name,kind", [("data_batch_1.bin", "directory"), ("data_batch_2.bin", "/dev/zero"),
                                       ("test_batch.bin", "fifo"), ("data_batch_4.bin", "permission")])
def test_unreadable_cifar_file_is_one_line_and_never_blocks(tmp_path, monkeypatch, name, kind):
    folder, *_ = write_cifar10(tmp_path)
    path = folder / name
    if kind == "permission":
        deny_reading(monkeypatch, path)
        words = ["cannot read CIFAR file", "Permission denied"]
    else:
        words = [not_a_file(path, kind)]
    with deadline():
        one_line_error(DataError, lambda: data.load("cifar10", str(tmp_path)), str(path), *words)


@pytest.mark.parametrize("name,kind", [("train_images_001.npy", "fifo"), ("train_labels_000.npy", "directory"),
                                       ("val_images_000.npy", "/dev/zero")])
def test_npy_shard_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, name, kind):
    write_shards(tmp_path, "train", [3, 4])
    write_shards(tmp_path, "val", [2])
    path = tmp_path / name
    word = not_a_file(path, kind)
    with deadline():
        one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), str(path), word)


@pytest.mark.parametrize("kind", ["not utf-8", "fifo", "/dev/zero", "huge", "no classes"])
def test_bad_classes_txt_is_refused_without_blocking(tmp_path, kind):
    write_shards(tmp_path, "train", [3])
    write_shards(tmp_path, "val", [2])
    path = tmp_path / "classes.txt"
    if kind == "not utf-8":
        path.write_bytes("n01\nn02 caf\xe9\n".encode("latin-1"))
        words = ["UTF-8", "line 2"]
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(64 << 20)  # sparse: no disk used
        words = ["67,108,864 bytes", "at most"]
    elif kind == "no classes":
        path.write_text("\n  \n")
        words = ["no class names"]
    else:
        words = [not_a_file(path, kind)]
    with deadline():
        one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), str(path), *words)


def test_unreadable_class_folder_or_image_is_a_data_error(tmp_path, monkeypatch):
    write_imagenet(tmp_path)
    train, _ = data.load("imagenet", str(tmp_path), size=16, resize=20)
    image = tmp_path / "train" / "n02" / "n02_1.JPEG"
    word = not_a_file(image, "fifo")  # replaced after the folder was listed
    with deadline():
        one_line_error(DataError, lambda: train.get_batch(np.array([5])), str(image), word)
    sub, scandir = os.fspath(tmp_path / "train" / "n03"), os.scandir

    def refuse(p="."):
        if os.fspath(p) == sub:
            raise PermissionError(errno.EACCES, "Permission denied", sub)
        return scandir(p)

    monkeypatch.setattr(os, "scandir", refuse)
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path)), sub, "Permission denied")


# -- the real Fashion-MNIST -----------------------------------------------------------------------------
FASHION_RUN = """
import json, sys, time
import numpy as np
from pydtnn import data, models
from pydtnn.backends import CPUBackend
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD
from pydtnn.trainer import Trainer
t0 = time.perf_counter()
train, test = data.load("fashion_mnist", sys.argv[1])
assert (len(train), len(test)) == (60000, 10000)
subset = train.subset(np.random.default_rng(0).permutation(60000)[:30000])
model = models.create("simplemlp", backend=CPUBackend(seed=0))
trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.05, momentum=0.9), seed=0, progress=False)
trainer.fit(subset, epochs=3, batch_size=64)
print(json.dumps({**trainer.evaluate(test, 1000), "seconds": time.perf_counter() - t0}))
"""


def test_simplemlp_learns_real_fashion_mnist():
    """simplemlp, SGD (lr 0.05, momentum 0.9, batch 64), 3 epochs on 30,000 of the 60,000 training
    images, one BLAS thread: at least 83% accuracy on the full 10,000-image test set (measured
    85.3% in about 4 s). Run in a subprocess so the BLAS thread count can be fixed at 1: with the
    default (all cores) on a busy machine, OpenBLAS threads spin against each other, 15x slower."""
    if not os.path.isdir(FASHION_DIR):
        reason = f"{FASHION_DIR} is absent; install it with: apt-get install dataset-fashion-mnist"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", FASHION_RUN, FASHION_DIR], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"fashion_mnist simplemlp: test accuracy {result['accuracy']:.4f} in {result['seconds']:.1f} s")
    assert result["accuracy"] >= 0.83
