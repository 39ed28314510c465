"""Pipeline parallelism (pydtnn.distributed.pipeline): the cuts, the schedules, and S processes computing
what one process computes with the same micro-batches.

Multi-process runs use the mpiexec next to the Python in use, as subprocesses with a timeout.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from pydtnn.backends import CPUBackend
from pydtnn.distributed import pipeline
from pydtnn.errors import ConfigError
from pydtnn.layers import AdditionBlock, BatchNorm, Conv2D, Dense, Flatten, ReLU
from pydtnn.layers.blocks import Sequential
from pydtnn.model import Model

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
WORKER = os.path.join(HERE, "pipe_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# -- cuts and schedules ------------------------------------------------------------------------
@pytest.mark.parametrize("costs,stages,want", [
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),
    ([1, 1, 1, 1, 1, 5], 2, [0, 5, 6]),
    ([3, 3, 2, 2, 2], 3, [0, 1, 3, 5]),
    ([1, 2, 3], 3, [0, 1, 2, 3]),
    ([7], 1, [0, 1]),
])
def test_balanced_cuts_minimize_the_slowest_stage(costs, stages, want):
    got = pipeline.balanced_cuts(costs, stages)
    assert got == want
    worst = max(sum(costs[a:b]) for a, b in zip(got[:-1], got[1:]))
    brute = min(max(sum(costs[a:b]) for a, b in zip(c[:-1], c[1:])) for c in _all_cuts(len(costs), stages))
    assert worst == brute


def _all_cuts(n, stages):
    from itertools import combinations

    for inner in combinations(range(1, n), stages - 1):
        yield [0, *inner, n]


def test_balanced_cuts_match_a_brute_force_search_on_random_costs():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, stages = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        if stages > n:
            continue
        costs = rng.integers(1, 20, n).tolist()
        got = pipeline.balanced_cuts(costs, stages)
        assert got[0] == 0 and got[-1] == n and all(a < b for a, b in zip(got[:-1], got[1:]))
        worst = max(sum(costs[a:b]) for a, b in zip(got[:-1], got[1:]))
        assert worst == min(max(sum(costs[a:b]) for a, b in zip(c[:-1], c[1:])) for c in _all_cuts(n, stages))


def test_more_stages_than_layers_is_a_config_error():
    with pytest.raises(ConfigError, match="--pipeline_stages 5 is more than the model's 4 layers"):
        pipeline.balanced_cuts([1, 1, 1, 1], 5)
    with pytest.raises(ConfigError, match="positive integer"):
        pipeline.balanced_cuts([1, 1], 0)


def _model():
    layers = Sequential({"stem": Sequential([Conv2D(4, 3, padding=1), BatchNorm(), ReLU()]),
                         "res": AdditionBlock([Conv2D(4, 3, padding=1), BatchNorm()], []),
                         "relu": ReLU(), "flat": Flatten(), "fc": Dense(3)})
    return Model(layers, (2, 5, 5), backend=CPUBackend(np.float64, seed=0))


def test_units_open_sequentials_and_keep_blocks_whole():
    got = [(p, type(layer).__name__) for p, layer in pipeline.units(_model())]
    assert got == [("stem.0", "Conv2D"), ("stem.1", "BatchNorm"), ("stem.2", "ReLU"), ("res", "AdditionBlock"),
                   ("relu", "ReLU"), ("flat", "Flatten"), ("fc", "Dense")]


def test_cuts_by_hand_name_their_units_or_fail_in_one_line():
    units = pipeline.units(_model())
    assert pipeline.cuts_at(units, ["res", "fc"]) == [0, 3, 6, 7]
    with pytest.raises(ConfigError, match=r"'res\.0' is not a layer a stage can begin at; expected one of stem\.1"):
        pipeline.cuts_at(units, ["res.0"])
    with pytest.raises(ConfigError, match="does not come after the stage before it"):
        pipeline.cuts_at(units, ["fc", "res"])


def test_stage_models_keep_the_whole_models_names_arrays_and_results():
    """Stages chained by hand give the whole model's output and input gradient; their state is the whole's."""
    model = _model()
    units = pipeline.units(model)
    bounds = [0, 3, 5, 7]
    stages = [pipeline.stage_model(model, units, bounds, s) for s in range(3)]
    whole = model.state_dict()
    for s in stages:
        for name, value in s.named_state():
            assert value is whole[name]
    layout = pipeline.state_layout(model, units, bounds)
    assert [name for name, *_ in layout] == list(whole)
    assert {name: stage for name, stage, *_ in layout}["res.0.1.running_var"] == 1
    x = np.random.default_rng(1).standard_normal((4, 2, 5, 5))
    want = model.forward(x, training=False)
    h = x
    for s in stages:
        h = s.forward(h, training=False)
    np.testing.assert_array_equal(h, want)
    h = x
    for s in stages:
        h = s.forward(h, training=True)
    dy = np.ones_like(h)
    for s in reversed(stages[1:]):
        dy = s.backward(dy)
        assert dy is not None and dy.shape[1:] == s.input_shape
    assert stages[0].backward(dy) is None  # the first stage, like the whole model, gives no dL/dinput


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(1, 4), (2, 4), (3, 4), (4, 2), (4, 8)])
def test_schedules_run_each_micro_batch_forward_then_backward_once(kind, stages, micro):
    for s in range(stages):
        ops = pipeline.schedule(kind, stages, s, micro)
        assert sorted(ops) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert [i for op, i in ops if op == "B"] == list(range(micro))  # gradients summed in micro-batch order
        live, most = set(), 0
        for op, i in ops:
            if op == "F":
                live.add(i)
            else:
                assert i in live
                live.remove(i)
            most = max(most, len(live))
        assert most == (micro if kind == "gpipe" else min(stages - s, micro))


def test_bad_micro_batches_or_schedule_is_a_config_error():
    class Comm:
        rank, size = 0, 2

    model = _model()
    stage = pipeline.stage_model(model, pipeline.units(model), [0, 3, 7], 0)
    cut = pipeline.Cut.of(_model(), 2)
    with pytest.raises(ConfigError, match="--micro_batches must be a positive integer, got 0"):
        pipeline.PipelineStep(stage, None, None, Comm(), cut, 0)
    with pytest.raises(ConfigError, match="--pipeline_schedule 'zigzag': expected one of gpipe, 1f1b"):
        pipeline.PipelineStep(stage, None, None, Comm(), cut, 2, "zigzag")


# -- S processes equal one --------------------------------------------------------------------
def launch(n, out, *extra, timeout=180):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, WORKER, str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, check=False)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 4 micro-batches a step (tests/pipe_worker.py: BatchNorm, dropout, flips and crops)."""
    out = tmp_path_factory.mktemp("pipe1") / "one.st"
    r = launch(1, out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def assert_close(want_path, got_path, rtol):
    want, got = load_file(str(want_path)), load_file(str(got_path))
    assert got.keys() == want.keys()
    for k in want:
        assert np.abs(want[k]).max() > 0, k
        err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err <= rtol, f"{k}: relative difference {err:.3g} > {rtol}"


@pytest.mark.parametrize("n,extra", [(2, ()), pytest.param(3, ("--boundaries", "4,13"), marks=pytest.mark.slow),
                                     pytest.param(4, (), marks=pytest.mark.slow)],
                         ids=["2 stages", "3 stages cut by hand, unevenly", "4 stages"])
@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
def test_pipeline_equals_one_process_with_the_same_micro_batches(single, tmp_path, n, extra, kind):
    """10 steps, float64: each stage's parameters and BatchNorm statistics are one process's."""
    r = launch(n, tmp_path / "p.st", "--schedule", kind, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close(single, tmp_path / "p.st", 1e-12)
    if extra:
        assert "bounds [0, 4, 13, 19]" in r.stdout, r.stdout


@pytest.mark.slow
def test_data_parallel_pipelines_equal_data_parallelism(tmp_path):
    """2 replicas x 2 stages (np 4) and 2 replicas x 3 stages (np 6) end where 2 data-parallel processes with the
    same micro-batches end: each stage's gradients reduced across the replicas."""
    r = launch(2, tmp_path / "dp.st", "--replicas", "2", "--micro_batches", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    for n in (4, 6):
        r = launch(n, tmp_path / f"h{n}.st", "--replicas", "2", "--micro_batches", "2", "--schedule", "gpipe")
        assert r.returncode == 0, r.stderr[-3000:]
        assert_close(tmp_path / "dp.st", tmp_path / f"h{n}.st", 1e-12)


@pytest.mark.slow
def test_gpipe_and_1f1b_give_the_same_bits(tmp_path):
    for kind in pipeline.SCHEDULES:
        r = launch(3, tmp_path / f"{kind}.st", "--schedule", kind, "--steps", "4")
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(str(tmp_path / "gpipe.st")), load_file(str(tmp_path / "1f1b.st"))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_stalled_stage_is_reported_by_its_neighbours_naming_the_message(tmp_path):
    """Stage 1 of 3 sleeps 120 s after step 3, longer than the test's timeout: its neighbours report which
    message of which micro-batch they wait for, and the 3 s watch ends the job (exit code 1)."""
    r = launch(3, tmp_path / "s.st", "--misbehave", "stall", "--at", "3", "--rank", "1", "--stall_timeout", "3",
               timeout=90)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "stalled" in r.stderr and "of micro-batch 0 from stage 1" in r.stderr, r.stderr[-2000:]


def test_a_stage_killed_mid_run_ends_the_job(tmp_path):
    """SIGKILL on stage 1 after step 3 (no word to anyone): the launcher ends the job, within the 30 s the
    test allows (a hang raises subprocess.TimeoutExpired)."""
    r = launch(3, tmp_path / "k.st", "--misbehave", "kill", "--at", "3", "--rank", "1", timeout=30)
    assert r.returncode != 0 and not (tmp_path / "k.st").exists()


@pytest.mark.slow
def test_a_message_of_the_wrong_size_is_an_error_naming_it(tmp_path):
    r = launch(3, tmp_path / "m.st", "--misbehave", "shape", "--at", "2", "--rank", "1", timeout=90)
    assert r.returncode != 0, r.stderr[-2000:]
    assert "stage 2 received 1764 values as the activation of micro-batch 0 from stage 1; expected 4116" in r.stderr


def test_the_reference_differs_with_other_micro_batches(single, tmp_path):
    """The check above can fail: one process with 2 micro-batches (other BatchNorm statistics) is elsewhere."""
    r = launch(1, tmp_path / "m2.st", "--micro_batches", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    with pytest.raises(AssertionError, match="relative difference"):
        assert_close(single, tmp_path / "m2.st", 1e-12)


# -- pydtnn-train --parallel pipeline ------------------------------------------------------------
TRAIN = [sys.executable, "-m", "pydtnn", "--num_epochs", "1", "--steps_per_epoch", "6", "--dtype", "float64",
         "--flip_images", "true", "--progress", "false"]


def train(n, out, *flags, timeout=180):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [*TRAIN, "--metrics_file", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, check=False)


def final(path):
    import json

    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f][-1]


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
def test_pydtnn_train_pipeline_equals_one_process(tmp_path, kind):
    """The default model and data, 4 micro-batches: 2 stages end with one process's parameters (their
    SHA-256 over the whole model, gathered from the stages) and its test accuracy."""
    r1 = train(1, tmp_path / "one.jsonl", "--micro_batches", "4")
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = train(2, tmp_path / "two.jsonl", "--micro_batches", "4", "--parallel", "pipeline", "--pipeline_stages", "2",
               "--pipeline_schedule", kind)
    assert r2.returncode == 0, r2.stderr[-3000:]
    one, two = final(tmp_path / "one.jsonl"), final(tmp_path / "two.jsonl")
    assert two["params_sha256"] == one["params_sha256"]
    assert two["test_accuracy"] == one["test_accuracy"] and two["pipeline_stages"] == 2
    assert "pipeline parallel: the layers cut into 2 stages" in r2.stderr and "stage 1 " in r2.stderr


@pytest.mark.slow
def test_pydtnn_train_hybrid_pipelines_equal_data_parallelism(tmp_path):
    """--parallel hybrid --pipeline_stages 2 over 4 processes: 2 replicas of a 2-stage pipeline end with the
    parameters of 2 data-parallel processes with the same micro-batches."""
    r2 = train(2, tmp_path / "dp.jsonl", "--micro_batches", "2")
    assert r2.returncode == 0, r2.stderr[-3000:]
    r4 = train(4, tmp_path / "hybrid.jsonl", "--micro_batches", "2", "--parallel", "hybrid", "--pipeline_stages", "2")
    assert r4.returncode == 0, r4.stderr[-3000:]
    dp, hybrid = final(tmp_path / "dp.jsonl"), final(tmp_path / "hybrid.jsonl")
    assert hybrid["params_sha256"] == dp["params_sha256"] and hybrid["test_accuracy"] == dp["test_accuracy"]
    assert (hybrid["world_size"], hybrid["replicas"], hybrid["pipeline_stages"]) == (4, 2, 2)
    assert "2 replicas of a pipeline of 2 stages" in r4.stderr


@pytest.mark.parametrize("n,flags,words", [
    (4, ["--parallel", "hybrid", "--pipeline_stages", "3"], "--pipeline_stages 3 does not divide the processes"),
    (2, ["--parallel", "pipeline", "--pipeline_stages", "2", "--model_parallel_size", "2"],
     "--model_parallel_size 2 with --parallel pipeline: stages split over model-parallel groups take --parallel hybrid"),
    (4, ["--parallel", "hybrid", "--pipeline_stages", "3", "--model_parallel_size", "2"],
     "--pipeline_stages 3 does not divide the processes (4 processes were launched) into pipelines of 3 stages x 2"),
    (2, ["--parallel", "pipeline", "--pipeline_stages", "3"], "--pipeline_stages 3 runs one stage per process, but 2"),
    (2, ["--pipeline_stages", "2"], "--pipeline_stages 2 needs --parallel pipeline"),
    (2, ["--parallel", "pipeline"], "--parallel pipeline needs --pipeline_stages S"),
    (2, ["--parallel", "pipeline", "--pipeline_stages", "2", "--stage_boundaries", "7.weight"],
     "--stage_boundaries: '7.weight' is not a layer a stage can begin at"),
    (2, ["--parallel", "pipeline", "--pipeline_stages", "2", "--stage_boundaries", "3,5"],
     "--stage_boundaries names 2 layers, but 2 stages begin at 1"),
    (1, ["--parallel", "pipeline", "--pipeline_stages", "1", "--checkpoint_dir", "CKPT"],
     "--pipeline_stages 1 is the whole model on each process"),
    (1, ["--pipeline_schedule", "gpipe"], "--pipeline_schedule applies to --parallel pipeline"),
])
def test_pipeline_mistakes_are_one_line_and_exit_2(tmp_path, n, flags, words):
    flags = [str(tmp_path / "ckpt") if f == "CKPT" else f for f in flags]
    r = train(n, tmp_path / "m.jsonl", *flags, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert lines and words in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "ckpt").exists()


def same_files(a, b, names=("model.safetensors", "optimizer.safetensors")):
    """Every tensor of checkpoint a's files equals checkpoint b's, to the bit, under the same names."""
    for name in names:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert list(x) == list(y), name
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), f"{name}: {k}"


@pytest.fixture(scope="module")
def one_process_checkpoints(tmp_path_factory):
    """One process, 4 micro-batches: its checkpoint after epoch 1, and its final record after epoch 2."""
    d = tmp_path_factory.mktemp("ck")
    for epochs in (1, 2):
        r = train(1, d / f"one{epochs}.jsonl", "--micro_batches", "4", "--num_epochs", str(epochs),
                  "--checkpoint_dir", str(d / f"one{epochs}"))
        assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_a_pipelines_checkpoint_is_the_whole_model_and_resumes_on_one_process(one_process_checkpoints, tmp_path):
    """2 stages save what one process saves (the whole model's state and optimizer slots, bit for bit, gathered
    onto the first stage), and one process resumes it where the uninterrupted run goes."""
    d = one_process_checkpoints
    r = train(2, tmp_path / "p.jsonl", "--micro_batches", "4", "--parallel", "pipeline", "--pipeline_stages", "2",
              "--checkpoint_dir", str(tmp_path / "pipe"))
    assert r.returncode == 0, r.stderr[-3000:]
    same_files(tmp_path / "pipe", d / "one1")
    r = train(1, tmp_path / "resumed.jsonl", "--resume", str(tmp_path / "pipe"), "--num_epochs", "2",
              "--parallel", "data")
    assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "resumed.jsonl")["params_sha256"] == final(d / "one2.jsonl")["params_sha256"]
    same_files(tmp_path / "pipe", d / "one2")


@pytest.mark.slow
def test_a_checkpoint_resumes_as_a_pipeline_and_a_pipelines_as_data_parallelism(one_process_checkpoints, tmp_path):
    """One process's checkpoint resumed by 3 stages ends where one process ends; a pipeline's checkpoint resumed
    by 2 data-parallel processes ends where they end from one process's checkpoint."""
    import shutil

    d = one_process_checkpoints
    shutil.copytree(d / "one1", tmp_path / "a")
    r = train(3, tmp_path / "a.jsonl", "--resume", str(tmp_path / "a"), "--num_epochs", "2", "--parallel",
              "pipeline", "--pipeline_stages", "3", "--pipeline_schedule", "gpipe")
    assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "a.jsonl")["pipeline_stages"] == 3
    assert final(tmp_path / "a.jsonl")["params_sha256"] == final(d / "one2.jsonl")["params_sha256"]
    same_files(tmp_path / "a", d / "one2")
    r = train(2, tmp_path / "p.jsonl", "--micro_batches", "4", "--parallel", "pipeline", "--pipeline_stages", "2",
              "--checkpoint_dir", str(tmp_path / "pipe"))
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(d / "one1", tmp_path / "b")
    for ck in ("pipe", "b"):
        r = train(2, tmp_path / f"dp-{ck}.jsonl", "--resume", str(tmp_path / ck), "--num_epochs", "2", "--parallel",
                  "data")
        assert r.returncode == 0, r.stderr[-3000:]
    got, want = final(tmp_path / "dp-pipe.jsonl"), final(tmp_path / "dp-b.jsonl")
    assert got["world_size"] == 2 and got["params_sha256"] == want["params_sha256"]


