"""The examples run as documented and say what they promise."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def run(cmd, timeout=240):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_custom_layer_example_checks_and_trains_in_under_60_lines():
    path = os.path.join(ROOT, "examples", "custom_layer.py")
    assert len(open(path).read().splitlines()) < 60
    out = run([sys.executable, path])
    assert "gradients match finite differences and PyTorch" in out
    accuracy = float(re.search(r"test accuracy with PReLU: ([0-9.]+)", out).group(1))
    assert accuracy > 0.85


def test_distributed_custom_loop_gives_the_same_model_on_2_processes():
    path = os.path.join(ROOT, "examples", "distributed_custom_loop.py")
    one = run([sys.executable, path]).split(":", 1)[1]
    two = run([MPIEXEC, "-n", "2", sys.executable, path]).split(":", 1)[1]
    assert one.strip() == two.strip()  # same accuracy, same sum of |parameters| to 10 decimals
    assert float(re.search(r"test accuracy ([0-9.]+)", one).group(1)) > 0.8
