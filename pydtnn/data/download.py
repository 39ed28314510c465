"""Downloads into the data directory, verified by SHA-256, written atomically, and archive extraction.

The data directory is $PYDTNN_DATA, else $PYDTNN_DATA_DIR (the older name, still read), else
~/.cache/pydtnn. A file is downloaded to a temporary name in its destination folder and renamed only
once its size and SHA-256 match, so an interrupted or corrupt download never leaves a file under the
final name. Progress is a bar when stderr is a terminal, else one line when a download starts and one
when it is verified (logs of batch jobs stay readable).
"""

import hashlib
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from pydtnn.errors import ConfigError, DataError
from pydtnn.files import is_terminal, kind_of

CHUNK = 1 << 20
ENV_VARS = ("PYDTNN_DATA", "PYDTNN_DATA_DIR")  # read in this order; PYDTNN_DATA_DIR is the older name


def cache_dir():
    """Root of downloaded datasets (absolute): $PYDTNN_DATA, else $PYDTNN_DATA_DIR, else ~/.cache/pydtnn.

    ConfigError, naming the variable and its value, if the one read is empty or names something that
    exists and is not a folder; a folder that does not exist yet is fine (downloads create it).
    """
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value is None:
            continue
        if not value.strip():
            raise ConfigError(f"environment variable {var} is set to {value!r}; expected the folder for downloaded "
                              f"datasets (or unset it to use ~/.cache/pydtnn)")
        path = os.path.abspath(os.path.expanduser(value))
        origin = f"environment variable {var}={value!r}" + (f" ({path})" if path != value else "")
        return _folder_or_absent(path, origin)
    default = os.path.join(os.path.expanduser("~"), ".cache", "pydtnn")
    return _folder_or_absent(default, f"the default data directory {default} (no PYDTNN_DATA set)")


def _folder_or_absent(path, origin):
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as e:
        raise ConfigError(f"{origin}: cannot read it ({e.strerror or e}); expected the folder for downloaded "
                          f"datasets") from None
    kind = kind_of(mode)
    if kind == "a directory":
        return path
    raise ConfigError(f"{origin} is {kind or 'a file'}, not a folder; expected the folder for downloaded datasets "
                      f"(set PYDTNN_DATA to one)")


def human_size(n):
    """'170 MB', '12 MB', '4.5 kB', '17 bytes': decimal units, as download sizes are usually quoted."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v >= 9.95 else f"{v:.1f} {unit}"
    return f"{n} bytes"


def temp_file(folder, prefix):
    """(fd, path) of a new file folder/prefix<random>.part, opened for writing.

    Unlike tempfile.mkstemp (always 0600), its permissions follow the umask, as any file the user
    writes: a data directory shared by a group stays readable by the group once renamed into place.
    """
    for _ in range(100):
        path = os.path.join(folder, f"{prefix}{os.urandom(6).hex()}.part")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {folder}")


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
    try:
        os.makedirs(dest_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create folder {dest_dir} for {filename}: {e.strerror or e}; "
                        f"expected a writable folder (set PYDTNN_DATA to another)") from None
    errors = []
    for u in urls:
        fd, tmp = temp_file(dest_dir, f".{filename}.")
        try:
            with os.fdopen(fd, "wb") as out:
                _fetch(u, out, filename, progress, timeout)
            _verify(tmp, u, sha256, size, "the download was discarded")
            os.replace(tmp, path)
            if progress and not is_terminal(sys.stderr):
                checked = "size and SHA-256 checked" if sha256 else "size checked" if size is not None else "unchecked"
                say(f"downloaded {path} ({human_size(os.path.getsize(path))}, {checked})")
            return path
        except DataError:
            raise
        except (urllib.error.URLError, OSError, socket.timeout, ValueError) as e:
            errors.append(f"{u} ({_reason(e)})")
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    raise DataError(f"cannot download {'; '.join(errors)}; {hint or f'put {filename} into {dest_dir} by hand'}")


def say(line):
    """One progress line on stderr (downloads and extraction, when stderr is not a terminal)."""
    print(f"pydtnn: {line}", file=sys.stderr, flush=True)


def _fetch(url, out, filename, progress, timeout):
    from tqdm import tqdm

    with urllib.request.urlopen(url, timeout=timeout) as response:
        total = response.headers.get("Content-Length")
        total = int(total) if total and total.strip().isdigit() else None
        show_bar = progress and is_terminal(sys.stderr)
        if progress and not show_bar:
            say(f"downloading {url} ({human_size(total) if total is not None else 'size unknown'})")
        with tqdm(total=total, unit="B", unit_scale=True, desc=filename, disable=not show_bar, leave=False,
                  file=sys.stderr) as bar:
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