def assert_close_files(a, b, rtol, names=("model.safetensors", "optimizer.safetensors")):
    """Every tensor of checkpoint a's files within rtol of checkpoint b's (relative to each tensor's largest)."""
    for name in names:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert list(x) == list(y), name
        for k in x:
            scale = max(np.abs(y[k]).max(), 1e-300)
            err = np.abs(x[k] - y[k]).max() / scale
            assert err <= rtol, f"{name}: {k} differs by {err:.3g}"


def test_stages_split_over_model_parallel_groups_equal_one_process(one_process_checkpoints, tmp_path):
    """--parallel hybrid --pipeline_stages 2 --model_parallel_size 2 on 4 processes: each stage split over 2
    processes by output channels, each sending its stage's whole output to its counterpart in the next; the
    checkpoint (gathered within the groups, then across the stages) is one process's with the same micro-batches,
    to float64 rounding (the groups' sums add in another order)."""
    r = train(4, tmp_path / "mp.jsonl", "--micro_batches", "4", "--parallel", "hybrid", "--pipeline_stages", "2",
              "--model_parallel_size", "2", "--checkpoint_dir", str(tmp_path / "mp"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close_files(tmp_path / "mp", one_process_checkpoints / "one1", 1e-12)
    record = final(tmp_path / "mp.jsonl")
    assert (record["world_size"], record["replicas"], record["model_parallel_size"], record["pipeline_stages"]) == (
        4, 1, 2, 2)
    assert "cut into 2 stages, each split over 2 processes by output channels" in r.stderr


class _Splits:
    """A world of `size` at `rank` whose split records (color, key) instead of communicating."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def split(self, color, key):
        return (color, key)


def test_a_stage_split_over_a_group_takes_consecutive_ranks_and_pipelines_join_counterparts():
    """np 8 as 2 replicas of 2 stages x 2 processes: rank r S M + s M + m. Group: the same (r, s); pipeline: the
    same (r, m), ordered by stage; replicas: the same (s, m), ordered by r."""
    seen = {rank: pipeline.groups(_Splits(rank, 8), 2, 2) for rank in range(8)}
    members = lambda part: {c: sorted((key, r) for r, g in seen.items() for (cc, key) in [g[part]] if cc == c)
                            for c in {g[part][0] for g in seen.values()}}
    assert sorted(tuple(r for _, r in v) for v in members(2).values()) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert sorted(tuple(r for _, r in v) for v in members(0).values()) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted(tuple(r for _, r in v) for v in members(1).values()) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert seen[3][0][1] == 1 and seen[6][1][1] == 1  # rank 3 is stage 1 of its pipeline, rank 6 replica 1


def test_a_resumed_run_takes_the_saved_layout_whole_or_not_at_all(monkeypatch, tmp_path):
    from pydtnn import resume

    saved = {"parallel": "pipeline", "pipeline_stages": 2, "pipeline_schedule": "gpipe", "model": "simplecnn",
             "accumulation_steps": 4}
    monkeypatch.setattr(resume, "saved_config", lambda directory: dict(saved))
    kept = resume.resumed_config(str(tmp_path), {"num_epochs": 3})
    assert {k: kept[k] for k in saved} == saved
    for given in ({"parallel": "data"}, {"pipeline_stages": 3}):
        config = resume.resumed_config(str(tmp_path), given)
        assert not set(resume.LAYOUT) & set(config), given
        assert config["model"] == "simplecnn" and config["accumulation_steps"] == 4


@pytest.mark.slow
def test_hybrid_pipelines_with_synchronized_batchnorm_equal_data_parallelism_with_it(tmp_path):
    """--sync_batchnorm: each stage's BatchNorm statistics over its replicas' micro-batch, as data parallelism's
    accumulation takes them over its replicas': 2 x 2 (the worker's network: BatchNorm, dropout, flips, crops)
    ends with the parameters of 2 such processes, to the bit, and elsewhere than without synchronization."""
    for n, name, flags in ((2, "dp", ["--sync_batchnorm"]), (4, "hybrid", ["--sync_batchnorm"]), (4, "plain", [])):
        r = launch(n, tmp_path / f"{name}.st", "--replicas", "2", "--micro_batches", "2", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
    dp, hybrid, plain = (load_file(str(tmp_path / f"{name}.st")) for name in ("dp", "hybrid", "plain"))
    assert all(np.array_equal(dp[k], hybrid[k]) for k in dp)
    assert not all(np.array_equal(dp[k], plain[k]) for k in dp)


def test_data_x_pipeline_with_synchronized_batchnorm_equals_one_process(single, tmp_path):
    """Each replica takes its part of every micro-batch of the global batch (sampler.micro_shares), so with
    BatchNorm's statistics synchronized over the replicas 2 data-parallel processes and 2 replicas x 2 stages
    (np 4) end, after 10 steps with 4 micro-batches, where one process ends (float64, 1e-12)."""
    for n, name in ((2, "dp"), (4, "hybrid")):
        r = launch(n, tmp_path / f"{name}.st", "--replicas", "2", "--sync_batchnorm")
        assert r.returncode == 0, r.stderr[-3000:]
        assert_close(single, tmp_path / f"{name}.st", 1e-12)


@pytest.mark.slow
def test_hybrid_pipelines_save_what_data_parallelism_saves(tmp_path):
    """2 replicas of a 2-stage pipeline: each pipeline gathers its stages, the first one's first stage writes;
    the files are those of 2 data-parallel processes with the same micro-batches."""
    for n, flags in ((2, ()), (4, ("--parallel", "hybrid", "--pipeline_stages", "2"))):
        r = train(n, tmp_path / f"{n}.jsonl", "--micro_batches", "2", *flags, "--checkpoint_dir", str(tmp_path / str(n)))
        assert r.returncode == 0, r.stderr[-3000:]
    same_files(tmp_path / "4", tmp_path / "2")


TOPK = ("--micro_batches", "2", "--reduction", "topk", "--density", "0.1", "--topk_selection", "per_layer")


@pytest.mark.slow
def test_topk_pipelines_checkpoint_every_stages_unsent_gradients(tmp_path):
    """topk selecting each gradient's own largest entries, as data parallelism selects them: 2 replicas of a
    2-stage pipeline save what 2 data-parallel processes save, every replica's residual over the whole model
    included, bit for bit; each layout resumes the other's checkpoint after epoch 1 and ends where both end."""
    hybrid = ("--parallel", "hybrid", "--pipeline_stages", "2")
    for n, flags in ((2, ()), (4, hybrid)):
        for epochs in (1, 2):
            r = train(n, tmp_path / f"{n}-{epochs}.jsonl", *TOPK, *flags, "--num_epochs", str(epochs),
                      "--checkpoint_dir", str(tmp_path / f"{n}-{epochs}"))
            assert r.returncode == 0, r.stderr[-3000:]
    same_files(tmp_path / "4-2", tmp_path / "2-2")
    residual = load_file(str(tmp_path / "4-1" / "optimizer.safetensors"))["@reducer.residual"]
    assert residual.shape[0] == 2 and np.abs(residual).sum() > 0 and not np.array_equal(residual[0], residual[1])
    for n, ck, flags in ((2, "4-1", ("--parallel", "data")), (4, "2-1", (*hybrid, "--micro_batches", "2"))):
        r = train(n, tmp_path / f"r{n}.jsonl", "--resume", str(tmp_path / ck), "--num_epochs", "2", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        same_files(tmp_path / ck, tmp_path / "2-2")


def test_synchronized_batchnorm_refuses_a_replica_short_of_micro_batches(tmp_path):
    """Every replica must run every micro-batch for the statistics' collectives to match: a last global batch of
    4 samples over 2 replicas with 8 micro-batches is refused before training, in one line, not hung on."""
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--sync_batchnorm", "true",
                        "--micro_batches", "8", "--global_batch_size", "54", "--num_epochs", "1", "--progress", "false",
                        "--metrics_file", str(tmp_path / "m.jsonl")], capture_output=True, text=True, timeout=120,
                       env=ENV, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert lines and "--sync_batchnorm with --micro_batches 8: the global batch of 4 samples" in lines[0]
    assert not (tmp_path / "m.jsonl").exists()


def test_simulate_predicts_a_pipeline():
    r = subprocess.run([*TRAIN, "--simulate", "--np", "2", "--parallel", "pipeline", "--pipeline_stages", "2",
                        "--micro_batches", "4"], capture_output=True, text=True, timeout=120, env=ENV, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 stages per pipeline, 1f1b" in r.stdout and "pipeline bubble" in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("name,shape,starts", [("resnet20_cifar10", (3, 32, 32), ["layer2", "layer3"]),
                                               ("densenet_cifar10", (3, 32, 32), None)])
