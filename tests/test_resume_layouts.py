"""A topk run resumed at another process count keeps every gradient its ranks had not sent yet.

Each rank's residual (and, with momentum correction, its velocity) is saved as one row per rank; at the
saved count each rank takes its own row back, at another count rank 0 takes the sum of the rows and the
other ranks zeros (pydtnn/resume.py, restore_reducer). Multi-process runs use the mpiexec next to the Python
in use, as subprocesses with a timeout.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
from safetensors.numpy import load_file, save

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _topk(momentum):
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import reducers
    from pydtnn.distributed.comm import SingleProcess

    model = models.create("simplemlp", backend=CPUBackend("float64", seed=1))
    return model, reducers.create("topk", SingleProcess(), density=0.1, momentum=momentum).attach(model)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_restore_gives_rank_0_the_sum_of_the_rows_at_another_process_count(momentum):
    """Rows saved by 2 ranks: at 2 ranks each takes its own; at 3 rank 0 takes their sum and the others zeros,
    so that the sum over the ranks, what the reduction will yet send, is the same."""
    from pydtnn import resume as run

    names = ("residual", "velocity") if momentum else ("residual",)
    n = _topk(momentum)[1].residual.size
    rows = {k: np.random.default_rng(i).standard_normal((2, n)) for i, k in enumerate(names)}
    extras = {f"@reducer.{k}": v for k, v in rows.items()}
    for size, rank in [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]:
        model, red = _topk(momentum)
        run.restore_reducer(types.SimpleNamespace(reducer=red, model=model,
                                                  comm=types.SimpleNamespace(rank=rank, size=size)), extras)
        got = red.state_dict()
        assert set(got) == set(names)
        for k, every in rows.items():
            want = every[rank] if size == 2 else every[0] + every[1] if rank == 0 else np.zeros(n)
            np.testing.assert_array_equal(got[k], want, err_msg=f"{k}, rank {rank} of {size}")


def test_a_run_without_a_reducer_says_it_drops_the_saved_residuals():
    """One process reduces nothing: the residuals two ranks had not sent cannot go on, and the run says so."""
    from pydtnn import resume as run

    said = []
    trainer = types.SimpleNamespace(reducer=None, log=said.append, comm=types.SimpleNamespace(rank=0, size=1))
    run.restore_reducer(trainer, {"@reducer.residual": np.zeros((2, 5))})
    assert said == []  # nothing unsent: nothing to say
    run.restore_reducer(trainer, {"@reducer.residual": np.ones((2, 5))})
    assert said == ["pydtnn: note: the checkpoint's reducer state (residual of its 2 processes: what they had not "
                    "sent yet) is dropped: this run has no reducer to hold it"]


def _train(n, *args, cwd):
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "pydtnn", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _laid_out_for(src, dst, size):
    """A copy of checkpoint src at dst whose reducer rows are laid out as a resume at `size` processes takes
    them (rank 0: the sum of the saved rows, the others zeros) and whose meta says it was saved by `size`
    processes: resumed at `size`, each rank takes its own row as it is."""
    shutil.copytree(src, dst)
    arrays = load_file(str(dst / "optimizer.safetensors"))
    for k in [k for k in arrays if k.startswith("@reducer.")]:
        rows = np.zeros((size,) + arrays[k].shape[1:], arrays[k].dtype)
        rows[0] = arrays[k].sum(axis=0)
        arrays[k] = rows
    blob = save(arrays)
    (dst / "optimizer.safetensors").write_bytes(blob)
    manifest = json.loads((dst / "meta.json").read_text())
    manifest["files"]["optimizer.safetensors"] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    manifest["meta"]["world_size"] = size
    (dst / "meta.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_a_topk_checkpoint_of_2_processes_resumes_at_3_with_every_unsent_gradient(tmp_path):
    """np 2 trains 2 steps at density 0.01 (most of each gradient stays in the residuals) and saves; np 3
    resumes it for 2 more steps. It must end bit-identically where np 3 ends from the same checkpoint with its
    rows laid out by the rule (the sum on rank 0): a resume that dropped rank 1's residual would not."""
    base = ("--model", "simplecnn", "--dataset", "mnist5k", "--dtype", "float64", "--global_batch_size", "48",
            "--steps_per_epoch", "2", "--progress", "false", "--reduction", "topk", "--density", "0.01")
    _train(2, *base, "--num_epochs", "1", "--checkpoint_dir", "saved", cwd=tmp_path)
    residual = load_file(str(tmp_path / "saved" / "optimizer.safetensors"))["@reducer.residual"]
    assert residual.shape[0] == 2 and np.abs(residual[1]).max() > 0  # rank 1's row is not nothing
    _laid_out_for(tmp_path / "saved", tmp_path / "ruled", 3)
    for ck in ("saved", "ruled"):
        _train(3, "--resume", ck, "--num_epochs", "2", cwd=tmp_path)
    for name in ("model.safetensors", "optimizer.safetensors"):
        got, want = (load_file(str(tmp_path / ck / name)) for ck in ("saved", "ruled"))
        assert got.keys() == want.keys(), name
        for k in want:
            assert np.array_equal(got[k], want[k]), f"{name} {k}"


def test_a_topk_checkpoint_of_model_parallel_replicas_resumes_bit_identically(tmp_path):
    """2 replicas of a model-parallel group of 2: each process's residual covers its slices of the split layers,
    the checkpoint holds each replica's residual over the whole model (gathered within the group), and each
    process takes back its own slices: 1 + 1 epochs end exactly where 2 epochs end. A resume that gave the
    group's second process its first process's residual ends elsewhere."""
    base = ("--model", "simplecnn", "--dataset", "mnist5k", "--dtype", "float64", "--global_batch_size", "32",
            "--steps_per_epoch", "3", "--progress", "false", "--reduction", "topk", "--density", "0.1",
            "--parallel", "hybrid", "--model_parallel_size", "2")
    _train(4, *base, "--num_epochs", "2", "--checkpoint_dir", "full", cwd=tmp_path)
    _train(4, *base, "--num_epochs", "1", "--checkpoint_dir", "part", cwd=tmp_path)
    residual = load_file(str(tmp_path / "part" / "optimizer.safetensors"))["@reducer.residual"]
    n = sum(v.size for k, v in load_file(str(tmp_path / "part" / "model.safetensors")).items()
            if k.endswith(("weight", "bias")))
    assert residual.shape == (2, n) and np.abs(residual).sum() > 0
    _train(4, "--resume", "part", "--num_epochs", "2", cwd=tmp_path)
    for name in ("model.safetensors", "optimizer.safetensors"):
        got, want = (load_file(str(tmp_path / ck / name)) for ck in ("part", "full"))
        assert got.keys() == want.keys(), name
        for k in want:
            assert np.array_equal(got[k], want[k]), f"{name} {k}"
