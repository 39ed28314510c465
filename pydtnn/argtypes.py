"""The command lines' argument types and parser: one-line errors (exit code 2) naming the bad value.

Every command of the package (pydtnn-train, pydtnn-export, pydtnn-plot, pydtnn-perfmodel) parses its flags
with these, so a value is checked and reported the same way everywhere.
"""

import argparse
import re

from pydtnn.errors import ConfigError

TRUE, FALSE = ("true", "1", "yes", "y", "on"), ("false", "0", "no", "n", "off")


def parse_bool(text):
    """PyDTNN passes booleans as values: '--evaluate', '--evaluate true', '--evaluate False' all work."""
    t = str(text).strip().lower()
    if t in TRUE:
        return True
    if t in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false/1/0/yes/no), got {text!r}")


def number(kind, lo=None, lo_open=False, hi=None):
    """argparse type: a number of `kind` within bounds, with an error naming the bound."""

    def convert(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v >= hi):
            rng = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in [{lo}, {hi})"
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {rng}, got {text!r}")
        return v

    return convert


positive_int = number(int, 0, lo_open=True)
non_negative_int = number(int, 0)
non_negative_float = number(float, 0.0)
positive_float = number(float, 0.0, lo_open=True)
fraction = number(float, 0.0, hi=1.0)


def sample_shape(text):
    """argparse type: one sample's shape without the batch, C,H,W (or CxHxW), positive integers ("3,32,32")."""
    try:
        shape = tuple(int(s) for s in str(text).replace("x", ",").split(",") if s.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected C,H,W (positive integers, e.g. 3,32,32), got {text!r}")
    return shape


def share(text):
    """argparse type: a share of the entries, a number in (0, 1] (--density)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # nan, inf and 0 fail here too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (the share of gradient entries each process "
                                         f"sends, e.g. 0.01), got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (exit code 2 through PydtnnError)."""

    def error(self, message):
        raise ConfigError(message + self._hint(message))

    def _hint(self, message):
        """'; did you mean --batch_size?' for a misspelled flag, or a close choice for a bad value."""
        from pydtnn.suggest import did_you_mean

        if message.startswith("unrecognized arguments: "):
            flags = [w for w in message.split(": ", 1)[1].split() if w.startswith("--")]
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            for word in flags:
                hint = did_you_mean(word.split("=")[0], known)
                if hint:
                    return hint
        m = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '([^']*)'", message)
        if m:
            action = next((a for a in self._actions if m.group(1) in a.option_strings), None)
            if action is not None and action.choices:
                return did_you_mean(m.group(2), action.choices)
        return ""

    def flag(self, group, name, aliases=(), **kw):
        """Add --name (PyDTNN's underscore spelling) and its dashed twin, and each of `aliases` likewise."""
        names = [spelling for n in (name, *aliases)
                 for spelling in [f"--{n}"] + ([f"--{n.replace('_', '-')}"] if "_" in n else [])]
        if self.argument_default is argparse.SUPPRESS:
            kw["default"] = argparse.SUPPRESS
        if kw.get("type") is parse_bool:
            kw.setdefault("nargs", "?")
            kw.setdefault("const", True)
            kw.setdefault("metavar", "BOOL")
        group.add_argument(*names, dest=name, **kw)
