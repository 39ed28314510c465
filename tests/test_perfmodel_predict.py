"""The step prediction: compute from the layers' costs, communication from the reducer's real messages."""

import dataclasses
import gc
import json
import subprocess
import sys

import numpy as np
import pytest

from pydtnn import models
from pydtnn.backends import CPUBackend
from pydtnn.distributed.comm import SingleProcess
from pydtnn.errors import ConfigError
from pydtnn.layers import Dense, Flatten, ReLU
from pydtnn.model import Model
from pydtnn.perfmodel import collectives
from pydtnn.perfmodel import machine as machines
from pydtnn.perfmodel.cli import main
from pydtnn.perfmodel.costs import layer_costs
from pydtnn.perfmodel.machine import Link
from pydtnn.perfmodel.predict import predict
from pydtnn.perfmodel.table import duration, table

ALPHA, BETA, GAMMA = 1e-5, 1e-9, 5e-10  # the link's latency and seconds per byte, the reduction's seconds per byte


def machine(**changes):
    base = dataclasses.replace(
        machines.DEFAULT, name="test", cores=4, processes_per_node=4,
        rates={"gemm": 1e9, "direct3x3": 1e9, "depthwise": 1e9, "elementwise": 1e9}, thread_scaling={1: 1.0, 2: 2.0},
        memory_bandwidth=1e15, reduce_rate=1 / GAMMA,
        links={"intra": Link(ALPHA, 1 / BETA), "inter": Link(10 * ALPHA, 0.1 / BETA)})
    return dataclasses.replace(base, **changes)


def mlp(widths=(300, 200, 10)):
    layers = [Flatten()]
    for w in widths[:-1]:
        layers += [Dense(w), ReLU()]
    return Model(layers + [Dense(widths[-1])], (1, 8, 8), CPUBackend(kernels="numpy"))


def test_compute_is_every_phase_at_its_rate_when_memory_is_free():
    """With unlimited bandwidth, each phase takes its FLOPs at 1 GFLOP/s: Dense(64 -> 300) forward at batch 8 is
    8 * 64 * 300 multiply-adds (2 FLOPs) plus the bias add, 0.3096 ms."""
    model = mlp()
    p = predict(model, 8, 1, machine())
    first = next(t for t in p.layers if t.kind == "Dense")
    assert first.forward_s == pytest.approx((2 * 8 * 64 * 300 + 8 * 300) / 1e9, rel=0.02)
    flops = sum(c.forward.flops + c.backward.flops for c in layer_costs(model, 8))
    assert p.compute_s == pytest.approx(flops / 1e9) and p.memory_s == pytest.approx(p.update_s)
    assert p.comm_s == p.exposed_comm_s == 0 and p.messages == 0
    assert p.step_s == pytest.approx(p.compute_s + p.memory_s)


def test_a_second_thread_halves_compute_and_oversubscribed_cores_slow_it():
    model = mlp()
    one, two = predict(model, 8, 1, machine()), predict(model, 8, 1, machine(), threads=2)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    crowded = predict(model, 8, 8, machine(processes_per_node=8, cores=4))  # 8 processes on 4 cores
    assert crowded.compute_s == pytest.approx(2 * one.compute_s)


def test_fixed_costs_add_per_layer_call_per_parameter_and_per_step_by_hand():
    """mlp(): Flatten, Dense, ReLU, Dense, ReLU, Dense: 6 layers and 6 parameter tensors (3 weights, 3 biases).
    Each layer adds 10 us to its forward and 20 us to its backward, each tensor 3 us, the step 400 us:
    6 * 30 + 6 * 3 + 400 = 598 us."""
    model = mlp()
    fixed = machines.Overheads(layer_forward_s=1e-5, layer_backward_s=2e-5, parameter_s=3e-6, step_s=4e-4)
    bare, p = predict(model, 8, 1, machine()), predict(model, 8, 1, machine(overheads=fixed))
    assert len(p.layers) == 6 and len(model.parameters()) == 6
    assert p.overhead_s == pytest.approx(598e-6, rel=1e-12) and bare.overhead_s == 0.0
    assert p.step_s == pytest.approx(bare.step_s + 598e-6, rel=1e-12)
    assert p.compute_s == pytest.approx(bare.compute_s) and p.memory_s == pytest.approx(bare.memory_s)
    first, first_bare = p.layers[1], bare.layers[1]  # Dense(64 -> 300)
    assert first.forward_s == pytest.approx(first_bare.forward_s + 1e-5, rel=1e-12)
    assert first.backward_data_s == pytest.approx(first_bare.backward_data_s + 2e-5, rel=1e-12)
    assert first.backward_weights_s == first_bare.backward_weights_s
    assert p.layers[0].forward_s == pytest.approx(1e-5)  # Flatten: no arithmetic, only the call
    # threads do not shrink fixed costs; 8 processes on 4 cores double them, as they double compute
    assert predict(model, 8, 1, machine(overheads=fixed), threads=2).overhead_s == pytest.approx(598e-6, rel=1e-12)
    crowded = predict(model, 8, 8, machine(overheads=fixed, processes_per_node=8, cores=4))
    assert crowded.overhead_s == pytest.approx(2 * 598e-6, rel=1e-12)


