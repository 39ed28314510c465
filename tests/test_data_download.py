"""Getting a dataset with no path: the data directory ($PYDTNN_DATA), finding an already-fetched copy,
load(..., download=True) over file:// URLs, and the messages that say what to do (--download,
'did you mean', a missing folder named as a folder).

Files are small but in the real formats (gzipped IDX, CIFAR binary records in a .tar.gz), put where
fetch() puts them; the URL table (REMOTE) is pointed at file:// copies, so no test needs the network.
"""

import gzip
import hashlib
import importlib
import os
import tarfile

import numpy as np
import pytest

from pydtnn import data
from pydtnn.data import datasets as registry
from pydtnn.errors import ConfigError, DataError
from pydtnn.suggest import did_you_mean
from test_datasets import one_line_error

dl = importlib.import_module("pydtnn.data.download")  # pydtnn.data.download is also the name of a function
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def sha(b):
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A fresh data directory named by $PYDTNN_DATA (the older variable unset)."""
    monkeypatch.delenv("PYDTNN_DATA_DIR", raising=False)
    root = tmp_path / "data"
    monkeypatch.setenv("PYDTNN_DATA", str(root))
    return root


def write_mnist_gz(folder, n_train=5, n_test=2):
    """The four gzipped MNIST IDX files in `folder`; returns REMOTE entries serving them from there."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8), np.arange(n_train, dtype=np.uint8) % 10,
              rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8), np.arange(n_test, dtype=np.uint8))
    entries = []
    for stem, a in zip(IDX_STEMS, arrays):
        data.write_idx(folder / f"{stem}.gz", a)
        blob = (folder / f"{stem}.gz").read_bytes()
        entries.append(((folder.as_uri() + "/",), f"{stem}.gz", len(blob), sha(blob)))
    return entries


def write_cifar10_archive(tmp_path, n_per_batch=2, n_test=3):
    """cifar-10-binary.tar.gz holding cifar-10-batches-bin/ (real records); returns its path."""
    src = tmp_path / "src" / "cifar-10-batches-bin"
    src.mkdir(parents=True)
    rng = np.random.default_rng(2)

    def records(n):
        return np.concatenate([rng.integers(0, 10, (n, 1)), rng.integers(0, 256, (n, 3072))], 1).astype(np.uint8)

    for i in range(1, 6):
        (src / f"data_batch_{i}.bin").write_bytes(records(n_per_batch).tobytes())
    (src / "test_batch.bin").write_bytes(records(n_test).tobytes())
    archive = tmp_path / "www" / "cifar-10-binary.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="cifar-10-batches-bin")
    return archive


def serve(monkeypatch, name, path):
    """Point REMOTE[name] at the single file `path` (file:// URL, its true size and SHA-256)."""
    blob = path.read_bytes()
    monkeypatch.setitem(registry.REMOTE, name, [((path.parent.as_uri() + "/",), path.name, len(blob), sha(blob))])


def no_hashing(monkeypatch):
    def refuse(path):
        raise AssertionError(f"hashed {path}: finding a fetched copy must only compare sizes")

    monkeypatch.setattr(dl, "sha256_file", refuse)


