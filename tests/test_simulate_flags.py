"""--simulate honours every pydtnn-train flag that changes what a step runs, or refuses it in one line."""

import dataclasses

import pytest

from pydtnn.cli import build_parser, main, parse_args
from pydtnn.errors import ConfigError
from pydtnn.perfmodel import machine as machines
from pydtnn.perfmodel import simulate as sim
from pydtnn.perfmodel.auto import for_simulate
from pydtnn.plan import RunPlan

BASE = ["--simulate", "--model", "simplecnn", "--np", "4", "--batch_size", "32"]
RESNET = ["--model", "resnet20_cifar10"]  # gradients of 1.1 MB: more than the first bucket, unlike simplecnn's
# flag -> (extra flags of the base run, the change): the change must move the prediction
CHANGES = {
    "model": ([], ["--model", "lenet5"]),
    "model_file": ([], ["--model_file", "MODEL_FILE"]),
    "dataset": (["--model", "resnet20"], ["--dataset", "cifar10"]),
    "batch_size": ([], ["--batch_size", "64"]),
    "global_batch_size": ([], ["--global_batch_size", "256"]),
    "dtype": ([], ["--dtype", "float64"]),
    "optimizer": ([], ["--optimizer", "adam"]),
    "momentum": ([], ["--momentum", "0"]),
    "nesterov": ([], ["--nesterov", "true"]),
    "decay": ([], ["--decay", "0.0001"]),
    "parallel": ([], ["--parallel", "model"]),
    "model_parallel_size": (["--parallel", "hybrid", "--model_parallel_size", "2"], ["--model_parallel_size", "4"]),
    "non_blocking_mpi": ([], ["--non_blocking_mpi", "true"]),
    "reduction": (RESNET, ["--reduction", "blocking"]),
    "gradient_compression": ([], ["--gradient_compression", "fp16"]),
    "reduction_progress": (RESNET, ["--reduction_progress", "thread"]),
    "bucket_size_mb": (RESNET, ["--bucket_size_mb", "0.01"]),
    "density": (["--reduction", "topk"], ["--density", "0.5"]),
    "rank": (["--reduction", "powersgd"], ["--rank", "1"]),
    "local_sgd": (["--local_sgd", "1"], ["--local_sgd", "8"]),
    "reduction_staleness": (RESNET, ["--reduction_staleness", "1"]),
    "threads_per_process": ([], ["--threads_per_process", "2"]),
    "machine": ([], ["--machine", "MACHINE"]),
    "np": ([], ["--np", "8"]),
    "accumulation_steps": (RESNET, ["--accumulation_steps", "4"]),
    "recompute": ([], ["--recompute", "all"]),
    "context_length": (["--model", "gpt", "--dataset", "text"], ["--context_length", "64"]),
    "pipeline_stages": (["--parallel", "pipeline", "--pipeline_stages", "2", "--np", "2"],
                        ["--pipeline_stages", "4", "--np", "4"]),
    "pipeline_schedule": (["--parallel", "pipeline", "--pipeline_stages", "4", "--accumulation_steps", "4"],
                          ["--pipeline_schedule", "gpipe"]),
    "stage_boundaries": (["--parallel", "pipeline", "--pipeline_stages", "2", "--np", "2"],
                         ["--stage_boundaries", "6"]),
    "zero": (["--np", "4", "--optimizer", "adam"], ["--zero", "1"]),
    "memory_per_process": (["--parallel", "auto"], ["--memory_per_process", "0.01"]),
}
REFUSED_VALUES = {
    "enable_gpu": ["--enable_gpu", "true"],
    "enable_nccl": ["--enable_nccl", "true"],
    "sync_every": ["--sync_every", "4"],
    "sync_batchnorm": ["--sync_batchnorm", "true"],
    "topk_selection": ["--reduction", "topk", "--topk_selection", "per_layer"],
    "density_warmup_epochs": ["--reduction", "topk", "--density_warmup_epochs", "1"],
    "momentum_correction": ["--reduction", "topk", "--momentum_correction", "true"],
    "ranks_per_node": ["--reduction", "hierarchical", "--ranks_per_node", "2"],
    "debug_collectives": ["--debug_collectives", "true"],
    "evaluate_only": ["--evaluate_only", "true"],
}


def _defaults():
    return vars(build_parser().parse_args([]))


def _predict(argv):
    args = parse_args(argv)
    for_simulate(args, say=lambda line: None)  # --parallel auto: the plan's layout, as pydtnn-train's main takes it
    return sim.simulate(args, _defaults(), say=lambda line: None)


