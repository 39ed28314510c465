"""'Did you mean' hints for misspelled names (datasets, options, flags)."""

import difflib


def did_you_mean(word, choices):
    """"; did you mean 'x'?" naming the choice closest to `word` (case ignored), or "" when none is close.

    Meant to follow the part of an error message that names the bad word:
    f"unknown dataset {name!r}{did_you_mean(name, NAMES) or ';'} expected one of ..." reads
    "unknown dataset 'cifar'; did you mean 'cifar10'? expected one of ...".
    """
    choices = [str(c) for c in choices]
    by_lower = {c.lower(): c for c in reversed(choices)}  # the first spelling wins among case variants
    match = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1)
    return f"; did you mean {by_lower[match[0]]!r}?" if match else ""