# -- the data directory ------------------------------------------------------------------------------
def test_data_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PYDTNN_DATA", raising=False)
    monkeypatch.delenv("PYDTNN_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.cache_dir() == str(tmp_path / "home" / ".cache" / "pydtnn")
    monkeypatch.setenv("PYDTNN_DATA_DIR", str(tmp_path / "old"))  # the older name still works
    assert data.cache_dir() == str(tmp_path / "old")
    monkeypatch.setenv("PYDTNN_DATA", str(tmp_path / "new"))  # the new name wins
    assert data.cache_dir() == str(tmp_path / "new")
    monkeypatch.setenv("PYDTNN_DATA_DIR", "")  # not read when PYDTNN_DATA is set
    assert data.cache_dir() == str(tmp_path / "new")
    monkeypatch.setenv("PYDTNN_DATA", "~/sets")
    assert data.cache_dir() == str(tmp_path / "home" / "sets")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYDTNN_DATA", "rel")
    assert data.cache_dir() == str(tmp_path / "rel")


@pytest.mark.parametrize("var", ["PYDTNN_DATA", "PYDTNN_DATA_DIR"])
def test_data_directory_variable_is_validated(tmp_path, monkeypatch, var):
    monkeypatch.delenv("PYDTNN_DATA", raising=False)
    monkeypatch.delenv("PYDTNN_DATA_DIR", raising=False)
    monkeypatch.setenv(var, "")
    one_line_error(ConfigError, data.cache_dir, f"environment variable {var}", "''", "expected the folder")
    monkeypatch.setenv(var, "   ")
    one_line_error(ConfigError, data.cache_dir, var, "'   '")
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv(var, str(afile))
    one_line_error(ConfigError, data.cache_dir, f"{var}={str(afile)!r}", "is a file, not a folder",
                   "expected the folder")
    # where it matters: a load with no path says so, instead of failing inside
    one_line_error(ConfigError, lambda: data.load("mnist"), var, str(afile))
    one_line_error(ConfigError, lambda: data.locate("cifar10"), var, str(afile))
    data.load("mnist", str(registry.EMBEDDED_DIR))  # a given path never reads the variable
    monkeypatch.setenv(var, str(tmp_path / "not_yet"))  # a folder that does not exist yet is fine
    assert data.cache_dir() == str(tmp_path / "not_yet")


# -- finding an already-fetched copy ------------------------------------------------------------------
def test_finds_mnist_fetched_by_an_older_version_without_hashing(data_dir, monkeypatch):
    entries = write_mnist_gz(data_dir / "mnist")  # exactly where fetch() puts them; no marker
    monkeypatch.setitem(registry.REMOTE, "mnist", entries)
    no_hashing(monkeypatch)
    assert data.locate("mnist") == str(data_dir / "mnist")
    train, test = data.load("mnist")
    assert (len(train), len(test), train.input_shape) == (5, 2, (1, 28, 28))
    assert data.locate("fashion_mnist") is None  # another dataset's folder is not it
    assert data.locate("imagenet") is None and data.locate("synthetic") is None


def test_incomplete_copy_is_not_used_and_says_what_is_missing(data_dir, monkeypatch):
    entries = write_mnist_gz(data_dir / "mnist")
    monkeypatch.setitem(registry.REMOTE, "mnist", entries)
    (data_dir / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()  # an interrupted fetch
    assert data.locate("mnist") is None
    one_line_error(DataError, lambda: data.load("mnist"), f"dataset mnist in {data_dir / 'mnist'} is incomplete",
                   "no t10k-labels-idx1-ubyte.gz", "download=True")
    raw = (data_dir / "mnist" / "train-images-idx3-ubyte.gz").read_bytes()
    (data_dir / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(raw[:-10])  # sizes differ from the published
    write_mnist_gz(data_dir / "other")
    os.replace(data_dir / "other" / "t10k-labels-idx1-ubyte.gz", data_dir / "mnist" / "t10k-labels-idx1-ubyte.gz")
    assert data.locate("mnist") is None
    one_line_error(DataError, lambda: data.load("mnist"), "train-images-idx3-ubyte.gz", f"{len(raw) - 10} bytes",
                   f"expected {len(raw)}")


def test_finds_cifar10_extracted_by_an_older_version(data_dir, tmp_path, monkeypatch):
    archive = write_cifar10_archive(tmp_path)
    serve(monkeypatch, "cifar10", archive)
    (data_dir / "cifar10").mkdir(parents=True)
    os.link(archive, data_dir / "cifar10" / archive.name)
    data.extract_tar(archive, data_dir / "cifar10")
    sha256_file = dl.sha256_file
    no_hashing(monkeypatch)
    folder = data_dir / "cifar10" / "cifar-10-batches-bin"
    assert data.locate("cifar10") == str(folder)
    train, test = data.load("cifar10")
    assert (len(train), len(test)) == (10, 3)
    monkeypatch.setattr(dl, "sha256_file", sha256_file)
    inode = (folder / "test_batch.bin").stat().st_ino
    assert data.fetch("cifar10") == str(folder)  # the archive checked; the complete folder kept, now recorded
    assert (folder / "test_batch.bin").stat().st_ino == inode and (folder / registry.MARKER).is_file()
    (folder / "data_batch_3.bin").unlink()
    assert data.locate("cifar10") is None
    one_line_error(DataError, lambda: data.load("cifar10"), "incomplete",
                   "no cifar-10-batches-bin/data_batch_3.bin (fetched with 6146 bytes)", "download=True")
    assert len(data.load("cifar10", download=True)[0]) == 10  # extracted again
    assert (folder / "data_batch_3.bin").stat().st_size == 2 * 3073


# -- download=True ----------------------------------------------------------------------------------
def test_download_true_fetches_once_then_finds_the_copy(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(registry.REMOTE, "fashion_mnist", write_mnist_gz(tmp_path / "www"))
    one_line_error(DataError, lambda: data.load("fashion_mnist"), "is not in", "download=True")
    umask = os.umask(0o027)
    try:
        train, test = data.load("fashion_mnist", download=True)
    finally:
        os.umask(umask)
    for f in os.listdir(data_dir / "fashion_mnist"):  # the umask's permissions (group-readable), not 0600
        assert (data_dir / "fashion_mnist" / f).stat().st_mode & 0o777 == 0o640, f
    assert (len(train), len(test)) == (5, 2)
    assert sorted(os.listdir(data_dir / "fashion_mnist")) == sorted(
        [".pydtnn-fetched.json"] + [f"{s}.gz" for s in IDX_STEMS])  # no temporary left
    for stem in IDX_STEMS:
        os.remove(tmp_path / "www" / f"{stem}.gz")  # the source is gone: a second run must not need it
    no_hashing(monkeypatch)
    assert data.locate("fashion_mnist") == str(data_dir / "fashion_mnist")
    train, _ = data.load("fashion_mnist")
    assert len(train) == 5
    assert len(data.load("fashion_mnist", download=True)[0]) == 5  # found: nothing fetched, nothing hashed
    err = capsys.readouterr().err
    assert err.count("pydtnn: downloading file://") == 4 and err.count("pydtnn: downloaded ") == 4  # the first run


def test_download_true_cifar10_extracts_and_the_marker_keeps_it_found(data_dir, tmp_path, monkeypatch):
    archive = write_cifar10_archive(tmp_path)
    serve(monkeypatch, "cifar10", archive)
    train, test = data.load("cifar10", download=True)
    assert (len(train), len(test)) == (10, 3)
    folder = data_dir / "cifar10" / "cifar-10-batches-bin"
    assert (folder / registry.MARKER).is_file()
    os.remove(data_dir / "cifar10" / archive.name)  # the archive deleted to save space: still found
    no_hashing(monkeypatch)
    assert data.locate("cifar10") == str(folder)
    monkeypatch.undo()
    monkeypatch.setenv("PYDTNN_DATA", str(data_dir))
    serve(monkeypatch, "cifar10", archive)
    batch = folder / "data_batch_2.bin"
    batch.write_bytes(batch.read_bytes()[:3073])  # truncated since: the marker's sizes say so
    assert data.locate("cifar10") is None
    one_line_error(DataError, lambda: data.load("cifar10"), "incomplete",
                   f"cifar-10-batches-bin/data_batch_2.bin: 3073 bytes, {2 * 3073} when fetched", "download=True")
    train, _ = data.load("cifar10", download=True)  # fetched and extracted again
    assert len(train) == 10 and batch.stat().st_size == 2 * 3073


def test_download_checksum_mismatch_leaves_no_file(data_dir, tmp_path, monkeypatch):
    archive = write_cifar10_archive(tmp_path)
    blob = archive.read_bytes()
    monkeypatch.setitem(registry.REMOTE, "cifar10",
                        [((archive.parent.as_uri() + "/",), archive.name, len(blob), sha(b"another file"))])
    one_line_error(DataError, lambda: data.load("cifar10", download=True), "SHA-256", sha(blob), "does not match",
                   "discarded")
    assert os.listdir(data_dir / "cifar10") == []  # neither the file nor a temporary
    assert data.locate("cifar10") is None
    one_line_error(DataError, lambda: data.load("cifar10"), "download=True")


def test_download_unreachable_says_where_to_put_the_files(data_dir, monkeypatch):
    monkeypatch.setitem(registry.REMOTE, "mnist", [((data_dir.parent.as_uri() + "/absent/",),
                                                    "train-images-idx3-ubyte.gz", None, None)])
    one_line_error(DataError, lambda: data.load("mnist", download=True), "cannot download",
                   f"put train-images-idx3-ubyte.gz into {data_dir / 'mnist'} by hand", "train_path=DIR")


# -- messages that say what to do ----------------------------------------------------------------------
@pytest.mark.parametrize("name,size", [("cifar10", "170 MB"), ("cifar100", "169 MB"), ("mnist", "12 MB"),
                                       ("fashion_mnist", "31 MB")])
def test_not_found_says_how_to_get_it_in_python_and_from_the_command_line(data_dir, name, size):
    from pydtnn.cli import in_flag_terms

    msg = one_line_error(DataError, lambda: data.load(name),
                         f"dataset {name} is not in {data_dir / name}", "pass download=True", f"({size})",
                         "train_path=DIR")
    assert "pydtnn.data.fetch" not in msg
    assert "pass --download" in in_flag_terms(msg) and "--dataset_train_path DIR" in in_flag_terms(msg)
    with pytest.raises(data.DatasetNotFound):  # also a ConfigError, as it was before
        data.load(name)
    assert issubclass(data.DatasetNotFound, ConfigError)


def test_did_you_mean():
    assert did_you_mean("cifar", data.NAMES) == "; did you mean 'cifar10'?"
    assert did_you_mean("Fashion-MNIST", data.NAMES) == "; did you mean 'fashion_mnist'?"
    assert did_you_mean("resnet", data.NAMES) == ""
    one_line_error(ConfigError, lambda: data.load("cifar"),
                   "unknown dataset 'cifar'; did you mean 'cifar10'? expected one of mnist5k, mnist,")
    msg = one_line_error(ConfigError, lambda: data.load("xyzzy"), "unknown dataset 'xyzzy'; expected one of")
    assert "did you mean" not in msg
    one_line_error(ConfigError, lambda: data.fetch("imagnet"), "did you mean 'imagenet'?")
    one_line_error(ConfigError, lambda: data.locate("fashionmnist"), "did you mean 'fashion_mnist'?")
    one_line_error(ConfigError, lambda: data.load("synthetic", seeds=1), "no option seeds; did you mean 'seed'?")


def test_missing_folder_is_named_as_a_folder(tmp_path):
    missing, afile = tmp_path / "missing", tmp_path / "afile"
    afile.write_bytes(b"x")
    one_line_error(DataError, lambda: data.load("mnist", str(missing)), f"dataset folder {missing} does not exist",
                   "expected a folder holding the four MNIST IDX files", "t10k-labels-idx1-ubyte")
    one_line_error(DataError, lambda: data.load("fashion_mnist", str(afile)),
                   f"dataset folder {afile} is a file, not a folder", "train-images-idx3-ubyte")
    one_line_error(DataError, lambda: data.load("mnist", str(registry.EMBEDDED_DIR), str(missing)),
                   f"dataset test folder {missing} does not exist", "t10k-images-idx3-ubyte and t10k-labels")
    one_line_error(DataError, lambda: data.load("cifar10", str(missing)), f"dataset folder {missing} does not exist",
                   "cifar-10-batches-bin/", "data_batch_1.bin..data_batch_5.bin, test_batch.bin")
    one_line_error(DataError, lambda: data.load("cifar100", str(afile)), f"dataset folder {afile} is a file",
                   "cifar-100-binary/", "train.bin")
    archive = tmp_path / "cifar-10-binary.tar.gz"
    archive.write_bytes(gzip.compress(b""))
    one_line_error(DataError, lambda: data.load("cifar10", str(archive)), "is an archive, not a folder",
                   f"tar xzf {archive}")
    one_line_error(DataError, lambda: data.load("imagenet", str(missing)), f"dataset folder {missing} does not exist",
                   "ROOT/train/<class>/*.JPEG", "train_images_000.npy")
    (tmp_path / "root" / "train" / "n01").mkdir(parents=True)
    one_line_error(DataError, lambda: data.load("imagenet", str(tmp_path / "root"), str(afile)),
                   f"dataset test folder {afile} is a file, not a folder", "val/")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_error(DataError, lambda: data.load("mnist", str(fifo)), "is a FIFO (named pipe), not a folder")


# -- progress ----------------------------------------------------------------------------------------
def test_progress_is_a_bar_on_a_terminal_and_two_lines_otherwise(tmp_path, monkeypatch, capsys):
    src = tmp_path / "blob.bin"
    payload = os.urandom(3 << 20)
    src.write_bytes(payload)
    data.download(src.as_uri(), tmp_path / "a", sha(payload))  # stderr is not a terminal under pytest
    err = capsys.readouterr().err
    assert err.splitlines() == [f"pydtnn: downloading {src.as_uri()} (3.1 MB)",
                                f"pydtnn: downloaded {tmp_path / 'a' / 'blob.bin'} (3.1 MB, size and SHA-256 checked)"]
    monkeypatch.setattr(dl, "is_terminal", lambda stream: True)
    data.download(src.as_uri(), tmp_path / "b", sha(payload))
    err = capsys.readouterr().err
    assert "pydtnn: download" not in err and "\r" in err and "blob.bin" in err  # tqdm's bar, redrawn in place
    data.download(src.as_uri(), tmp_path / "c", sha(payload), progress=False)
    assert capsys.readouterr().err == ""


def test_an_unwritable_data_folder_is_one_line(data_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.REMOTE, "fashion_mnist", write_mnist_gz(tmp_path / "www"))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(data_dir / "fashion_mnist"))

    monkeypatch.setattr(dl, "temp_file", refuse)  # as root, no folder is unwritable: refuse the first write
    one_line_error(DataError, lambda: data.load("fashion_mnist", download=True), "cannot write dataset fashion_mnist",
                   "Permission denied", "PYDTNN_DATA")
