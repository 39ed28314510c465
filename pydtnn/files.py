"""A user's files, read and written safely.

Reading: regular files only, of bounded size. A FIFO, a device or /dev/zero (directly or through a
symlink) where a file is expected would block forever in open() or read until memory runs out. Every
reader of a file named by the user goes through open_regular() or read_bytes(): the file is opened
without blocking and checked to be a regular file before a byte is read.

Writing: every output (checkpoint, trace, history, ONNX graph) goes through write_atomic(): a
synced temporary file renamed into place, so that a reader never sees half a file.
"""

import os
import stat

from pydtnn.errors import ConfigError

TMP = ".tmp"  # suffix of a file being written (or written but not yet renamed)
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def kind_of(mode):
    """'a FIFO (named pipe)', 'a directory', ... for a non-regular st_mode; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path, what, error=ConfigError):
    """A binary file object for `path`, which must be a regular file (symlinks followed).

    what: how the error names the file ('config file', 'weights file'). A missing file raises
    FileNotFoundError unchanged, so callers can phrase it; anything that is not a regular file
    raises `error` naming what it is; other OS errors raise `error` with the system's reason.
    """
    path = os.fspath(path)
    try:  # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting forever
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise error(f"{what} {path} is a directory; expected a regular file") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        kind = kind_of(os.fstat(fd).st_mode)
        if kind is not None:
            raise error(f"{what} {path} is {kind}; expected a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, what, limit=None, error=ConfigError):
    """The whole content of regular file `path`, at most `limit` bytes (None: any size).

    Raises FileNotFoundError for a missing file (see open_regular) and `error` for anything else.
    """
    with open_regular(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise error(f"{what} {os.fspath(path)} is {size:,} bytes; expected at most {limit:,}")
        try:
            data = f.read() if limit is None else f.read(limit + 1)
        except OSError as e:
            raise error(f"cannot read {what} {os.fspath(path)}: {e.strerror or e}") from None
    if limit is not None and len(data) > limit:  # grew while being read
        raise error(f"{what} {os.fspath(path)} is over {limit:,} bytes; expected at most {limit:,}")
    return data


def check_writable(path, what, made=None):
    """`path` if a file can be written there: its folder exists and is writable, and nothing but a
    regular file stands at `path` (a directory, or a FIFO that would block the writer). Checked
    before a run starts, so that a bad output path costs nothing and leaves nothing half-written.

    made: a folder the run itself creates (the checkpoint directory); a file inside it is fine
    before it exists, when the folder holding it can be made.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if made is not None and not os.path.lexists(folder):
        made = os.path.abspath(made)
        if os.path.commonpath([folder, made]) == made:
            while not os.path.lexists(folder):
                folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write {what} {path}: {folder} is not a writable directory")
    try:
        kind = kind_of(os.stat(path).st_mode)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise ConfigError(f"cannot write {what} {path}: {e.strerror or e}") from None
    if kind is not None:
        raise ConfigError(f"cannot write {what} {path}: it is {kind}; expected a file name")
    return path


def is_terminal(stream):
    """Whether `stream` (e.g. sys.stderr) is an interactive terminal; False for files, pipes, closed streams."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def write_atomic(path, data):
    """Write bytes to `path` via a synced temporary file and a rename: readers never see half a file,
    and a failure leaves neither a temporary file nor a broken one (ConfigError naming the path).
    Creates the folder holding `path`."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_synced(path + TMP, data)
        os.replace(path + TMP, path)
    except OSError as e:
        remove_if_present(path + TMP)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None


def write_synced(path, data):
    """Write bytes to a new file at `path` and fsync it, replacing whatever is there (OSError on failure)."""
    # a temporary file is ours to replace; removing what is there first means a FIFO left in its
    # place cannot block open(), and "x" refuses anything that appears in between
    remove_if_present(path)
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove_if_present(path):
    """Delete the file at `path`; nothing happens if it is absent or cannot be removed."""
    try:
        os.remove(path)
    except OSError:
        pass
