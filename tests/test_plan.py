"""The run plan: one rule for layouts, batches and reducers, taken by the run and by --simulate alike."""

import pytest

from pydtnn.cli import parse_args
from pydtnn.errors import ConfigError
from pydtnn.plan import Layout, Reduction, RunPlan, layout


@pytest.mark.parametrize("parallel,world,m,expected", [
    (None, 1, None, Layout("sequential", 1, 1)),
    ("data", 4, None, Layout("data", 4, 1)),
    ("sequential", 1, 1, Layout("sequential", 1, 1)),
    ("model", 4, None, Layout("model", 4, 4)),
    ("model", 4, 4, Layout("model", 4, 4)),
    ("hybrid", 8, 2, Layout("hybrid", 8, 2)),
    ("hybrid", 4, 4, Layout("hybrid", 4, 4)),
    ("hybrid", 4, 1, Layout("data", 4, 1)),
])
def test_a_layout_is_what_runs(parallel, world, m, expected):
    lay = layout(parallel, world, m)
    assert lay == expected and lay.replicas == world // expected.model_parallel_size


@pytest.mark.parametrize("parallel,world,m,flag_message,python_message", [
    ("hybrid", 4, None, "--parallel hybrid needs --model_parallel_size", "parallel='hybrid' needs model_parallel_size"),
    ("hybrid", 4, 3, "--model_parallel_size 3 does not divide the 4 processes", "does not divide np=4"),
    ("data", 4, 2, "--model_parallel_size 2 needs --parallel hybrid", "model_parallel_size=2 needs parallel='hybrid'"),
    ("model", 4, 2, "--parallel model splits every layer over all 4 processes", "parallel='model' splits every"),
    ("zigzag", 4, None, "--parallel zigzag: expected one of", "parallel='zigzag': expected one of"),
    ("pipeline", 4, None, "--parallel pipeline needs --pipeline_stages S", "parallel='pipeline' needs pipeline_stages"),
    ("pipeline", 4, 2, "--parallel pipeline needs --pipeline_stages S", "parallel='pipeline' needs pipeline_stages"),
    ("hybrid", 4, 0, "--model_parallel_size 0; expected a positive integer", "model_parallel_size=0; expected"),
    ("sequential", 4, None, "--parallel sequential, but 4 processes were launched",
     "parallel='sequential', but 4 processes were launched"),
])
def test_a_bad_layout_names_the_flag_or_the_parameter(parallel, world, m, flag_message, python_message):
    with pytest.raises(ConfigError, match=flag_message):
        layout(parallel, world, m, flags=True)
    with pytest.raises(ConfigError, match=python_message.replace("(", r"\(")):
        layout(parallel, world, m)


@pytest.mark.parametrize("parallel,world,m,stages,message", [
    ("pipeline", 4, None, 2, "--pipeline_stages 2 runs one stage per process, but 4 processes were launched; launch "
                             "2 processes, or use --parallel hybrid"),
    ("pipeline", 2, 2, 2, "--model_parallel_size 2 with --parallel pipeline: stages split over model-parallel groups "
                          "take --parallel hybrid"),
    ("hybrid", 6, 2, 2, r"--pipeline_stages 2 does not divide the processes \(6 processes were launched\) into "
                        "pipelines of 2 stages x 2 processes each; expected a multiple of 4"),
    ("hybrid", 6, None, 4, "--pipeline_stages 4 does not divide the processes"),
    ("data", 2, None, 2, r"--pipeline_stages 2 needs --parallel pipeline \(or hybrid\); got --parallel data"),
    ("pipeline", 2, None, 0, "--pipeline_stages 0; expected a positive integer"),
    ("pipeline", 1, None, 1, "--pipeline_stages 1 is the whole model on each process; expected 2 or more"),
    ("hybrid", 2, None, 1, "--pipeline_stages 1 is the whole model on each process"),
])
def test_a_bad_pipeline_layout_names_the_flag(parallel, world, m, stages, message):
    with pytest.raises(ConfigError, match=message):
        layout(parallel, world, m, flags=True, pipeline_stages=stages)


def test_a_pipeline_layout_has_one_stage_per_process_and_one_replica():
    lay = layout("pipeline", 3, None, pipeline_stages=3)
    assert lay == Layout("pipeline", 3, 1, 3) and lay.replicas == 1 and lay.pipelined
    lay = layout("hybrid", 6, None, pipeline_stages=3)
    assert lay == Layout("hybrid", 6, 1, 3) and lay.replicas == 2 and lay.pipelined
    assert not layout("hybrid", 6, 3).pipelined
    lay = layout("hybrid", 8, 2, pipeline_stages=2)  # stages split over groups of 2: 2 replicas of 2 x 2
    assert lay == Layout("hybrid", 8, 2, 2) and lay.replicas == 2 and lay.pipelined


def test_the_plan_of_the_flags():
    args = parse_args(["--model", "simplecnn", "--parallel", "hybrid", "--model_parallel_size", "2",
                       "--global_batch_size", "64", "--reduction", "hierarchical", "--bucket_size_mb", "4",
                       "--gradient_compression", "fp16"])
    plan = RunPlan.from_args(args, 8)
    assert plan.layout == Layout("hybrid", 8, 2) and plan.batch_size == 16
    assert plan.reduction == Reduction("hierarchical", "fp16", "test", {"bucket_mb": 4.0, "ranks_per_node": None})
    assert plan.reduction.create_options(momentum=0.5) == {"compression": "fp16", "progress": "test",
                                                           "bucket_mb": 4.0, "ranks_per_node": None, "momentum": 0.5}
    with pytest.raises(ConfigError, match="--global_batch_size 64 does not divide by 3 processes"):
        RunPlan.from_args(parse_args(["--global_batch_size", "64"]), 3)


def test_one_replica_reduces_nothing_and_non_blocking_mpi_is_per_layer():
    assert RunPlan.from_args(parse_args(["--parallel", "model"]), 4).reduction.name is None
    assert RunPlan.from_args(parse_args(["--non_blocking_mpi", "true"]), 2).reduction.name == "per_layer"
    assert RunPlan.from_args(parse_args([]), 2).reduction.name == "bucketed"


def test_a_plan_is_frozen():
    plan = RunPlan.from_args(parse_args([]), 1)
    with pytest.raises(AttributeError):
        plan.batch_size = 3


def test_model_parallelism_on_a_gpu_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="--parallel hybrid splits layers over CPU processes; with --enable_gpu"):
        RunPlan.from_args(parse_args(["--enable_gpu", "true", "--parallel", "hybrid", "--model_parallel_size", "2"]), 4)
    assert RunPlan.from_args(parse_args(["--enable_gpu", "true"]), 4).layout == Layout("data", 4, 1)