def test_cuts_of_torchvision_named_models_keep_every_state_name(name, shape, starts):
    """ResNets put their blocks' layers in the block's namespace (an empty name), DenseNets several blocks in one:
    the units get distinct names, the stages' state names are the whole model's, the stages chained give
    the whole model's outputs, and a Sequential's path begins a stage at its first layer."""
    from pydtnn import models

    def build():
        return models.create(name, input_shape=shape, num_classes=10, backend=CPUBackend(np.float64, seed=0))

    model, whole = build(), build()
    names = [p for p, _ in pipeline.units(model)]
    assert len(set(names)) == len(names) and all(n and not n.endswith(".") and "#" not in n for n in names)
    cut = pipeline.Cut.of(model, 3, starts)
    if starts:
        assert [names[b] for b in cut.bounds[1:-1]] == ["layer2.0", "layer3.0"]
    stages = [pipeline.stage_model(model, cut.units, cut.bounds, s) for s in range(3)]
    assert [k for s in stages for k, _ in s.named_state()] == [k for k, _ in whole.named_state()]
    assert [k for k, *_ in cut.layout] == [k for k, _ in whole.named_state()]
    x = np.random.default_rng(0).standard_normal((2,) + shape)
    h = x
    for s in stages:
        h = s.forward(h, training=False)
    np.testing.assert_array_equal(h, whole.forward(x, training=False))