def _files(tmp_path, argv):
    """argv with MODEL_FILE and MACHINE replaced by files written in tmp_path."""
    model_file = tmp_path / "small_model.py"
    model_file.write_text("from pydtnn.layers import Conv2D, Dense, Flatten, ReLU\n\n\n"
                          "def create_model(input_shape, num_classes):\n"
                          "    return [Conv2D(4, 3, padding=1), ReLU(), Flatten(), Dense(num_classes)]\n")
    slow = dataclasses.replace(machines.DEFAULT, memory_bandwidth=machines.DEFAULT.memory_bandwidth / 4)
    machines.save(slow, str(tmp_path / "slow.json"))
    return [str(model_file) if a == "MODEL_FILE" else str(tmp_path / "slow.json") if a == "MACHINE" else a
            for a in argv]


def test_every_flag_is_modelled_refused_or_outside_a_step():
    dests = {a.dest for a in build_parser()._actions}
    places = [set(sim.MODELLED), set(sim.REFUSED), set(sim.NOTED), set(sim.OUTSIDE_A_STEP), {"simulate"}]
    assert set().union(*places) == dests, "flags placed nowhere or placed but gone: " + str(
        sorted(set().union(*places) ^ dests))
    assert sum(len(p) for p in places) == len(dests), "a flag is placed twice"
    assert set(CHANGES) == set(sim.MODELLED) and set(REFUSED_VALUES) == set(sim.REFUSED)


@pytest.mark.parametrize("flag", sorted(CHANGES))
def test_a_modelled_flag_changes_the_prediction(flag, tmp_path):
    extra, change = CHANGES[flag]
    before = _predict(BASE + extra)
    after = _predict(_files(tmp_path, BASE + extra + change))
    assert dataclasses.asdict(after) != dataclasses.asdict(before)
    assert after.step_s != before.step_s, f"--{flag} changed no time of the step"


@pytest.mark.parametrize("flag", sorted(REFUSED_VALUES))
def test_a_flag_the_model_leaves_out_is_refused_in_one_line(flag, capsys):
    with pytest.raises(ConfigError, match=f"--simulate does not model .* --{flag} "):
        _predict(BASE + REFUSED_VALUES[flag])
    assert main(BASE + REFUSED_VALUES[flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--{flag}" in err


def test_a_flag_outside_a_step_changes_nothing():
    base = _predict(BASE)
    for argv in (["--num_epochs", "7"], ["--learning_rate", "0.5"], ["--seed", "3"], ["--drop_last", "true"]):
        assert _predict(BASE + argv).step_s == base.step_s


def test_the_global_batch_wins_over_the_batch_per_process_as_in_training():
    args = BASE + ["--global_batch_size", "64"]
    assert _predict(args).batch_size == 16
    assert RunPlan.from_args(parse_args(args), 4).batch_size == 16  # the plan pydtnn-train's start() takes


@pytest.mark.parametrize("extra,flags", [([], []), (["--reduction", "per_layer", "--reduction_progress", "thread"],
                                                     ["--reduction", "per_layer", "--progress", "thread"]),
                                         (["--parallel", "hybrid", "--model_parallel_size", "2"],
                                          ["--parallel", "hybrid", "--model_parallel_size", "2"]),
                                         (["--parallel", "pipeline", "--pipeline_stages", "4", "--accumulation_steps",
                                           "4", "--recompute", "segments"],
                                          ["--parallel", "pipeline", "--micro_batches", "4", "--recompute", "segments"]),
                                         (["--parallel", "hybrid", "--pipeline_stages", "2", "--pipeline_schedule",
                                           "gpipe"],
                                          ["--parallel", "hybrid", "--pipeline_stages", "2", "--pipeline_schedule",
                                           "gpipe"])])
def test_simulate_and_perfmodel_predict_predict_the_same_plan_alike(extra, flags, capsys):
    import json

    from pydtnn.perfmodel.cli import main as perfmodel

    simulated = _predict(BASE + extra)
    assert perfmodel(["predict", "--model", "simplecnn", "--batch_size", "32", "--np", "4", "--json"] + flags) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["step_s"] == simulated.step_s and predicted["messages"] == simulated.messages


def test_a_flag_the_model_cannot_know_is_said(capsys):
    """--conv_autotune (on by default in a run) measures the algorithms; the prediction costs the threshold ones
    and says so, unless --conv_autotune false makes the run do the same."""
    _predict(BASE)
    assert "costed with its threshold algorithm" in capsys.readouterr().err
    _predict(BASE + ["--conv_autotune", "false"])
    assert capsys.readouterr().err == ""
