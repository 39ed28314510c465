"""Fixtures shared by the test modules."""

import os

import pytest

# The command line measures convolution algorithms by default (--conv_autotune). The suite keeps the
# threshold choice, so that timing noise never changes what a test computes and no test writes the
# user's cache; tests/test_autotune.py sets its own environment. Set here, before the test modules copy
# os.environ for the processes they start.
os.environ.setdefault("PYDTNN_CONV_AUTOTUNE", "0")
# The tests import torch (the oracle), whose libgomp Numba's threads then share: its spin count must be
# in the environment before that (pydtnn.runtime.configure, docs/performance.md), as for any user.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")  # pydtnn.runtime.GOMP_SPINCOUNT, without importing pydtnn


@pytest.fixture(params=["numba", "numpy"])
def kernels(request, monkeypatch):
    """Run a test with the compiled CPU kernels, then with the NumPy path alone (a CPUBackend made
    without kernels= reads PYDTNN_CPU_KERNELS). With the compiled kernels, the direct 3x3 convolution
    takes layers of any width, and the compiled bias kernels arrays of any size, so that the tests'
    small images go through them too (the default Tuning of backends made in the test)."""
    from dataclasses import replace

    from pydtnn.backends.cpu import tuning

    monkeypatch.setenv("PYDTNN_CPU_KERNELS", request.param)
    monkeypatch.setattr(tuning, "DEFAULT", replace(tuning.DEFAULT, direct_min_width=1, bias_compiled_min_bytes=0))
    return request.param


@pytest.fixture(autouse=True)
def empty_data_directory(tmp_path_factory, monkeypatch):
    """Every test, and every process it starts, sees an empty data directory: a dataset fetched into
    ~/.cache/pydtnn on this machine must not change what a test finds."""
    monkeypatch.delenv("PYDTNN_DATA", raising=False)  # the older name, which a test may set over this one
    monkeypatch.setenv("PYDTNN_DATA_DIR", str(tmp_path_factory.mktemp("pydtnn-data")))


@pytest.fixture(autouse=True, scope="module")
def return_freed_memory():
    """After each test module, hand freed heap memory back to the system. CPUBackend tells glibc to keep freed
    memory for the next training step (pydtnn.runtime, which the trainer configures); over a thousand tests that build models of
    every size, each of malloc's arenas would keep its own peak, and the suite's process grew past 24 GB."""
    yield
    _collect_and_trim()


def _collect_and_trim():
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True)
def trim_when_large():
    """After a test that leaves the process above 6 GB resident, the same as after a module: the heavy
    modules (every model family trained a few steps) would otherwise pile up their peaks until the end of
    the module. Reading /proc/self/statm costs microseconds; the collection runs only when it is needed."""
    yield
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return
    if resident > 6 << 30:
        _collect_and_trim()


def pytest_addoption(parser):
    parser.addoption("--whole", action="store_true",
                     help="the whole suite, slow tests included (what .ci/run runs); plain `pytest` is the quick tier")


def pytest_collection_modifyitems(config, items):
    """The quick tier: plain `pytest` (or `pytest tests`) leaves the tests marked slow out. They run with
    --whole, with -m, or when the command names test files or tests (what you name runs)."""
    named = [os.path.abspath(str(a).split("::")[0]) for a in config.option.file_or_dir]
    tiers = [os.path.abspath(os.path.join(str(config.rootpath), t)) for t in config.getini("testpaths")]
    if config.getoption("whole") or config.option.markexpr or any(n not in tiers for n in named):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
        config.stash[_LEFT_OUT] = len(slow)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"quick tier: {left_out} slow tests left out; `pytest --whole` runs the whole suite")
