"""The check every loader makes first: the path the user named is a folder.

Without it a mistyped --dataset_train_path is reported as a missing file inside it, which sends the
user looking for the wrong thing.
"""

import os

from pydtnn.errors import DataError
from pydtnn.files import kind_of


def require_folder(path, role, expected, first=None):
    """DataError unless `path` is a folder (symlinks followed).

    role: how the message names it ('dataset folder', 'dataset test folder'); expected: what belongs
    inside ('the four MNIST IDX files (...)'); first: the entry a loader would read first, named too
    so a search of the message for it still finds the cause.
    """
    path = os.fspath(path)
    looked_for = f" (no {first} to read)" if first else ""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"{role} {path} does not exist{looked_for}; expected a folder holding {expected}") from None
    except OSError as e:
        raise DataError(f"cannot read {role} {path}: {e.strerror or e}; expected a folder holding {expected}") \
            from None
    kind = kind_of(mode)
    if kind != "a directory":
        raise DataError(f"{role} {path} is {kind or 'a file'}, not a folder{looked_for}; "
                        f"expected a folder holding {expected}")