def test_a_layer_kind_with_its_own_call_cost_pays_it_by_hand():
    """mlp() (Flatten, Dense, ReLU, Dense, ReLU, Dense) with 10 / 20 us per call, ReLU's own 2 / 3 us and Dense's
    40 / 50 us: 10 + 20 + 2 * (2 + 3) + 3 * (40 + 50) = 310 us of calls; a ReLU's forward is its arithmetic + 2 us."""
    model = mlp()
    fixed = machines.Overheads(layer_forward_s=1e-5, layer_backward_s=2e-5,
                               layer_calls={"ReLU": (2e-6, 3e-6), "Dense": (4e-5, 5e-5)})
    bare, p = predict(model, 8, 1, machine()), predict(model, 8, 1, machine(overheads=fixed))
    assert p.overhead_s == pytest.approx(310e-6, rel=1e-12)
    relu, relu_bare = p.layers[2], bare.layers[2]
    assert relu.kind == "ReLU" and relu.forward_s == pytest.approx(relu_bare.forward_s + 2e-6, rel=1e-12)
    assert p.layers[0].forward_s == pytest.approx(1e-5)  # Flatten: no kind of its own, the common cost


def test_each_kernel_class_scales_with_threads_by_its_own_factor():
    """gemm (the Dense layers) gains 1.25x at 2 threads, the rest the machine's 2x: every phase of a Dense
    layer takes 1/1.25 of its one-thread time, every ReLU phase half."""
    model = mlp()
    m = machine(thread_scaling_by_class={"gemm": {1: 1.0, 2: 1.25}})
    one, two = predict(model, 8, 1, m), predict(model, 8, 1, m, threads=2)
    for a, b in zip(one.layers, two.layers):
        factor = {"Dense": 1.25, "ReLU": 2.0}.get(a.kind)
        if factor:
            assert b.forward_s == pytest.approx(a.forward_s / factor, rel=1e-12), a.name
            assert b.backward_weights_s == pytest.approx(a.backward_weights_s / factor, rel=1e-12), a.name


def test_the_serial_part_of_each_call_runs_on_one_thread_by_hand():
    """thread_serial_s {2: 0.1 ms}: a phase of t seconds on one thread takes 0.1 ms + (t - 0.1 ms) / 2 at two
    threads, or t where t is no longer than 0.1 ms (a small call gains nothing); one thread is unchanged."""
    model = mlp()
    m = machine(thread_serial_s={2: 1e-4})
    one, two = predict(model, 8, 1, m), predict(model, 8, 1, m, threads=2)
    assert [t.forward_s for t in one.layers] == [t.forward_s for t in predict(model, 8, 1, machine()).layers]
    seen = set()
    for a, b in zip(one.layers, two.layers):
        for f in ("forward_s", "backward_weights_s"):
            t = getattr(a, f)
            want = t if t <= 1e-4 else 1e-4 + (t - 1e-4) / 2
            assert getattr(b, f) == pytest.approx(want, rel=1e-12), (a.name, f)
            seen.add(t > 1e-4)
    assert seen == {True, False}  # both sides of the serial part were checked
    assert m.serial_s(1) == 0.0 and m.serial_s(2) == 1e-4 and m.serial_s(8) == 1e-4  # the largest count below
    assert m.threaded_seconds(3e-4, 2) == pytest.approx(2e-4) and m.threaded_seconds(5e-5, 2) == 5e-5


def test_blocking_reduction_is_one_ring_allreduce_of_all_gradients_by_hand():
    model = mlp()
    n = sum(g.nbytes for _, _, g in model.parameters())
    p = predict(model, 8, 4, machine(), reduction="blocking")
    ring = 2 * 3 * ALPHA + 2 * 3 / 4 * n * BETA + 3 / 4 * n * GAMMA  # 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
    assert p.messages == 1 and p.comm_s == pytest.approx(ring) and p.exposed_comm_s == pytest.approx(ring)
    assert p.step_s == pytest.approx(p.compute_s + p.memory_s + ring)


def test_blocking_pieces_follow_the_reducer():
    model = Model([Flatten(), Dense(3000)], (3, 32, 32), CPUBackend(kernels="numpy"))  # 36.9 MB of gradients
    assert predict(model, 2, 2, machine(), reduction="blocking").messages == 3  # 16 + 16 + 4.9 MB


