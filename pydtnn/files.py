"""A user's files, read and written safely.

Reading: regular files only, of bounded size. A FIFO, a device or /dev/zero (directly or through a
symlink) where a file is expected would block forever in open() or read until memory runs out. Every
reader of a file named by the user goes through open_regular() or read_bytes(): the file is opened
without blocking and checked to be a regular file before a byte is read.

Writing: every output (checkpoint, trace, history, ONNX graph, plot, machine file) goes through
write_atomic(): a synced temporary file renamed into place, so that a reader never sees half a file.
Before a command does any work it checks each output with check_writable() (its folder exists, and
nothing but a regular file stands at its name) and all of them together with check_distinct() (no
output is one of the command's inputs, another output, or a file of a folder it reads): one rule
for every command, so a typo costs nothing and never replaces data.
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
    if not os.path.basename(path):
        raise ConfigError(f"cannot write {what} {path}: it names a folder; expected a file name")
    check_name_length(path, what)
    if made is not None and not os.path.lexists(folder):
        made = os.path.abspath(made)
        if os.path.commonpath([folder, made]) == made:
            while not os.path.lexists(folder):
                folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write {what} {path}: {folder} is not a writable directory")
    if os.path.isdir(path + TMP) and not os.path.islink(path + TMP):  # write_atomic's temporary name
        raise ConfigError(f"cannot write {what} {path}: {path + TMP}, where it is written first, is a directory; "
                          f"remove it or choose another name")
    try:
        kind = kind_of(os.stat(path).st_mode)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise ConfigError(f"cannot write {what} {path}: {e.strerror or e}") from None
    if kind is not None:
        raise ConfigError(f"cannot write {what} {path}: it is {kind}; expected a file name")
    return path


def check_name_length(path, what):
    """ConfigError unless the file name of `path`, with the temporary suffix write_atomic adds, fits the
    file system's limit on a name (255 bytes on most)."""
    name = os.fsencode(os.path.basename(os.fspath(path)) + TMP)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        limit = os.pathconf(folder if os.path.isdir(folder) else "/", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        limit = 255
    if len(name) > limit:
        raise ConfigError(f"cannot write {what} {os.fspath(path)[:120]}...: its file name is {len(name) - len(TMP)} "
                          f"bytes, and with the temporary suffix {TMP!r} more than the {limit} bytes a name may have "
                          f"here; expected a shorter name")


def same_file(a, b):
    """Whether paths `a` and `b` name one file: the same path once links are resolved, or, both existing,
    the same file on disk (a hard link)."""
    a, b = os.fspath(a), os.fspath(b)
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def inside(path, folder):
    """Whether `path` lies in `folder` once every link on the way is resolved (a link that leads out is out)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # different drives
        return False


def check_distinct(outputs, inputs=(), folders=()):
    """ConfigError (one line naming both) unless every output is a file of its own.

    outputs: (what, path) pairs the command will write; inputs: (what, path) files it reads; folders:
    (what, path) folders it reads files from (a dataset's), where an output may be a new file but not
    one that is already there. Paths are compared after resolving links, and existing files by what
    they are on disk, so a symbolic or hard link to an input is that input. None paths are skipped.
    """
    outputs = [(w, os.fspath(p)) for w, p in outputs if p is not None]
    inputs = [(w, os.fspath(p)) for w, p in inputs if p is not None]
    for i, (what, path) in enumerate(outputs):
        for other, given in inputs:
            if same_file(path, given):
                raise ConfigError(f"{what} {path} is the {other} {given} this command reads; writing it would "
                                  f"replace it: give the {what} another path")
        for other, given in outputs[:i]:
            if same_file(path, given):
                raise ConfigError(f"{what} {path} is also the {other} ({given}); each output needs a path of its own")
        for other, folder in folders:
            if folder is None or not os.path.isdir(folder):
                continue
            if os.path.lexists(path) and (inside(path, folder) or _is_entry_of(path, folder)):
                raise ConfigError(f"{what} {path} is a file of the {other} {folder}, which this command reads; "
                                  f"give the {what} a path outside it")


def _is_entry_of(path, folder):
    """Whether the existing file at `path` is one of the files directly in `folder` (through a link)."""
    try:
        with os.scandir(folder) as entries:
            return any(same_file(path, e.path) for e in entries)
    except OSError:
        return False


def is_terminal(stream):
    """Whether `stream` (e.g. sys.stderr) is an interactive terminal; False for files, pipes, closed streams."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def write_atomic(path, data, make_folder=False):
    """Write bytes to `path` via a synced temporary file and a rename: readers never see half a file,
    and a failure leaves neither a temporary file nor a broken one (ConfigError naming the path).

    Only a regular file is replaced: a device, FIFO, socket or folder at `path` is refused, never
    swapped for a file. make_folder: create the folder holding `path` when it is missing (for folders
    the program owns, such as a checkpoint directory); otherwise a missing folder is an error.
    """
    path = os.fspath(path)
    try:
        kind = kind_of(os.stat(path).st_mode)
    except FileNotFoundError:
        kind = None
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
    if kind is not None:
        raise ConfigError(f"cannot write {path}: it is {kind}; expected a regular file or a new name")
    folder = os.path.dirname(os.path.abspath(path))
    if not make_folder and not os.path.isdir(folder):
        raise ConfigError(f"cannot write {path}: its folder {folder} does not exist; create it first")
    try:
        if make_folder:
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
