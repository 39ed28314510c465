"""Exceptions that mean "the user asked for something wrong" (exit code 2 at the command line).

Anything else that escapes is an internal error (exit code 1).
"""


class PydtnnError(Exception):
    """A user's mistake: bad flag, bad file, bad shape. Printed as one line, no traceback."""


class ShapeError(PydtnnError, ValueError):
    """A layer cannot take the shape it was given (raised at build time)."""


class TooLarge(ShapeError):
    """A shape whose arrays would not fit in this machine's memory (raised before allocating them)."""


class DataError(PydtnnError, ValueError):
    """A dataset file is missing, truncated, corrupt or inconsistent."""


class ConfigError(PydtnnError, ValueError):
    """A configuration value (flag, option, name) is invalid."""


class TrainingDiverged(PydtnnError, FloatingPointError):
    """The loss became NaN or Inf; parameters keep the last finite values."""


def command_status(body, program="pydtnn"):
    """Exit status of a command's body(): what it returns (None: 0); 2 and one line `PROGRAM: error: ...` on
    stderr for a user error (a PydtnnError); 130 on Ctrl-C. What every pydtnn command but pydtnn-train returns."""
    import sys

    try:
        return body() or 0
    except PydtnnError as e:
        print(f"{program}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{program}: error: interrupted", file=sys.stderr, flush=True)
        return 130
