"""Activation recomputation (pydtnn.recompute): the same results as keeping every activation, with only the
segments' inputs kept between forward and backward."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from pydtnn import recompute
from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError
from pydtnn.layers import (AdditionBlock, BatchNorm, ConcatenationBlock, Conv2D, Dense, Dropout, Flatten,
                           MaxPool2D, ReLU)
from pydtnn.layers.blocks import Sequential
from pydtnn.model import Model

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _model(seed=0):
    layers = Sequential({
        "stem": Sequential([Conv2D(4, 3, padding=1), BatchNorm(), ReLU()]),
        "res": AdditionBlock([Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), Dropout(0.3)], []),
        "cat": ConcatenationBlock([Conv2D(2, 1)], [MaxPool2D(3, 1, padding=1)]),
        "pool": MaxPool2D(2), "flat": Flatten(), "drop": Dropout(0.2), "fc": Dense(3)})
    return Model(layers, (2, 6, 6), backend=CPUBackend(np.float64, seed=seed))


@pytest.mark.parametrize("n,mode,want", [(19, "segments", [0, 5, 10, 15, 19]), (4, "segments", [0, 2, 4]),
                                         (3, "all", [0, 1, 2, 3]), (1, "segments", [0, 1])])
def test_segments_are_about_sqrt_of_the_units_or_every_unit(n, mode, want):
    assert recompute.segments(n, mode) == want


def test_an_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="--recompute 'half': expected one of none, segments, all"):
        recompute.passes(_model(), "half")
    assert recompute.passes(_model(), "none").__class__ is Model


@pytest.mark.parametrize("mode", ["segments", "all"])
def test_recomputation_gives_the_bits_of_a_plain_step(mode):
    """Outputs, input gradients, parameter gradients and running statistics over three steps, with dropout
    drawn from the backend's Generator (put back for the second forward) and BatchNorm in training."""
    plain, again = _model(), _model()
    passes = recompute.Recompute(again, mode)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal((5, 2, 6, 6))
        dy = rng.standard_normal((5, 3))
        y1, y2 = plain.forward(x, training=True), passes.forward(x, training=True)
        np.testing.assert_array_equal(y1, y2)
        plain.backward(dy)
        passes.backward(dy)
        for (name, a), (_, b) in zip(plain.named_state(), again.named_state()):
            np.testing.assert_array_equal(a, b, err_msg=name)
        for (name, _, g1), (_, _, g2) in zip(plain.parameters(), again.parameters()):
            np.testing.assert_array_equal(g1, g2, err_msg=name)
        np.testing.assert_array_equal(plain.backend.rng.random(3), again.backend.rng.random(3))


def test_only_the_segments_inputs_are_kept_and_each_segment_runs_forward_twice():
    model = _model()
    passes = recompute.Recompute(model, "all")
    calls = {}
    for path, layer, _ in model.units():
        forward = layer.forward

        def counted(x, training=True, forward=forward, path=path):
            calls[path] = calls.get(path, 0) + 1
            return forward(x, training)

        layer.forward = counted
    x = np.random.default_rng(2).standard_normal((4, 2, 6, 6))
    out = passes.forward(x, training=True)
    first = dict(model.units()[0:1][0][1].__dict__)
    assert first.get("x") is None and first.get("ctx") is None  # the stem's convolution kept nothing
    assert len(passes.inputs) == len(passes.segments) - 1
    passes.backward(np.ones_like(out))
    last = model.units()[-1][0]
    assert calls[last] == 1 and all(n == 2 for p, n in calls.items() if p != last), calls
    assert passes.inputs == []


# -- whole runs ---------------------------------------------------------------------------------
def _worker(n, out, *extra):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, os.path.join(HERE, "pipe_worker.py"),
                                                         str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, check=False)


def _same_bits(a, b):
    a, b = load_file(str(a)), load_file(str(b))
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_training_with_recomputation_ends_with_the_same_bits(tmp_path):
    """tests/pipe_worker.py's network (BatchNorm, dropout from per-sample streams, flips and crops, blocks),
    10 steps of 4 micro-batches: segments and all end where keeping every activation ends; so does a
    2-stage pipeline recomputing within its stages."""
    for mode in ("none", "segments", "all"):
        r = _worker(1, tmp_path / f"{mode}.st", "--recompute", mode)
        assert r.returncode == 0, r.stderr[-3000:]
    r = _worker(2, tmp_path / "pipe.st", "--recompute", "all", "--schedule", "gpipe")
    assert r.returncode == 0, r.stderr[-3000:]
    for other in ("segments", "all", "pipe"):
        assert _same_bits(tmp_path / "none.st", tmp_path / f"{other}.st"), other


def _final_shas(tmp_path, launcher, *flags):
    """The parameters' SHA-256 of pydtnn-train (under `launcher`) without recomputation and with segments."""
    train = [*launcher, sys.executable, "-m", "pydtnn", "--num_epochs", "1", "--steps_per_epoch", "4", "--progress",
             "false", *flags]
    shas = []
    for mode in ("none", "segments"):
        out = tmp_path / f"{mode}.jsonl"
        r = subprocess.run([*train, "--recompute", mode, "--metrics_file", str(out)], capture_output=True, text=True,
                           timeout=180, env=ENV, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(out, encoding="utf-8") as f:
            shas.append([json.loads(line) for line in f][-1]["params_sha256"])
    return shas


def test_pydtnn_train_recompute_changes_no_bit(tmp_path):
    shas = _final_shas(tmp_path, [])
    assert shas[0] == shas[1]


@pytest.mark.parametrize("layout", [("--parallel", "data"), ("--parallel", "model")])
def test_recomputation_changes_no_bit_in_data_and_model_parallelism(tmp_path, layout):
    """Two processes, data parallel (the reducer's hooks fire in the recomputing backward) or model parallel
    (the gathers and dx sums are layers of the segments, run again): the bits of no recomputation."""
    shas = _final_shas(tmp_path, [MPIEXEC, "-n", "2"], "--dtype", "float64", "--flip_images", "true", *layout)
    assert shas[0] == shas[1]
