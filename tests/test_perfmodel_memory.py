"""The memory model: each part follows the configuration as the code does, and the total is a measured step's peak."""

import json
import os
import sys
import tracemalloc

import numpy as np
import pytest

from pydtnn import losses, models, optim
from pydtnn.backends import CPUBackend
from pydtnn.perfmodel.cli import main
from pydtnn.perfmodel.memory import PARTS, predict_memory, reducer_state
from pydtnn.plan import Reduction
from pydtnn.step import Step

SGD = ("sgd", {"momentum": 0.9})


def build(name="resnet20_cifar10"):
    return models.create(name, backend=CPUBackend(np.float32, seed=0))


def measured_peak(name, batch, optimizer, micro_batches=1, recompute="none"):
    """The traced peak of a step's state, as benchmarks/memory_validation.py measures it (kernels compiled first)."""
    shape, classes = models.defaults(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = np.eye(classes, dtype=np.float32)[rng.integers(0, classes, batch)]

    def step():
        model = models.create(name, backend=CPUBackend(np.float32, seed=0))
        return Step(model, losses.create("categorical_cross_entropy"),
                    optim.create(optimizer[0], model.parameters(), backend=model.backend, **optimizer[1]),
                    accumulation_steps=micro_batches, recompute=recompute)

    step().run(x[:4], y[:4])
    tracemalloc.start()
    s = step()
    tracemalloc.reset_peak()
    for _ in range(2):
        s.run(x, y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("name,batch,optimizer,micro_batches,recompute", [
    ("simplecnn", 32, SGD, 1, "none"), ("resnet20_cifar10", 32, ("adam", {}), 2, "none"),
    ("resnet20_cifar10", 24, SGD, 1, "segments")])
def test_the_total_is_a_measured_steps_peak(name, batch, optimizer, micro_batches, recompute):
    predicted = predict_memory(build(name), batch, optimizer, micro_batches, recompute).total
    measured = measured_peak(name, batch, optimizer, micro_batches, recompute)
    assert abs(predicted / measured - 1) <= 0.1, (predicted, measured)


def test_each_part_follows_the_configuration():
    model = build()
    nbytes = sum(p.nbytes for _, p, _ in model.parameters())
    plain = predict_memory(model, 32, SGD)
    assert plain.parts["parameters"] == plain.parts["gradients"] == nbytes and plain.parts["buffers"] == 0
    assert plain.parts["optimizer"] >= nbytes  # the momentum, and the update's scratch
    adam = predict_memory(model, 32, ("adam", {}))
    assert adam.parts["optimizer"] - plain.parts["optimizer"] >= nbytes  # a second moment
    assert predict_memory(model, 32, ("sgd", {})).parts["optimizer"] < plain.parts["optimizer"]
    double = predict_memory(model, 64, SGD)
    assert double.parts["activations"] == pytest.approx(2 * plain.parts["activations"], rel=0.05)
    micro = predict_memory(model, 32, SGD, micro_batches=4)
    assert micro.parts["buffers"] == nbytes  # the gradients' sum
    assert micro.parts["activations"] == pytest.approx(plain.parts["activations"] / 4, rel=0.1)
    assert predict_memory(model, 32, SGD, recompute="segments").parts["activations"] < plain.parts["activations"]
    assert set(plain.parts) == set(PARTS) and plain.total == sum(plain.parts.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipelines_stages_hold_their_micro_batches_in_flight(schedule):
    model = build()
    m = predict_memory(model, 32, SGD, micro_batches=8, pipeline_stages=3, schedule=schedule)
    assert [r["stage"] for r in m.stages] == [0, 1, 2]
    assert [r["in_flight"] for r in m.stages] == ([8, 8, 8] if schedule == "gpipe" else [3, 2, 1])
    whole = sum(p.nbytes for _, p, _ in model.parameters())
    assert sum(r["parameters"] for r in m.stages) == whole  # each stage holds its own layers' only
    assert all(r["buffers"] > r["parameters"] for r in m.stages[:2])  # the receive buffers of every micro-batch
    assert m.total == max(r["total"] for r in m.stages)


def test_the_command_and_the_predictions_json_carry_the_memory(capsys):
    assert main(["memory", "--model", "simplecnn", "--batch_size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == sum(out[p] for p in PARTS) and out["model"] == "simplecnn"
    assert main(["predict", "--model", "simplecnn", "--batch_size", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["total"] == pytest.approx(out["total"], rel=1e-3)  # measured
    assert main(["memory", "--model", "simplecnn", "--batch_size", "16", "--np", "2", "--parallel", "model",
                 "--json"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["model_parallel_size"] == 2 and split["parameters"] < out["parameters"]
    assert main(["memory", "--model", "simplecnn", "--batch_size", "16", "--np", "4", "--parallel", "hybrid",
                 "--model_parallel_size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3" in err


def test_split_layers_hold_rank_0s_slices_and_whole_gathered_tensors():
    """Model parallelism of 2: the process holds its slices of the parameters (rank 0: the larger half of
    every split layer), and its activations include the whole tensors its gathers make."""
    from pydtnn.perfmodel.split import split_model

    model = build()
    plain = predict_memory(model, 32, SGD)
    split = predict_memory(model, 32, SGD, model_parallel_size=2)
    held = sum(p.nbytes for _, p, _ in split_model(model, 2).parameters())
    assert split.parts["parameters"] == split.parts["gradients"] == held
    assert plain.parts["parameters"] / 2 <= held < 0.6 * plain.parts["parameters"]
    assert plain.parts["activations"] / 2 < split.parts["activations"] < plain.parts["activations"]
    both = predict_memory(model, 32, SGD, micro_batches=4, pipeline_stages=2, model_parallel_size=2)
    assert both.model_parallel_size == 2 and [r["stage"] for r in both.stages] == [0, 1]
    assert sum(r["parameters"] for r in both.stages) == held  # rank 0 of each stage's group


@pytest.mark.parametrize("model,batch,k,m,stages", [("resnet20_cifar10", 32, 1, 2, 1),
                                                     ("resnet20_cifar10", 32, 4, 2, 2)])
def test_each_process_of_a_layout_measures_what_the_model_predicts(model, batch, k, m, stages):
    """A real run under mpiexec (benchmarks/memory_worker.py): the busiest process's traced peak is within 10%
    of the prediction, and so is every stage's busiest process's of its stage's row."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import memory_validation

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    peaks = memory_validation.measure_parallel(model, batch, "sgd_momentum", k, m, stages, "1f1b", env)
    pred = predict_memory(build(model), batch, SGD, k, pipeline_stages=stages, model_parallel_size=m)
    assert abs(pred.total / max(peaks) - 1) <= 0.1, (pred.total, peaks)
    for row in pred.stages:
        stage_peak = max(peaks[row["stage"] * m:(row["stage"] + 1) * m])
        assert abs(row["total"] / stage_peak - 1) <= 0.1, (row, peaks)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_sharded_replica_measures_what_the_model_predicts(stage):
    """ZeRO at 2 replicas (Adam): each replica's traced peak, measured under mpiexec, is within 10% of the
    prediction; at 4 replicas the optimizer's part (its shard's state and the allgather's buffers) is smaller."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import memory_validation

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    peaks = memory_validation.measure_parallel("resnet20_cifar10", 32, "adam", 1, 1, 1, "1f1b", env, stage, 2)
    model = build("resnet20_cifar10")
    pred = predict_memory(model, 32, ("adam", {}), zero=stage, replicas=2)
    four = predict_memory(model, 32, ("adam", {}), zero=stage, replicas=4)
    assert abs(pred.total / max(peaks) - 1) <= 0.1, (pred.total, peaks)
    assert four.parts["optimizer"] < pred.parts["optimizer"] and pred.zero == stage


def test_the_reducer_part_is_what_each_reducer_keeps():
    """Measured on the real reducers: error feedback keeps one residual per gradient (topk's momentum correction a
    velocity too), the stale reducer two wire buffers, local SGD a buffer of the parameters and the momentum, fp16
    a half-precision wire buffer, a lossless reducer bookkeeping only; nothing over one replica or at ZeRO's stages
    2 and 3, whose reduce-scatters replace the reducer."""
    model = build()
    nbytes = sum(p.nbytes for _, p, _ in model.parameters())

    def part(name, replicas=2, compression="none", **options):
        return reducer_state(model, Reduction(name, compression, "test", options), replicas, SGD)

    assert part("bucketed") < 0.05 * nbytes and part("per_layer") < 0.05 * nbytes
    assert part("bucketed", compression="fp16") == pytest.approx(nbytes / 2, rel=0.1)
    assert part("topk", density=0.01) == pytest.approx(nbytes, rel=0.05)
    assert part("oktopk", density=0.01) == pytest.approx(nbytes, rel=0.05)
    assert part("topk", density=0.01, momentum=0.9) == pytest.approx(2 * nbytes, rel=0.05)
    assert part("powersgd", rank=4) >= 2 * nbytes  # its own copy of the gradients and their residual, P and Q
    assert part("stale") == pytest.approx(2 * nbytes, rel=0.05)
    assert part("local_sgd", every=4) == pytest.approx(2 * nbytes, rel=0.05)  # the parameters and the momentum
    assert part("topk", replicas=1, density=0.01) == 0 and reducer_state(model, None, 2) == 0
    # the two-level reducers hold their one level's arrays (their node and leader groups hold none)
    assert part("hierarchical", replicas=4, ranks_per_node=2) < 0.05 * nbytes  # bucketed's bookkeeping
    assert part("powersgd", replicas=4, rank=4, hierarchical=True, ranks_per_node=2) == pytest.approx(
        part("powersgd", rank=4), rel=0.01)
    stale = Reduction("stale", "none", "test", {})
    m = predict_memory(model, 8, SGD, replicas=2, reduction=stale)
    assert m.parts["reducer"] == pytest.approx(part("stale"), rel=0.01) and m.total == sum(m.parts.values())
    fp16 = Reduction("bucketed", "fp16", "test", {})  # ZeRO stage 1 reduces with the run's reducer; 2 and 3 their own
    assert predict_memory(model, 8, SGD, zero=1, replicas=2, reduction=fp16).parts["reducer"] >= 0.45 * nbytes
    assert predict_memory(model, 8, SGD, zero=2, replicas=2, reduction=fp16).parts["reducer"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["topk:density=0.01", "stale"])
def test_a_replicas_reducer_state_is_measured_as_a_run_holds_it(spec):
    """simplecnn at batch 8 over 2 replicas (its parameters weigh against its activations): the busiest replica's
    traced peak under mpiexec is within 5% of the prediction, and more than 5% above it without the reducer part."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import memory_validation

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    peaks = memory_validation.measure_parallel("simplecnn", 8, "sgd_momentum", 1, 1, 1, "1f1b", env, replicas=2,
                                               reduction=spec)
    pred = memory_validation.predicted("simplecnn", 8, "sgd_momentum", 1, "none", replicas=2, reduction=spec)
    assert abs(pred.total / max(peaks) - 1) <= 0.05, (pred.total, peaks)
    assert (pred.total - pred.parts["reducer"]) / max(peaks) < 0.95, (pred.parts, peaks)
