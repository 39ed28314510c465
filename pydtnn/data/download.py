"""Downloads into a cache directory, verified by SHA-256, written atomically, and archive extraction.

The cache is ~/.cache/pydtnn unless the environment variable PYDTNN_DATA_DIR names another.
A file is downloaded to a temporary name in its destination folder and renamed only once its size
and SHA-256 match, so an interrupted or corrupt download never leaves a file under the final name.
"""

import hashlib
import os
import shutil
import socket
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from pydtnn.errors import DataError

CHUNK = 1 << 20


def cache_dir():
    """Root of downloaded datasets: $PYDTNN_DATA_DIR, else ~/.cache/pydtnn."""
    return os.environ.get("PYDTNN_DATA_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pydtnn")


def sha256_file(path):
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url, dest_dir=None, sha256=None, filename=None, size=None, hint=None, progress=True, timeout=60):
    """Path of `url` downloaded into dest_dir (default cache_dir()), verified; reused when present.

    url: one URL or a list of mirrors tried in order (any scheme urllib opens: https, http, file).
    sha256, size: expected hex digest and byte count (None: not checked). A file already at the
    destination is checked the same way and kept. hint: what to tell the user when no URL answers
    (default: where to put the file by hand). Raises DataError, leaving no file behind, when the
    download fails or does not match.
    """
    urls = [url] if isinstance(url, str) else list(url)
    dest_dir = os.fspath(dest_dir or cache_dir())
    filename = filename or os.path.basename(urllib.parse.urlparse(urls[0]).path)
    path = os.path.join(dest_dir, filename)
    if os.path.isfile(path):
        _verify(path, path, sha256, size, "delete it to download again")
        return path
    os.makedirs(dest_dir, exist_ok=True)
    errors = []
    for u in urls:
        fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".part", dir=dest_dir)
        try:
            with os.fdopen(fd, "wb") as out:
                _fetch(u, out, filename, progress, timeout)
            _verify(tmp, u, sha256, size, "the download was discarded")
            os.replace(tmp, path)
            return path
        except DataError:
            raise
        except (urllib.error.URLError, OSError, socket.timeout, ValueError) as e:
            errors.append(f"{u} ({_reason(e)})")
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    raise DataError(f"cannot download {'; '.join(errors)}; {hint or f'put {filename} into {dest_dir} by hand'}")


def _fetch(url, out, filename, progress, timeout):
    from tqdm import tqdm

    with urllib.request.urlopen(url, timeout=timeout) as response:
        total = response.headers.get("Content-Length")
        with tqdm(total=int(total) if total else None, unit="B", unit_scale=True, desc=filename,
                  disable=not progress, leave=False) as bar:
            for chunk in iter(lambda: response.read(CHUNK), b""):
                out.write(chunk)
                bar.update(len(chunk))


def _verify(path, origin, sha256, size, consequence):
    got_size = os.path.getsize(path)
    if size is not None and got_size != size:
        raise DataError(f"{origin}: {got_size} bytes, expected {size}; {consequence}")
    if sha256 is not None:
        got = sha256_file(path)
        if got != sha256.lower():
            raise DataError(f"{origin}: SHA-256 {got} does not match the expected {sha256}; {consequence}")


def _reason(e):
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
    return " ".join(str(reason).split())


def extract_tar(archive, dest_dir):
    """Extract a (gzipped) tar archive into dest_dir, atomically per top-level entry.

    Members are extracted into a temporary folder next to the destination (with tarfile's "data"
    filter: no absolute paths, links out of the tree or device files), then renamed into place.
    Returns the top-level names extracted. DataError if the archive is corrupt.
    """
    archive, dest_dir = os.fspath(archive), os.fspath(dest_dir)
    os.makedirs(dest_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".extract.", dir=dest_dir)
    try:
        try:
            with tarfile.open(archive) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:  # Python without extraction filters: allow plain files and folders inside the tree only
                    for m in tar.getmembers():
                        if not (m.isfile() or m.isdir()) or os.path.isabs(m.name) or ".." in m.name.split("/"):
                            raise tarfile.TarError(f"unsafe member {m.name!r}")
                    tar.extractall(tmp)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"{archive}: corrupt or unreadable tar archive ({_reason(e)})") from None
        names = sorted(os.listdir(tmp))
        for name in names:
            target = os.path.join(dest_dir, name)
            if not os.path.exists(target):
                os.replace(os.path.join(tmp, name), target)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
