"""Launchers: a launcher of another MPI is named in one line, and a failed job prints one line.

Every run is a subprocess with a timeout, so a hang (MPI_Init waiting for a launcher that is not
there) fails the test instead of stalling the suite.
"""

import os
import subprocess
import sys
import time

import pytest

from pydtnn.distributed import launch

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
LAUNCHER_VARS = launch._SIZE_VARS + launch._RANK_VARS + ("PMI_FD", "PMI_PORT", "SLURM_STEP_ID", "PMIX_NAMESPACE")
CLEAN = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
CLEAN.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
TRAIN = [sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--num_epochs", "1", "--steps_per_epoch", "1",
         "--progress", "false"]


def errors(stderr):
    return [s for s in stderr.splitlines() if s.startswith("pydtnn: error:")]


# -- a launcher of another MPI ---------------------------------------------------------------------
@pytest.mark.parametrize("size_var,rank_var", [("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                                               ("PMI_SIZE", "PMI_RANK")])
def test_a_launcher_of_another_mpi_is_named_by_rank_0_alone(size_var, rank_var):
    """Open MPI's mpirun with MPICH's mpi4py (or PMI variables without a PMI server): each process
    sees a world of one and used to train alone, silently. Every process exits 2; rank 0 says why."""
    said = {}
    for rank in (0, 1):
        r = subprocess.run(TRAIN, capture_output=True, text=True, timeout=120,
                           env={**CLEAN, size_var: "2", rank_var: str(rank)})
        assert r.returncode == 2, (rank, r.returncode, r.stderr[-3000:])
        said[rank] = r.stderr.strip().splitlines()
    line, = said[0]  # exactly one line, and no traceback or mpi4py warning around it
    assert line.startswith("pydtnn: error:") and "MPICH" in line and MPIEXEC in line, line
    assert f"{size_var}=2" in line and "MPI sees 1" in line, line
    assert said[1] == []


def test_init_refuses_a_launcher_of_another_mpi():
    """A custom loop calling launch.init() gets the same message as a ConfigError."""
    code = ("from pydtnn.distributed import launch\nfrom pydtnn.errors import ConfigError\n"
            "try:\n    launch.init()\nexcept ConfigError as e:\n    print('ConfigError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**CLEAN, "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ConfigError: the launcher announced 3 processes"), r.stdout


def test_launched_size_and_rank_read_the_launchers_variables(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert (launch.launched_size(), launch.launched_rank()) == (1, 0)
    monkeypatch.setenv("SLURM_NTASKS", "4")  # an allocation, not a step started by srun
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launch.launched_size() == 1
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert (launch.launched_size(), launch.launched_rank()) == (4, 3)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    assert (launch.launched_size(), launch.launched_rank()) == (2, 1)


# -- one line per failed job -------------------------------------------------------------------------
def mpiexec(*per_rank, timeout=60):
    """mpiexec with one process per argument list (each a list of extra flags); (result, seconds)."""
    cmd = [MPIEXEC]
    for i, extra in enumerate(per_rank):
        cmd += ([":"] if i else []) + ["-n", "1", *TRAIN, *extra]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=CLEAN)
    return r, time.time() - t0


@pytest.mark.parametrize("bad,word", [(["--batch_size", "0"], "--batch_size"),
                                      (["--resume", "/nonexistent/ckpt"], "/nonexistent/ckpt")])
def test_an_error_every_rank_meets_is_printed_once(bad, word):
    r, _ = mpiexec(bad, bad)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = errors(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("pydtnn: error: rank 0: ") and word in lines[0], r.stderr
    assert "Abort(" not in r.stderr and "MPI_Abort" not in r.stderr, r.stderr


def test_an_error_one_rank_meets_is_printed_by_that_rank():
    r, _ = mpiexec([], ["--batch_size", "0"])
    assert r.returncode == 2, r.stderr[-3000:]
    lines = errors(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("pydtnn: error: rank 1: "), r.stderr
    assert "Abort(" not in r.stderr, r.stderr


LIBRARY_ERROR = """
from pydtnn.distributed import launch
from pydtnn.errors import ConfigError
comm = launch.init(stall_timeout=600)  # far beyond the test's timeout: only the abort handler ends rank 0 in time
launch.install_abort_handler(comm)
comm.barrier()
if comm.rank == 1:
    raise ConfigError("deliberate: a library error no command line catches")
comm.barrier()
"""


def test_an_uncaught_library_error_ends_the_job_with_exit_code_2_naming_the_rank(tmp_path):
    """A custom loop that installs the abort handler (as the command line does): a PydtnnError that reaches it
    on rank 1 is a user error, one line naming the rank, and MPI_Abort with code 2 ends rank 0, which waits in a
    barrier whose stall timeout is longer than the test's."""
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", LIBRARY_ERROR], capture_output=True, text=True,
                       timeout=60, env=CLEAN, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert errors(r.stderr) == ["pydtnn: error: rank 1: deliberate: a library error no command line catches"], \
        r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
