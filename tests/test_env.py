"""Environment variables: each parsed in pydtnn/env.py; a bad value is one line naming it, exit code 2."""

import os
import subprocess
import sys

import pytest

from pydtnn import env
from pydtnn.errors import ConfigError


def test_a_bad_cpu_kernels_value_is_a_user_error_at_the_command_line():
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--num_epochs", "1",
                        "--steps_per_epoch", "1", "--progress", "false"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYDTNN_CPU_KERNELS": "bogus"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        "pydtnn: error: environment variable PYDTNN_CPU_KERNELS=bogus: expected one of auto, numba, numpy"]


@pytest.mark.parametrize("value,expected", [(None, "auto"), ("", "auto"), ("numpy", "numpy"), (" NUMBA ", "numba"),
                                            ("auto", "auto")])
def test_cpu_kernels(monkeypatch, value, expected):
    _set(monkeypatch, "PYDTNN_CPU_KERNELS", value)
    assert env.cpu_kernels() == expected


def test_cpu_kernels_refuses_other_values_and_the_backend_says_so(monkeypatch):
    from pydtnn.backends.cpu import CPUBackend

    monkeypatch.setenv("PYDTNN_CPU_KERNELS", "fast")
    with pytest.raises(ConfigError, match=r"environment variable PYDTNN_CPU_KERNELS=fast: expected one of auto"):
        env.cpu_kernels()
    with pytest.raises(ConfigError, match="PYDTNN_CPU_KERNELS=fast"):
        CPUBackend()


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("1", True), ("yes", True), ("TRUE", True),
                                            ("on", True), ("0", False), ("no", False), ("False", False)])
def test_cuda_aware_mpi(monkeypatch, value, expected):
    _set(monkeypatch, "PYDTNN_CUDA_AWARE_MPI", value)
    assert env.cuda_aware_mpi() is expected


@pytest.mark.parametrize("value", ["2", "maybe", "-1"])
def test_cuda_aware_mpi_refuses_other_values(monkeypatch, value):
    from pydtnn.distributed.gpu_comm import mpi_cuda_aware

    monkeypatch.setenv("PYDTNN_CUDA_AWARE_MPI", value)
    with pytest.raises(ConfigError, match=f"environment variable PYDTNN_CUDA_AWARE_MPI={value}: expected 1 or 0"):
        env.cuda_aware_mpi()
    with pytest.raises(ConfigError):  # used to read anything but 1/true/yes as "no", silently
        mpi_cuda_aware()


@pytest.mark.parametrize("omp,openblas,expected", [(None, None, None), ("3", None, 3), (None, "2", 2), ("4", "2", 4),
                                                   ("4,2", None, 4), ("", "5", 5)])
def test_omp_threads(monkeypatch, omp, openblas, expected):
    _set(monkeypatch, "OMP_NUM_THREADS", omp)
    _set(monkeypatch, "OPENBLAS_NUM_THREADS", openblas)
    assert env.omp_threads() == expected


@pytest.mark.parametrize("value", ["0", "two", "-3", "1.5"])
def test_omp_threads_refuses_other_values(monkeypatch, value):
    from pydtnn.backends.cpu import threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ConfigError, match=f"environment variable OMP_NUM_THREADS={value}: expected a positive integer"):
        env.omp_threads()
    with pytest.raises(ConfigError):  # used to fall back to the core count, silently
        threads.default_threads()


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"])
def test_more_threads_than_the_process_can_use_are_refused(monkeypatch, name):
    """4 threads per core this process may use are the most (64 at least); one more is an error naming the variable,
    its value and the largest accepted (100000 used to start a thread per count and end in a traceback)."""
    from pydtnn import runtime
    from pydtnn.backends.cpu import threads

    most, cores = max(4 * threads.usable_cores(), 64), threads.usable_cores()
    assert threads.max_threads()[0] == most
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv(name, str(most))
    assert threads.default_threads() == most
    monkeypatch.setenv(name, str(most + 1))
    with pytest.raises(ConfigError, match=rf"^environment variable {name}={most + 1}: expected at most {most} threads "
                                          rf"\(4 per core, and this process may use {cores}; never fewer than 64\)$"):
        threads.default_threads()
    before = runtime.configured()
    with pytest.raises(ConfigError, match=rf"^runtime.configure: threads {most + 1}: more threads than this process "
                                          rf"can use; expected at most {most} \("):
        runtime.configure(threads=most + 1)
    assert runtime.configured() == before and threads.threads() == (before or {}).get("threads", 1)


@pytest.mark.parametrize("given", [{"OMP_NUM_THREADS": "100000"}, {"flag": "100000"}])
def test_an_absurd_thread_count_is_one_line_naming_it_at_the_command_line(tmp_path, given):
    """OMP_NUM_THREADS=100000 and --threads_per_process 100000 (checked at any process count): exit code 2, one
    line naming the value, where it came from and the largest accepted; nothing written."""
    from pydtnn.backends.cpu import threads

    most = threads.max_threads()[0]
    flag = ["--threads_per_process", given["flag"]] if "flag" in given else []
    environ = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": given.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--num_epochs", "1",
                        "--steps_per_epoch", "1", "--progress", "false", "--metrics_file", "m.jsonl", *flag],
                       capture_output=True, text=True, timeout=120, env=environ, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    line, = r.stderr.strip().splitlines()
    if flag:
        assert line.startswith(f"pydtnn: error: --threads_per_process 100000: more threads than this process can "
                               f"use; expected at most {most} ("), line
    else:
        assert line.startswith(f"pydtnn: error: environment variable OMP_NUM_THREADS=100000: expected at most "
                               f"{most} threads ("), line
    assert os.listdir(tmp_path) == []


def test_the_table_of_variables_names_every_variable_pydtnn_reads():
    """Every PYDTNN_ variable read through os.environ in the package is in env.py's table (the data
    directory's excepted: data/download.py reads its own)."""
    import re

    root = os.path.dirname(env.__file__)
    read = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py") and name != "env.py":
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    read |= set(re.findall(r"environ(?:\.get)?[(\[]\s*\"(PYDTNN_\w+)\"", f.read()))
    assert read - {"PYDTNN_DATA", "PYDTNN_DATA_DIR"} == set(), read
    for name in ("PYDTNN_CPU_KERNELS", "PYDTNN_CUDA_AWARE_MPI", "OMP_NUM_THREADS"):
        assert name in env.__doc__


def _set(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
