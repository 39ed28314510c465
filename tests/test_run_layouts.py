"""Parallel layouts from the command line: ranks started with different layouts are refused before any
split of the communicator, and the final line names processes, replicas and group sizes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
QUICK = ["--model", "simplemlp", "--num_epochs", "1", "--steps_per_epoch", "2", "--batch_size", "8",
         "--progress", "false"]
pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="pip install mpich puts mpiexec next to python")


def pydtnn(*args):
    return [sys.executable, "-m", "pydtnn", *map(str, args)]


def test_ranks_started_with_different_layouts_are_refused_before_a_split():
    """Rank 0 splits the communicator for model parallelism, rank 1 does not: without an agreement first they
    wait on each other until the stall watchdog (an hour here) ends the job."""
    r = subprocess.run([MPIEXEC, "-n", "1", *pydtnn(*QUICK, "--parallel", "model", "--stall_timeout", "3600"), ":",
                        "-n", "1", *pydtnn(*QUICK, "--parallel", "data", "--stall_timeout", "3600")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    line = next(s for s in r.stderr.splitlines() if "pydtnn: error:" in s)
    assert "the processes disagree on parallel (rank 0: 'model'; rank 1: 'data')" in line, line


@pytest.mark.slow
def test_the_final_record_names_processes_replicas_and_group_size(tmp_path):
    r = subprocess.run([MPIEXEC, "-n", "4", *pydtnn(*QUICK, "--parallel", "hybrid", "--model_parallel_size", "2",
                                                    "--metrics_file", tmp_path / "m.jsonl")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    final = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert (final["world_size"], final["replicas"], final["model_parallel_size"]) == (4, 2, 2)
    assert "processes 4, replicas 2, model_parallel_size 2" in r.stdout
    assert "learning rate 0.1 = 0.05 x 2 model replicas (linear scaling" in r.stderr
