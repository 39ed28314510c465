"""The performance model of micro-batches, recomputation and pipelines: the schedule's timeline against the
closed form, work conserved across the stages, and each modelled effect moving the prediction its way."""

import dataclasses

import numpy as np
import pytest

from pydtnn import models
from pydtnn.backends import CPUBackend
from pydtnn.distributed import pipeline
from pydtnn.errors import ConfigError
from pydtnn.perfmodel import machine as machines
from pydtnn.perfmodel.machine import Link
from pydtnn.perfmodel.pipelined import unit_seconds
from pydtnn.perfmodel.predict import micro_sizes, predict, recomputed
from pydtnn.perfmodel.schedule import timeline
from pydtnn.perfmodel.table import table


def machine(**changes):
    base = dataclasses.replace(machines.DEFAULT, name="test", cores=8, processes_per_node=8,
                               links={"intra": Link(0.0, 1e30), "inter": Link(0.0, 1e30)})
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def resnet():
    return models.create("resnet20_cifar10", backend=CPUBackend("float32"))


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_equal_stages_take_the_closed_form_m_plus_s_minus_1(kind, stages, m):
    forward = [[1.0] * m for _ in range(stages)]
    backward = [[2.0] * m for _ in range(stages)]
    zero = [[0.0] * m for _ in range(stages)]
    line = timeline(forward, backward, zero, zero, kind)
    assert line.end == pytest.approx((m + stages - 1) * 3.0)
    assert line.busy == [pytest.approx(3.0 * m)] * stages
    assert line.idle[0] == pytest.approx((stages - 1) * 3.0)  # the bubble, (S-1)/(M+S-1) of the step


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
def test_every_op_starts_after_its_inputs_and_its_stage_is_free(kind):
    rng = np.random.default_rng(0)
    stages, m = 4, 6
    forward, backward = rng.uniform(0.5, 2, (stages, m)).tolist(), rng.uniform(1, 4, (stages, m)).tolist()
    msg = rng.uniform(0, 0.5, (stages, m)).tolist()
    line = timeline(forward, backward, msg, msg, kind)
    at = {(s, op, i): (a, b) for s in range(stages) for op, i, a, b in line.ops[s]}
    assert len(at) == 2 * stages * m
    for s in range(stages):
        ends = [b for *_, b in line.ops[s]]
        starts = [a for _, _, a, _ in line.ops[s]]
        assert all(a >= e - 1e-12 for a, e in zip(starts[1:], ends[:-1]))  # one op at a time
        assert [(op, i) for op, i, *_ in line.ops[s]] == pipeline.schedule(kind, stages, s, m)
        for i in range(m):
            if s:
                assert at[(s, "F", i)][0] >= at[(s - 1, "F", i)][1] + msg[s - 1][i] - 1e-12
            if s < stages - 1:
                assert at[(s, "B", i)][0] >= at[(s + 1, "B", i)][1] + msg[s][i] - 1e-12
            else:
                assert at[(s, "B", i)][0] >= at[(s, "F", i)][1]


def test_unequal_stages_make_the_schedules_differ():
    """The same work in another order: 1F1B sends the first gradients back sooner, so a slow middle stage
    costs it less than GPipe; the model says so rather than assume the textbook's equal stages."""
    forward = [[1.0] * 8, [2.0] * 8, [1.0] * 8, [1.5] * 8]
    backward = [[2 * t for t in row] for row in forward]
    msg = [[0.3] * 8 for _ in range(4)]
    gpipe, one_f_one_b = (timeline(forward, backward, msg, msg, k).end for k in ("gpipe", "1f1b"))
    assert one_f_one_b < gpipe


def test_micro_batches_are_cut_as_the_steps_cut_them():
    assert micro_sizes(10, 4) == [2, 3, 2, 3] and micro_sizes(3, 5) == [1, 1, 1] and micro_sizes(8, 1) == [8]


def test_the_stages_do_the_whole_models_work(resnet):
    """Work is conserved: the stages' busy seconds add up to one process's forward and backward of the batch
    (the same layers at the same micro-batches), and the pipeline's step is shorter than one process's."""
    m = machine()
    one = predict(resnet, 64, 1, m, micro_batches=4)
    whole = sum(t.total_s for t in one.layers)
    for stages in (2, 3, 4):
        p = predict(resnet, 64, stages, m, parallel="pipeline", micro_batches=4)
        assert sum(r["busy_s"] for r in p.stages) == pytest.approx(whole, rel=1e-9)
        assert [r["stage"] for r in p.stages] == list(range(stages)) and p.p2p_s == pytest.approx(0, abs=1e-12)
        assert p.step_s < one.step_s and p.bubble_s > 0 and p.global_batch == 64


def test_more_micro_batches_shrink_the_bubble(resnet):
    m = machine()
    bubbles = [predict(resnet, 64, 4, m, parallel="pipeline", micro_batches=k).bubble_s for k in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(bubbles, bubbles[1:])), bubbles


def test_messages_pay_the_link_between_the_stages_nodes(resnet):
    """2 stages on one node pay the intra-node link, on two nodes the (slow) inter-node one."""
    slow = {"intra": Link(1e-5, 1e10), "inter": Link(1e-3, 1e7)}
    inside = predict(resnet, 64, 2, machine(links=slow, processes_per_node=2), parallel="pipeline", micro_batches=4)
    across = predict(resnet, 64, 2, machine(links=slow, processes_per_node=1), parallel="pipeline", micro_batches=4)
    assert across.p2p_s > 100 * inside.p2p_s and across.step_s > inside.step_s
    # the message: stage 0's last unit's output, for each of 4 micro-batches of 16, cut as the prediction cuts
    cut = pipeline.Cut.of(resnet, 2, costs=unit_seconds(resnet, 16, machine(links=slow, processes_per_node=1)))
    shape = cut.units[cut.bounds[1] - 1][1].output_shape
    assert across.stages[0]["message_s"] == pytest.approx(4 * (1e-3 + 16 * np.prod(shape) * 4 / 1e7))