@pytest.mark.parametrize("reduction", ["per_layer", "bucketed", "hierarchical"])
def test_pieces_of_every_allreduce_follow_the_reducer(reduction):
    """A 36.9 MB weight gradient travels in 16 MiB pieces whatever the strategy: 16 + 16 + 4.9 MB, and its bias
    alone (the first bucket closes past 1 MB)."""
    model = Model([Flatten(), Dense(3000)], (3, 32, 32), CPUBackend(kernels="numpy"))
    assert predict(model, 2, 2, machine(), reduction=reduction).messages == 4


class Recorder(SingleProcess):
    """One process that records the collectives it is asked for: (collective, bytes)."""

    def __init__(self):
        self.seen = []

    def allreduce(self, buf, label=""):
        self.seen.append(("allreduce", buf.nbytes))
        return buf

    def iallreduce(self, buf, label=""):
        self.seen.append(("allreduce", buf.nbytes))
        return super().iallreduce(buf, label)

    def allgatherv(self, send, recv, counts, label=""):
        self.seen.append(("allgather", send.nbytes))
        return super().allgatherv(send, recv, counts, label)

    def allreduce_sum(self, values, label="metrics"):
        self.seen.append(("allreduce", 8 * len(values)))  # float64 values (fp16 compression's scales)
        return super().allreduce_sum(values, label)


@pytest.mark.parametrize("reduction,options", [
    ("blocking", {}), ("per_layer", {}), ("bucketed", {"bucket_mb": 0.05, "first_bucket_mb": 0.01}),
    ("bucketed", {}), ("topk", {"density": 0.1}), ("topk", {"density": 0.1, "selection": "per_layer"}),
    ("blocking", {"compression": "fp16"}), ("per_layer", {"compression": "fp16"}),
    ("bucketed", {"bucket_mb": 0.05, "first_bucket_mb": 0.01, "compression": "fp16"})])
def test_predicted_messages_are_the_ones_the_reducer_sends(reduction, options, monkeypatch):
    """The performance model takes its messages from the registry's pure function, the one the reducer lays them
    out with: per step, a reducer over a recording communicator sends exactly those (in 4 KB pieces here)."""
    from pydtnn.distributed import reducers

    monkeypatch.setattr(reducers.base, "PIECE_BYTES", 4096)
    model = models.create("simplecnn", backend=CPUBackend("float32", seed=1))
    comm = Recorder()
    red = reducers.create(reduction, comm, **options).attach(model)
    x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)
    red.begin_step(0.5)
    model.forward(x, training=True)
    model.backward(np.ones((4, 10), np.float32))
    red.finish()
    counts = [g.size for _, _, g in model.parameters()]
    predicted = reducers.messages(reduction, counts, 4, **options)
    assert len(comm.seen) > (8 if reduction != "topk" else 1)
    assert sorted((m.collective, m.nbytes) for m in predicted) == sorted(comm.seen)


def test_per_layer_sends_one_message_per_gradient_and_bucketed_packs_them():
    model = mlp((300, 200, 100, 10))
    assert predict(model, 8, 4, machine(), reduction="per_layer").messages == len(model.parameters())
    assert predict(model, 8, 4, machine(), reduction="bucketed", first_bucket_mb=1e9).messages == 1
    # reversed parameter order, bytes: 40, 4000, 400, 80000, 800, 240000, 1200, 76800; the first bucket closes
    # past 0.01 MB (4440 bytes), then 0.5 MB holds the rest (398800), or 0.2 MB cuts it 80800 | 240000 | 1200 + 76800
    for bucket_mb, count in ((0.5, 2), (0.2, 4)):
        p = predict(model, 8, 4, machine(), reduction="bucketed", bucket_mb=bucket_mb, first_bucket_mb=0.01)
        assert p.messages == count, bucket_mb


def test_thread_progress_hides_communication_behind_backward_and_test_progress_does_not():
    model = mlp((300, 200, 100, 10))
    slow = machine(links={"intra": Link(ALPHA, 1e9), "inter": Link(ALPHA, 1e9)})
    hidden = predict(model, 64, 4, slow, reduction="per_layer", progress="thread")
    exposed = predict(model, 64, 4, slow, reduction="per_layer", progress="test")
    assert hidden.comm_s == pytest.approx(exposed.comm_s)
    assert exposed.exposed_comm_s == pytest.approx(exposed.comm_s)
    assert 0 <= hidden.exposed_comm_s < hidden.comm_s
    blocking = predict(model, 64, 4, slow, reduction="blocking", progress="thread")
    assert blocking.exposed_comm_s == pytest.approx(blocking.comm_s)  # started after backward: nothing to hide behind


