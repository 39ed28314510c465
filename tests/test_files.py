"""pydtnn/files.py: a user's file is read whole only while it stays within its bound."""

import os
import types

import pytest

from pydtnn import files
from pydtnn.errors import ConfigError, DataError


def test_read_bytes_refuses_a_file_that_grew_past_its_bound_after_the_size_check(tmp_path, monkeypatch):
    """The size fstat gives is checked first; a file that grows before it is read (fstat said 10 bytes, 100
    are there) is caught by the length of what was read, not returned whole."""
    path = tmp_path / "grows.json"
    path.write_bytes(b"x" * 100)
    real = os.fstat

    def fstat_before_it_grew(fd):
        st = real(fd)
        return types.SimpleNamespace(st_mode=st.st_mode, st_size=10)

    monkeypatch.setattr(files.os, "fstat", fstat_before_it_grew)
    with pytest.raises(ConfigError, match=rf"^config file {path} is over 50 bytes; expected at most 50$"):
        files.read_bytes(path, "config file", 50)
    with pytest.raises(DataError, match="is over 50 bytes"):  # the caller's error class
        files.read_bytes(path, "checkpoint manifest", 50, DataError)
    assert files.read_bytes(path, "config file", 100) == b"x" * 100  # at its bound: read whole


@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="needs Linux's /proc")
def test_read_bytes_refuses_a_file_whose_size_says_less_than_it_holds():
    """A /proc file is a regular file whose st_size is 0 whatever it holds: only the read finds its length."""
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(ConfigError, match="^config file /proc/self/status is over 16 bytes; expected at most 16$"):
        files.read_bytes("/proc/self/status", "config file", 16)
    assert files.read_bytes("/proc/self/status", "config file", 1 << 20).startswith(b"Name:")