def test_hybrid_pipelines_reduce_each_stage_across_the_replicas(resnet):
    m = machine(links={"intra": Link(1e-4, 1e8), "inter": Link(1e-4, 1e8)})
    alone = predict(resnet, 64, 2, m, parallel="pipeline", micro_batches=4)
    hybrid = predict(resnet, 64, 4, m, parallel="hybrid", pipeline_stages=2, micro_batches=4)
    assert hybrid.global_batch == 2 * alone.global_batch and hybrid.parallel == "hybrid"
    assert all(r["reduce_s"] > 0 for r in hybrid.stages) and not any(r["reduce_s"] for r in alone.stages)
    assert hybrid.step_s > alone.step_s
    assert "2 stages per pipeline, 1f1b" in table(hybrid) and "pipeline bubble" in table(hybrid)


def test_recomputation_costs_the_second_forward_of_every_segment_but_the_last(resnet):
    m = machine()
    base = predict(resnet, 32, 1, m)
    for mode in ("segments", "all"):
        again = recomputed(resnet, mode)
        last_unit = resnet.units()[-1][0]
        assert again and last_unit not in again
        p = predict(resnet, 32, 1, m, recompute=mode)
        extra = sum(t.forward_s for t in base.layers if t.name in again)
        assert p.step_s - base.step_s == pytest.approx(extra, rel=1e-9)
        assert p.recompute == mode and f"recompute {mode}" in table(p)


def test_the_cut_balances_the_units_predicted_seconds(resnet):
    """pydtnn-train and the prediction cut by each unit's predicted forward and backward (unit_seconds), which
    add up to the layers' and weigh what FLOPs leave out (memory-bound layers, the skipped first dx)."""
    m = machine()
    costs = unit_seconds(resnet, 16, m)
    assert len(costs) == len(pipeline.units(resnet)) and min(costs) > 0
    assert sum(costs) == pytest.approx(sum(t.total_s for t in predict(resnet, 16, 1, m).layers), rel=1e-9)
    cut = pipeline.Cut.of(resnet, 3, costs=costs)
    assert cut.bounds == pipeline.balanced_cuts(costs, 3) and "% of the predicted time" in cut.describe()
    assert "% of the FLOPs" in pipeline.Cut.of(resnet, 3).describe()
    with pytest.raises(ValueError, match="unit costs"):
        pipeline.Cut.of(resnet, 3, costs=costs[:-1])


def test_a_split_stage_costs_its_groups_layers_and_collectives(resnet):
    """Model x pipeline: a stage of M processes computes its layers as rank 0 of the group holds them, with the
    group's collectives on the path of its ops. One stage of 2 is model parallelism of 2, whose prediction
    has the same compute and the same collectives."""
    from pydtnn.perfmodel.pipelined import predict_pipeline

    m = machine(links={"intra": Link(1e-5, 1e9), "inter": Link(1e-5, 1e9)})
    split_one = predict_pipeline(resnet, 32, 2, m, stages=1, micro_batches=2, model_parallel_size=2)
    model = predict(resnet, 32, 2, m, parallel="model", micro_batches=2)
    assert split_one.compute_s == pytest.approx(model.compute_s, rel=1e-9)
    assert split_one.group_comm_s == pytest.approx(model.group_comm_s, rel=1e-9) and model.group_comm_s > 0
    whole = predict(resnet, 32, 2, m, parallel="pipeline", micro_batches=4)
    both = predict(resnet, 32, 4, m, parallel="hybrid", pipeline_stages=2, model_parallel_size=2, micro_batches=4)
    assert both.model_parallel_size == 2 and both.pipeline_stages == 2 and both.global_batch == 32
    assert both.compute_s < whole.compute_s and both.group_comm_s > 0
    assert all(r["group_s"] > 0 for r in both.stages) and not any(r["group_s"] for r in whole.stages)
    assert both.exposed_comm_s >= both.group_comm_s
    replicated = predict(resnet, 32, 8, m, parallel="hybrid", pipeline_stages=2, model_parallel_size=2,
                         micro_batches=4)
    assert all(r["reduce_s"] > 0 for r in replicated.stages) and replicated.global_batch == 64
    with pytest.raises(ConfigError, match="does not divide np=6"):
        predict(resnet, 32, 6, m, parallel="hybrid", pipeline_stages=2, model_parallel_size=2)


def test_a_split_stage_sends_on_the_link_its_peers_share(resnet):
    """Process j of stage s sends its whole activation to process j of stage s + 1 (M ranks further): with 2
    processes a node, stages of 2 sit on different nodes, stages of 1 on one."""
    slow = {"intra": Link(1e-5, 1e10), "inter": Link(1e-3, 1e7)}
    m = machine(links=slow, processes_per_node=2)
    inside = predict(resnet, 64, 2, m, parallel="pipeline", micro_batches=4)
    across = predict(resnet, 64, 4, m, parallel="hybrid", pipeline_stages=2, model_parallel_size=2, micro_batches=4)
    assert across.p2p_s > 100 * inside.p2p_s