def test_a_background_link_progresses_test_collectives_as_a_thread_would():
    """Link.background (sockets, RDMA): per_layer's messages hide behind backward under progress "test" as under a
    progress thread, on the link the processes' collectives use (intra on one node, inter across nodes)."""
    model = mlp((300, 200, 100, 10))
    plain = machine(links={"intra": Link(ALPHA, 1e9), "inter": Link(ALPHA, 1e9)})
    sockets = machine(links={"intra": Link(ALPHA, 1e9, background=True), "inter": Link(ALPHA, 1e9)})
    thread = predict(model, 64, 4, plain, reduction="per_layer", progress="thread")
    test = predict(model, 64, 4, sockets, reduction="per_layer", progress="test")
    assert test.exposed_comm_s == pytest.approx(thread.exposed_comm_s) and test.exposed_comm_s < test.comm_s
    across = dataclasses.replace(sockets, processes_per_node=2)  # 4 processes over 2 nodes: the inter link's
    assert predict(model, 64, 4, across, reduction="per_layer").exposed_comm_s == pytest.approx(
        predict(model, 64, 4, across, reduction="per_layer").comm_s)
    blocking = predict(model, 64, 4, sockets, reduction="blocking")
    assert blocking.exposed_comm_s == pytest.approx(blocking.comm_s)
    data = machines.to_dict(sockets)
    assert data["links"]["intra"]["background"] is True and "background" not in data["links"]["inter"]
    assert machines.from_dict(data).link("intra").background
    data["links"]["intra"]["background"] = "yes"
    with pytest.raises(ConfigError, match="background = 'yes' is invalid; expected true or false"):
        machines.from_dict(data)


def test_processes_beyond_a_node_pay_the_inter_node_link():
    model = mlp()
    inside = predict(model, 8, 4, machine(processes_per_node=4), reduction="blocking")
    across = predict(model, 8, 4, machine(processes_per_node=2), reduction="blocking")
    assert across.comm_s > 5 * inside.comm_s


def test_a_node_aware_mpi_reduces_across_nodes_with_one_leader_each_and_steps_on_both_links():
    """machine.node_aware_collectives: the gradients' allreduces over 2 nodes of 2 cost collectives.node_aware (one
    leader per node carries the buffer across); their three steps need both links to progress by themselves."""
    model = mlp((300, 200, 100, 10))
    sockets = machine(processes_per_node=2, links={"intra": Link(ALPHA, 1e10), "inter": Link(ALPHA, 1e8,
                                                                                             background=True)})
    aware = dataclasses.replace(sockets, node_aware_collectives=True)
    flat, composed = (predict(model, 64, 4, m, reduction="bucketed", algorithm="ring") for m in (sockets, aware))
    nbytes = sum(p.nbytes for _, p, _ in model.parameters())
    assert composed.comm_s == pytest.approx(collectives.node_aware("allreduce", nbytes, 4, aware), rel=1e-9)
    assert composed.comm_s < 0.8 * flat.comm_s
    flat, composed = (predict(model, 64, 4, m, reduction="per_layer", algorithm="ring") for m in (sockets, aware))
    assert flat.exposed_comm_s < flat.comm_s  # the inter link alone progresses the flat ring
    assert composed.exposed_comm_s == pytest.approx(composed.comm_s)  # the shared-memory steps wait for test()
    both = dataclasses.replace(aware, links={"intra": Link(ALPHA, 1e10, background=True),
                                             "inter": Link(ALPHA, 1e8, background=True)})
    assert predict(model, 64, 4, both, reduction="per_layer", algorithm="ring").exposed_comm_s < composed.comm_s
    # one process a node: the composition is the leaders' allreduce alone, which the inter link progresses
    lone = dataclasses.replace(aware, processes_per_node=1)
    alone = predict(model, 64, 4, lone, reduction="per_layer", algorithm="ring")
    assert alone.exposed_comm_s < alone.comm_s
    assert alone.comm_s == pytest.approx(predict(model, 64, 4, dataclasses.replace(lone, node_aware_collectives=False),
                                                 reduction="per_layer", algorithm="ring").comm_s)
    # inside one node the machine's MPI has nothing to compose
    one = dataclasses.replace(aware, processes_per_node=4)
    assert predict(model, 64, 4, one, reduction="bucketed").comm_s == pytest.approx(
        predict(model, 64, 4, dataclasses.replace(one, node_aware_collectives=False), reduction="bucketed").comm_s)


@pytest.mark.parametrize("bad,match", [({"parallel": "sequential"}, "parallel='sequential'"),
                                       ({"parallel": "pipeline", "schedule": "zigzag"}, "schedule='zigzag'"),
                                       ({"micro_batches": 0}, "micro_batches=0"),
                                       ({"recompute": "half"}, "recompute='half'"),
                                       ({"parallel": "hybrid", "pipeline_stages": 2, "model_parallel_size": 2},
                                        r"pipeline_stages=2 x model_parallel_size=2 does not divide np=2"),
                                       ({"parallel": "hybrid"}, "needs model_parallel_size"),
                                       ({"parallel": "hybrid", "model_parallel_size": 3}, "does not divide np"),
                                       ({"reduction": "tree"}, "reduction='tree'"),
                                       ({"algorithm": "magic"}, "algorithm='magic'"),
                                       ({"threads": 0}, "threads=0")])
def test_bad_choices_name_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        predict(mlp(), 8, 2, machine(), **bad)


def test_the_command_prints_a_table_and_json_with_the_documented_keys():
    run = [sys.executable, "-m", "pydtnn.perfmodel.cli", "predict", "--model", "simplecnn", "--batch_size", "16",
           "--np", "2"]
    r = subprocess.run(run + ["--json"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("step_s", "compute_s", "memory_s", "comm_s", "exposed_comm_s", "layers"):
        assert key in d
    assert d["layers"] and {"name", "kind", "algorithm", "forward_s", "total_s"} <= set(d["layers"][0])
    assert d["step_s"] == pytest.approx(d["compute_s"] + d["memory_s"] + d["overhead_s"] + d["exposed_comm_s"])
    r = subprocess.run(run, check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "exposed communication" in r.stdout and "Conv2D" in r.stdout
    r = subprocess.run(run + ["--parallel", "hybrid"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs model_parallel_size" in r.stderr
    r = subprocess.run(run + ["--parallel", "hybrid", "--model_parallel_size", "2", "--json"], check=False,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["parallel"] == "hybrid" and d["model_parallel_size"] == 2 and d["group_comm_s"] > 0
    assert d["comm_s"] == pytest.approx(d["group_comm_s"])  # one replica: no gradients to reduce between replicas
    assert d["global_batch"] == 16 and d["samples_per_second"] == pytest.approx(16 / d["step_s"])


def test_table_names_every_layer():
    p = predict(mlp(), 8, 2, machine())
    text = table(p)
    assert all(t.name in text for t in p.layers)


def _predict_zoo(names):
    """Predict each zoo model (data parallel and hybrid); returns the checks that failed."""
    failed = []
    for name in names:
        model = models.create(name, backend=CPUBackend())
        p = predict(model, 2, 4, machines.DEFAULT, reduction="bucketed", algorithm="best")
        # the buckets together cost at least one allreduce of all the gradients (splitting a message only
        # adds latency), and the step is the sum of its parts
        whole = collectives.best("allreduce", sum(g.nbytes for _, _, g in model.parameters()), 4, machines.DEFAULT)[1]
        parts = p.compute_s + p.memory_s + p.overhead_s + p.exposed_comm_s
        if not (p.comm_s >= whole * (1 - 1e-9) and p.step_s == pytest.approx(parts, rel=1e-12)):
            failed.append(f"{name}: data-parallel step {p.step_s} (parts {parts}), communication {p.comm_s} "
                          f"against one allreduce of every gradient {whole}")
        if len(p.layers) < sum(1 for _, layer in model.layers() if layer.params):
            failed.append(f"{name}: {len(p.layers)} layers predicted")
        h = predict(model, 2, 4, machines.DEFAULT, parallel="hybrid", model_parallel_size=2, algorithm="best")
        if not (np.isfinite(h.step_s) and h.group_comm_s > 0 and h.comm_s > h.group_comm_s):
            failed.append(f"{name}: hybrid step {h.step_s}, group communication {h.group_comm_s}, all {h.comm_s}")
        del model
        gc.collect()  # the model and its split copy (VGG at ImageNet shape: over a GB) go before the next one
    return failed


@pytest.mark.slow
def test_every_zoo_model_is_predicted():
    """Every zoo model, in two worker processes (half the models each: building the ImageNet models
    is most of the time, and it uses one core)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    names = models.names()
    halves = [names[0::2], names[1::2]]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [f for part in pool.map(_predict_zoo, halves, timeout=600) for f in part]
    assert sum(map(len, halves)) == len(names) >= 40 and failed == [], failed


def test_train_simulate_prints_the_prediction_and_trains_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--simulate", "--np", "4", "--model", "resnet20",
                        "--dataset", "cifar10", "--batch_size", "32", "--metrics_file", str(tmp_path / "m.jsonl")],
                       check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resnet20_cifar10: batch 32 per process, 4 process(es)" in r.stdout
    assert "simulated, nothing trained" in r.stdout and list(tmp_path.iterdir()) == []
    assert "pydtnn: resnet20 -> resnet20_cifar10 (--dataset cifar10: 3x32x32 images, 10 classes)\n" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--simulate", "--model", "resnet20", "--dataset", "synthetic"],
                       check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "needs the images' shape" in r.stderr and r.stderr.count("\n") == 1


# -- model and hybrid parallelism ---------------------------------------------------------------------------------
def test_model_parallel_communication_is_the_schemes_collectives_by_hand():
    """[Flatten, Dense(4), ReLU, Dense(2)] over 2 processes, batch 3, float64 (docs/parallelism.md): an allreduce
    of Dense(4)'s dx (3 x 64 elements: its input), an allgather before Dense(2) of 3 x 4 elements and its
    reduce-scatter back, and the output's allgather of 3 x 2; ring algorithms on the intra link."""
    model = Model([Flatten(), Dense(4), ReLU(), Dense(2)], (1, 8, 8), CPUBackend("float64", kernels="numpy"))
    p = predict(model, 3, 2, machine(), parallel="model")
    b = 8  # bytes per element
    allreduce = 2 * ALPHA + 2 * 0.5 * (3 * 64 * b) * BETA + 0.5 * (3 * 64 * b) * GAMMA
    gather = ALPHA + 0.5 * (3 * 4 * b) * BETA
    scatter = ALPHA + 0.5 * (3 * 4 * b) * (BETA + GAMMA)
    output = ALPHA + 0.5 * (3 * 2 * b) * BETA
    assert p.group_comm_s == pytest.approx(allreduce + gather + scatter + output)
    assert p.comm_s == p.exposed_comm_s == pytest.approx(p.group_comm_s)  # one replica: no gradient reduction
    assert p.messages == 4 and p.model_parallel_size == 2


def test_measured_allgather_and_reduce_scatter_links_price_the_groups_collectives_by_hand():
    """As above, with the intra link's own fits for allgather (4 alpha, 4 beta) and reduce_scatter (2 alpha,
    2 beta) as calibrate's probe stores them: the gathers and their reduce-scatter pay those, the allreduce
    of dx the link's figures; data parallelism, which sends no allgather, is unchanged."""
    model = Model([Flatten(), Dense(4), ReLU(), Dense(2)], (1, 8, 8), CPUBackend("float64", kernels="numpy"))
    fits = {"allgather": Link(4 * ALPHA, 0.25 / BETA), "reduce_scatter": Link(2 * ALPHA, 0.5 / BETA)}
    slow = machine(links={"intra": Link(ALPHA, 1 / BETA, collectives=fits), "inter": Link(10 * ALPHA, 0.1 / BETA)})
    p, plain = predict(model, 3, 2, slow, parallel="model"), predict(model, 3, 2, machine(), parallel="model")
    b = 8
    allreduce = 2 * ALPHA + 2 * 0.5 * (3 * 64 * b) * BETA + 0.5 * (3 * 64 * b) * GAMMA
    gather = 4 * ALPHA + 0.5 * (3 * 4 * b) * 4 * BETA
    scatter = 2 * ALPHA + 0.5 * (3 * 4 * b) * (2 * BETA + GAMMA)
    output = 4 * ALPHA + 0.5 * (3 * 2 * b) * 4 * BETA
    assert p.group_comm_s == pytest.approx(allreduce + gather + scatter + output, rel=1e-12)
    assert p.group_comm_s > plain.group_comm_s and p.step_s > plain.step_s
    data = predict(mlp(), 8, 2, slow, reduction="bucketed")
    assert data.step_s == predict(mlp(), 8, 2, machine(), reduction="bucketed").step_s


def test_oversubscribed_cores_add_the_measured_wait_per_collective_by_hand():
    """mlp() with per_layer: 6 gradients, 6 allreduces a step. 2 cores, 2 ms measured per collective at 2
    ranks per core: np 2 waits nothing, np 4 (crowding 2) 6 x 2 ms, np 3 (crowding 1.5) 6 x 1 ms, np 2 at 2
    threads (crowding 2) 6 x 2 ms. Model parallelism over 4 on 2 cores: its 4 group collectives x 2 ms."""
    fixed = machines.Overheads(oversubscribed_collective_s=2e-3)
    m, bare = machine(cores=2, overheads=fixed), machine(cores=2)
    model = mlp()
    for np_, threads, wait in ((1, 1, 0.0), (2, 1, 0.0), (4, 1, 12e-3), (3, 1, 6e-3), (2, 2, 12e-3)):
        p, q = (predict(model, 8, np_, mm, reduction="per_layer", threads=threads) for mm in (m, bare))
        assert p.sync_s == pytest.approx(wait, rel=1e-12), (np_, threads)
        assert p.step_s == pytest.approx(q.step_s + wait, rel=1e-12)
        assert p.exposed_comm_s == pytest.approx(q.exposed_comm_s + wait, rel=1e-12)
    threaded = predict(model, 8, 4, m, reduction="per_layer", progress="thread")
    assert threaded.sync_s == pytest.approx(12e-3)  # a wait for a rank off the cores is never hidden
    small = Model([Flatten(), Dense(8), ReLU(), Dense(4)], (1, 8, 8), CPUBackend("float64", kernels="numpy"))
    split = predict(small, 3, 4, m, parallel="model")
    assert split.messages == 4 and split.sync_s == pytest.approx(4 * 2e-3, rel=1e-12)
    assert "waiting for ranks off oversubscribed cores" in table(split)


def test_each_process_computes_its_share_and_replicas_reduce_only_their_slices():
    model = mlp((300, 200, 10))
    whole = predict(model, 8, 1, machine())
    split = predict(model, 8, 2, machine(), parallel="model")
    dense = [t for t in whole.layers if t.kind == "Dense"]
    halves = [t for t in split.layers if t.kind == "Dense"]
    for w, h in zip(dense, halves):  # 300, 200, 10 outputs: rank 0 holds exactly half of each
        assert h.backward_weights_s == pytest.approx(w.backward_weights_s / 2, rel=1e-3)
    hybrid = predict(model, 8, 4, machine(), parallel="hybrid", model_parallel_size=2, reduction="blocking")
    data = predict(model, 8, 2, machine(), reduction="blocking")
    # hybrid: two replicas reduce half of the gradients each; data: two processes reduce all of them
    assert hybrid.comm_s - hybrid.group_comm_s < 0.6 * data.comm_s


@pytest.mark.parametrize("name", ["vgg11bn_cifar10", "resnet20_cifar10", "googlenet_cifar10", "mobilenetv1_cifar10"])
def test_model_and_hybrid_predictions_for_zoo_models(name):
    """Splitting every layer over more processes leaves each less to compute and costs more in the groups'
    collectives (each pays more latency and a larger (p-1)/p share); a hybrid replica of the same group size
    computes what the model-parallel one does, and adds the replicas' gradient reduction."""
    model = models.create(name)
    m4 = machine(processes_per_node=4)
    whole = predict(model, 16, 1, m4)
    split = {np_: predict(model, 16, np_, m4, parallel="model") for np_ in (2, 4)}
    assert whole.compute_s > split[2].compute_s > split[4].compute_s
    assert 0 < split[2].group_comm_s < split[4].group_comm_s
    for np_, group in ((4, 2), (8, 4)):
        hybrid = predict(model, 16, np_, m4, parallel="hybrid", model_parallel_size=group)
        same = split[group]
        assert hybrid.compute_s == pytest.approx(same.compute_s, rel=1e-12)
        assert hybrid.comm_s > hybrid.group_comm_s and hybrid.messages > same.messages
        assert json.loads(json.dumps(hybrid.to_dict()))["model_parallel_size"] == group


def test_the_hierarchical_reducer_is_the_bucketed_layout_in_two_levels():
    from pydtnn.perfmodel import collectives

    model, m = mlp(), machine(processes_per_node=2)
    bucketed = predict(model, 8, 4, m, reduction="bucketed", algorithm="ring")
    two = predict(model, 8, 4, m, reduction="hierarchical")
    assert two.messages == bucketed.messages and two.algorithm == "hierarchical"
    one_bucket = sum(g.nbytes for _, _, g in model.parameters())  # 0.33 MB: all in the first bucket (1 MB)
    assert two.messages == 1 and two.comm_s == pytest.approx(collectives.hierarchical("allreduce", one_bucket, 4, m))
    assert two.comm_s != pytest.approx(bucketed.comm_s)


def test_topk_is_two_allgathers_of_the_kept_entries_by_hand():
    """mlp(): 81,710 float32 gradients; density 0.01 keeps k = 818 per replica. Over 2 processes, ring
    allgathers of 2 x 818 x 8 bytes of indices and 2 x 818 x 4 of values, after backward."""
    p = predict(mlp(), 8, 2, machine(), reduction="topk", density=0.01)
    k = 818
    by_hand = sum(ALPHA + 0.5 * n * BETA for n in (2 * k * 8, 2 * k * 4))
    assert p.messages == 2 and p.comm_s == pytest.approx(by_hand) and p.exposed_comm_s == pytest.approx(by_hand)


def test_topk_selection_is_priced_as_passes_over_the_gradients_by_hand():
    """TopKReducer.finish on mlp()'s 81,710 float32 gradients (326,840 bytes), k = 818 over 2 replicas: 9.5
    passes over the bytes and 4 scattered 64-byte lines per sent entry, at the memory bandwidth; against
    blocking, topk's step differs by that and its two allgathers alone. One replica: no selection."""
    bw = 1e9
    topk = predict(mlp(), 8, 2, machine(memory_bandwidth=bw), reduction="topk", density=0.01)
    dense = predict(mlp(), 8, 2, machine(memory_bandwidth=bw), reduction="blocking")
    by_hand = (9.5 * 326_840 + 4 * 818 * 64) / bw
    assert topk.memory_s - dense.memory_s == pytest.approx(by_hand)
    assert topk.step_s - topk.exposed_comm_s == pytest.approx(dense.step_s - dense.exposed_comm_s + by_hand)
    alone = predict(mlp(), 8, 1, machine(memory_bandwidth=bw), reduction="topk", density=0.01)
    assert alone.memory_s == pytest.approx(predict(mlp(), 8, 1, machine(memory_bandwidth=bw)).memory_s)


# -- the command line: density, units, which model -----------------------------------------------------------------
@pytest.mark.parametrize("command", ["predict", "sweep"])
@pytest.mark.parametrize("value", ["nan", "0", "5", "-1", "inf", "1.5", "half"])
def test_a_density_outside_0_1_is_refused_when_parsed(command, value, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("pydtnn.perfmodel.simulate.build_model", lambda *a, **k: pytest.fail("built a model"))
    argv = [command, "--model", "simplecnn", "--batch_size", "2", "--density", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pydtnn-perfmodel: error: argument --density")
    assert f"got {value!r}" in err and "(0, 1]" in err, err
    assert list(tmp_path.iterdir()) == []


def test_density_1_sends_every_entry(capsys):
    """density 1 is allowed: topk then gathers all 81,710 entries of mlp() (indices and values) from each replica."""
    p = predict(mlp(), 8, 2, machine(), reduction="topk", density=1.0)
    n = sum(g.size for _, _, g in mlp().parameters())
    assert p.comm_s == pytest.approx(sum(ALPHA + 0.5 * b * BETA for b in (2 * n * 8, 2 * n * 4)))


def test_duration_picks_the_unit_that_fits():
    assert [duration(s) for s in (196.098753, 0.0123, 8.5e-4, 1234.4, 0.0, 2.5e-9)] == [
        "196.1 s", "12.3 ms", "850 us", "1,234 s", "0 s", "2.5 ns"]


def test_the_table_gives_the_step_in_seconds_and_the_throughput():
    """A step of 196.098753 s over 4 processes of batch 8: 32 samples every 196.1 s, 0.1632 samples/s;
    hybrid with groups of 2 has half the replicas, so half the global batch."""
    p = dataclasses.replace(predict(mlp(), 8, 4, machine()), step_s=196.098753)
    text = table(p)
    assert "step 196.1 s = compute" in text and "196098" not in text
    assert "0.1632 samples/s: a global batch of 32 samples every 196.1 s" in text
    assert p.to_dict()["samples_per_second"] == pytest.approx(32 / 196.098753)
    hybrid = predict(mlp(), 8, 4, machine(), parallel="hybrid", model_parallel_size=2)
    assert hybrid.global_batch == 16 and hybrid.samples_per_second == pytest.approx(16 / hybrid.step_s)


def predict_cli(capsys, *argv):
    """(JSON of `pydtnn-perfmodel predict --json ...`, its stderr)."""
    assert main(["predict", "--json", *argv]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_a_family_name_says_which_variant_it_took(capsys):
    d, err = predict_cli(capsys, "--model", "mobilenetv1", "--batch_size", "2")
    assert d["model"] == "mobilenetv1_imagenet"
    assert err == ("pydtnn-perfmodel: mobilenetv1 -> mobilenetv1_imagenet (3x224x224 images, its design input; "
                   "--dataset or --input_shape picks another)\n")
    d, err = predict_cli(capsys, "--model", "mobilenetv1_cifar10", "--batch_size", "2")
    assert d["model"] == "mobilenetv1_cifar10" and err == ""  # a registered name: nothing was chosen


@pytest.mark.parametrize("flags,shape,classes", [(["--dataset", "mnist5k"], (1, 28, 28), 10),
                                                 (["--dataset", "cifar100"], (3, 32, 32), 100),
                                                 (["--input_shape", "3,32,32"], (3, 32, 32), 10),
                                                 (["--dataset", "cifar10", "--num_classes", "7"], (3, 32, 32), 7)])
def test_dataset_and_input_shape_pick_the_model_pydtnn_train_builds(capsys, flags, shape, classes):
    """The prediction is that of the model pydtnn-train's resolve_model builds for such data."""
    import types

    from pydtnn.run import resolve_model

    d, err = predict_cli(capsys, "--model", "mobilenetv1", "--batch_size", "2", *flags)
    train = types.SimpleNamespace(input_shape=shape, num_classes=classes)
    choice, model = resolve_model("mobilenetv1", train, CPUBackend())
    assert d["model"] == choice.name == "mobilenetv1_cifar10"
    assert d["step_s"] == predict(model, 2, 1, machines.DEFAULT).step_s
    assert err.startswith("pydtnn-perfmodel: mobilenetv1 -> mobilenetv1_cifar10 (") and err.count("\n") == 1
    assert f"{'x'.join(map(str, shape))} images, {classes} classes" in err
    assert all(note in err for note in choice.notes[1:]), (err, choice.notes)


def test_the_dataset_table_holds_every_image_dataset_but_synthetic_and_the_embedded_digits_match_it(capsys):
    from pydtnn import data
    from pydtnn.perfmodel.simulate import DATASET_SHAPES

    # a text dataset has no sample shape fixed in advance: --simulate models its windows (simulate.text_data)
    assert set(DATASET_SHAPES) == set(data.NAMES) - {"synthetic"} - set(data.TEXT)
    train, _ = data.load("mnist5k")
    assert (tuple(train.input_shape), train.num_classes) == DATASET_SHAPES["mnist5k"]
    assert main(["predict", "--model", "vgg16", "--batch_size", "2", "--dataset", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'synthetic' has no image shape" in err and "--input_shape" in err
