"""The PyTorch twin used by the benchmarks computes what the pydtnn model computes, and trains the same way."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from torch_equivalent import to_torch

from pydtnn import losses, models, optim
from pydtnn.backends import CPUBackend


@pytest.mark.slow
@pytest.mark.parametrize("name", ["simplecnn", "vgg11_cifar10", "resnet20_cifar10", "mobilenetv1_cifar10",
                                  "googlenet_cifar10"])
def test_torch_twin_matches_forward_and_gradients(name):
    model = models.create(name)
    twin = to_torch(model).eval()
    x = np.random.default_rng(0).standard_normal((2,) + model.input_shape).astype(np.float32)
    y = model.forward(x, training=False)
    ty = twin(torch.tensor(x))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-4, atol=1e-5 * np.abs(y).max())
    assert sum(p.numel() for p in twin.parameters()) == model.count_params()


# the models of benchmarks/train_step.py; dropout off, so both sides compute the same thing
TRAIN_STEP_MODELS = [("simplecnn", {}), ("vgg11_cifar10", {"dropout": 0.0}), ("resnet20_cifar10", {}),
                     ("mobilenetv1_cifar10", {"dropout": 0.0})]


@pytest.mark.slow
@pytest.mark.parametrize("name,options", TRAIN_STEP_MODELS)
def test_torch_twin_takes_the_same_sgd_step(name, options):
    """Training-mode forward, cross-entropy, backward and an SGD(momentum=0.9) step: same loss, same parameters.

    In float64: in float32 a rounding difference that flips one ReLU mask behind a small-batch BatchNorm
    changes a gradient by far more than rounding (the float32 forward is checked above).
    """
    model = models.create(name, backend=CPUBackend(np.float64), **options)
    twin = to_torch(model).train()
    pairs = list(zip(model.parameters(), twin.parameters()))
    assert len(pairs) == len(model.parameters()) == len(list(twin.parameters()))
    for (pname, p, _), tp in pairs:
        assert tuple(p.shape) == tuple(tp.shape) and tp.dtype == torch.float64, pname
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2,) + model.input_shape), rng.integers(0, model.output_shape[0], 2)

    loss = losses.SoftmaxCrossEntropy()
    value = loss.forward(model.forward(x, training=True), y)
    model.backward(loss.backward())
    optim.create("sgd", model.parameters(), lr=0.05, momentum=0.9).step()
    tloss = torch.nn.functional.cross_entropy(twin(torch.tensor(x)), torch.tensor(y))
    tloss.backward()
    torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9).step()

    assert value == pytest.approx(tloss.item(), rel=1e-9)
    for (pname, p, _), tp in pairs:
        # both started equal and moved by 0.05 * grad: they may differ by rounding of that step, not more
        tg = tp.grad.numpy()
        err, step = np.abs(p - tp.detach().numpy()).max(), 0.05 * np.abs(tg).max()
        assert err <= 1e-6 * step + 1e-14, f"{pname}: parameters differ by {err:.3g} after a step of {step:.3g}"


def test_layers_benchmark_times_the_gemms_of_gemm_shaped_layers_alone():
    """benchmarks/layers.py's GEMM ceiling: the three GEMMs of a Dense or one-group convolution layer
    (their FLOPs are the layer's three times), none for layers that are not GEMMs."""
    import layers as bench

    from pydtnn.layers import Conv2D, Dense, ReLU

    calls = []
    real = np.matmul

    def counting(a, b, out=None):
        calls.append((a.shape, b.shape))
        return real(a, b, out=out)

    dense = Dense(24)
    dense.build((40,), np.float32)
    conv = Conv2D(6, 3, padding=1)
    conv.build((4, 5, 7), np.float32)
    depthwise = Conv2D(4, 3, padding=1, groups=4)
    depthwise.build((4, 5, 7), np.float32)
    relu = ReLU()
    relu.build((4, 5, 7), np.float32)
    bench.np.matmul, saved = counting, bench.np.matmul
    try:
        assert bench.gemms_alone(dense, (8, 40), 1, 1) > 0
        assert calls[:3] == [((8, 40), (40, 24)), ((8, 24), (24, 40)), ((40, 8), (8, 24))]
        calls.clear()
        assert bench.gemms_alone(conv, (3, 4, 5, 7), 1, 1) > 0
        k, n = 4 * 9, 3 * 5 * 7
        assert calls[:3] == [((6, k), (k, n)), ((6, n), (n, k)), ((k, 6), (6, n))]
        assert bench.gemms_alone(depthwise, (3, 4, 5, 7), 1, 1) is None
        assert bench.gemms_alone(relu, (3, 4, 5, 7), 1, 1) is None
    finally:
        bench.np.matmul = saved


def test_layers_benchmark_rates_each_layer_against_the_peaks_measured_around_it():
    import layers as bench

    assert bench.peaks_around([80.0, 90.0, 70.0, 70.0]) == [85.0, 80.0, 70.0]
    assert bench.peaks_around([88.0]) == []


def test_train_step_rounds_keep_each_sides_median_round_and_report_every_pair():
    import train_step as bench

    def rec(lib, ms, rss=100.0, foreign=0.01):
        return {"lib": lib, "model": "simplecnn", "batch": 32, "threads": 2, "step_ms": ms, "peak_rss_mb": rss,
                "import_rss_mb": 40.0, "foreign_cores": foreign, "times_ms": [ms, ms + 1]}

    ours = bench.median_round([rec("pydtnn", 30.0, 110), rec("pydtnn", 10.0, 120), rec("pydtnn", 20.0, 130)])
    assert ours["step_ms"] == 20.0 and ours["peak_rss_mb"] == 130 and ours["rounds_ms"] == [30.0, 10.0, 20.0]
    torch = bench.median_round([rec("torch", 40.0), rec("torch", 25.0), rec("torch", 50.0)])
    assert torch["step_ms"] == 40.0 and bench.median_round([rec("torch", 9.0), rec("torch", 7.0)])["step_ms"] == 7.0
    run = {"machine": {"cpu": "cpu", "cpus": 2, "python": "3", "numpy": "2", "blas": "blas", "torch": "2"},
           "pydtnn": {"commit": "abc1234", "dirty": False, "path": "/x"}, "wall_s": 1.0,
           "args": {"models": "simplecnn", "warmup": 1, "steps": 2}, "records": [ours, torch]}
    text = bench.report(run)
    row = next(line for line in text.splitlines() if line.startswith("| simplecnn"))
    assert "| 20.0 | 40.0 | 0.50 |" in row and row.endswith("| 0.75, 0.40, 0.40 |"), row
    assert "ours/torch per round" in text and "alternating" in text
    single = dict(run, records=[bench.median_round([rec("pydtnn", 10.0)]), bench.median_round([rec("torch", 20.0)])])
    assert "per round" not in bench.report(single)


def test_parallelism_benchmark_tables_and_redraws_a_saved_run_without_mpi(tmp_path, capsys):
    """benchmarks/parallelism.py: the datasets it writes, the commands it launches, the communication it reads
    from a trace's measurement, and the table and plot of a saved run (--from_json), on made-up numbers."""
    import dataclasses
    import json

    import parallelism as bench

    from pydtnn import data

    for shape, name in (((3, 32, 32), "cifar10"), ((1, 28, 28), "mnist")):
        flags = bench.write_dataset(str(tmp_path / name), shape, 10, train_samples=21, test_samples=3)
        assert flags == ["--dataset", name, "--dataset_train_path", str(tmp_path / name)]
        train, test = data.load(name, flags[3])
        assert (len(train), len(test), tuple(train.input_shape)) == (21, 3, shape)
    with pytest.raises(ValueError, match=r"\(3, 64, 64\)"):
        bench.write_dataset(str(tmp_path / "x"), (3, 64, 64), 10, 4)

    hybrid = bench.Config("resnet20_cifar10", 128, 4, "hybrid", "1gbit")
    argv = bench.command(hybrid, "t.json", 2, 5, ["--dataset", "cifar10"], python="py")
    assert argv[:5] == ["py", bench.validation.NETEM, "--rate", "1gbit", "--"] and argv[6:8] == ["-n", "4"]
    assert argv[argv.index("--parallel") + 1] == "hybrid" and argv[argv.index("--model_parallel_size") + 1] == "2"
    assert argv[argv.index("--global_batch_size") + 1] == "128" and argv[argv.index("--steps_per_epoch") + 1] == "7"
    assert argv[argv.index("--dataset") + 1] == "cifar10"
    assert "--model_parallel_size" not in bench.command(bench.Config("simplecnn", 32, 2, "model"), "t", 1, 1, [])
    assert (hybrid.group, hybrid.replica_batch) == (2, 64)
    assert bench.Config("simplecnn", 32, 2, "model").replica_batch == 32
    assert bench.Config("simplecnn", 32, 4, "data").replica_batch == 8
    split = bench.Config("resnet20_cifar10", 128, 4, "pipeline_model", "unlimited", 4, "1f1b")  # 2 stages of 2
    argv = bench.command(split, "t.json", 2, 5, [], python="py")
    assert argv[argv.index("--parallel") + 1] == "hybrid" and argv[argv.index("--pipeline_stages") + 1] == "2"
    assert argv[argv.index("--model_parallel_size") + 1] == "2" and argv[argv.index("--micro_batches") + 1] == "4"
    assert (split.stages, split.replica_batch, split.name) == (2, 128, "pipeline 2 of model 2 x M4 1f1b")
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel import machine
    from pydtnn.perfmodel.predict import predict

    net = models.create("resnet20_cifar10", backend=CPUBackend(seed=0))
    want = predict(net, 128, 4, machine.DEFAULT, reduction="bucketed", algorithm="best", optimizer="sgd_momentum",
                   parallel="hybrid", pipeline_stages=2, model_parallel_size=2, micro_batches=4)
    assert bench.predicted(split, net, machine.DEFAULT)["step_s"] == want.step_s and want.bubble_s > 0

    measured = {"layers": {"3": {"forward_s": 1.0, "backward_s": 2.0}, "3:allgather": {"forward_s": 0.25},
                           "block.1:sum_dx": {"forward_s": 0.0, "backward_s": 0.5}},
                "phases_s": {"forward": 4.0, "wait": 0.125, "blocking": 0.0625}}
    assert bench.communication(measured) == (0.75, 0.1875)

    def point(np_, layout, step_s, mp=0.0, wait=0.0, predicted=None, network="unlimited"):
        config = bench.Config("simplecnn", 32, np_, layout, network)
        return {"label": config.label, "config": dataclasses.asdict(config), "predicted": predicted,
                "measured": {"step_s": step_s, "mp_comm_s": mp, "reduce_wait_s": wait, "foreign_cores": 0.05}}

    points = [point(2, "data", 0.020, wait=0.002, predicted={"step_s": 0.018}), point(2, "model", 0.040, mp=0.015),
              point(4, "hybrid", 0.010, mp=0.003, wait=0.001, network="1gbit")]
    rows = [line for line in bench.table(points).splitlines() if line.startswith("| simplecnn")]
    assert rows[0] == "| simplecnn | 32 | unlimited | 2 | data | 16 | 20.0 | 1600.0 | 1.00 |  | 2.00 | 18.0 | 0.05 |"
    assert rows[1] == "| simplecnn | 32 | unlimited | 2 | model | 32 | 40.0 | 800.0 | 0.50 | 15.0 |  |  | 0.05 |"
    # no data point at np 4 on 1 Gbit/s: no ratio; no prediction for hybrid
    assert rows[2] == "| simplecnn | 32 | 1gbit | 4 | hybrid 2x2 | 16 | 10.0 | 3200.0 |  | 3.00 | 1.00 |  | 0.05 |"

    run = {"host": "AMD EPYC, 2 cores", "commit": "abc1234", "wall_s": 12.0, "points": points, "links": {},
           "settings": {"warmup": 2, "steps": 5}}
    saved, png, again = tmp_path / "run.json", tmp_path / "run.png", tmp_path / "again.json"
    saved.write_text(json.dumps(run))
    assert bench.main(["--from_json", str(saved), "--plot", str(png), "--keep_predictions"]) == 0
    out = capsys.readouterr().out
    assert "3 configurations, 2 warm-up + 5 timed steps" in out and rows[1] in out
    assert "0 of 3 runs had other processes using more than 0.25 cores" in out
    assert png.stat().st_size > 10_000
    # predicted again: every layout on shared memory; none on 1 Gbit/s, whose link the run did not probe
    assert bench.main(["--from_json", str(saved), "--out", str(again)]) == 0
    capsys.readouterr()
    redone = json.loads(again.read_text())["points"]
    assert [p["measured"] for p in redone] == [p["measured"] for p in points]
    assert redone[0]["predicted"]["step_s"] > 0 and redone[1]["predicted"]["group_comm_s"] > 0
    assert redone[0]["predicted"]["group_comm_s"] == 0 and redone[2]["predicted"] is None


def test_conv_algorithms_times_every_candidate_and_writes_the_table(tmp_path, capsys):
    """benchmarks/conv_algorithms.py: one row per shape with the direct, Winograd and GEMM times and the pick."""
    import conv_algorithms

    out = tmp_path / "t.md"
    conv_algorithms.main(["--shapes", "8x8,4x5", "--batch", "2", "--rounds", "1", "--out", str(out)])
    rows = [r for r in out.read_text().splitlines() if r.startswith("| 8 ->") or r.startswith("| 4 ->")]
    assert len(rows) == 2 and all(r.count(" ms") == 3 for r in rows), rows
    assert rows[0].split("|")[-2].strip() in ("direct", "winograd", "gemm")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        conv_algorithms.main(["--shapes", "8by8"])
    assert stop.value.code == 2
    assert "error: --shapes '8by8': expected C x H pairs such as 64x32,128x16" in capsys.readouterr().err


@pytest.mark.slow
def test_ab_step_compares_two_checkouts_step_for_step(tmp_path, capsys):
    """benchmarks/ab_step.py runs train_step.py's worker on both checkouts (here this one twice) and tables the
    per-round ratios."""
    import ab_step

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ab_step.main(["--baseline", root, "--models", "simplecnn", "--batches", "4", "--threads", "1", "--rounds", "1",
                  "--warmup", "1", "--steps", "2", "--wait_idle", "0", "--json", str(tmp_path / "ab.json")])
    out = capsys.readouterr().out
    assert "| simplecnn | 4 | 1 |" in out and "Median ratio over configurations" in out
    assert (tmp_path / "ab.json").exists()


def test_planner_benchmark_runs_two_node_cases_in_two_namespaces_on_a_node_aware_machine(tmp_path, capsys):
    """benchmarks/planner.py: a "RATE-2nodes" network launches the run under netem.py's two-node mode with np/2
    ranks a node, and plans on half the cores a node, the probed link between the nodes and a node-aware MPI;
    a saved run's table keeps each case's regret and rank correlation (--from_json)."""
    import json

    import planner as bench

    from pydtnn.perfmodel import machine as machines

    assert bench.rate_and_nodes("1gbit-2nodes") == ("1gbit", 2) and bench.rate_and_nodes("200mbit") == ("200mbit", 1)
    case = {"model": "resnet20_cifar10", "np": 4, "network": "1gbit-2nodes"}
    cmd = bench.command(case, ("--parallel", "data"), ("--model", "resnet20_cifar10"), [], "t.json", 1, 2)
    assert cmd[cmd.index("--rate") + 1] == "1gbit" and cmd[cmd.index("--nodes") + 1] == "2"
    assert cmd[cmd.index("--procs-per-node") + 1] == "2" and cmd[cmd.index("-n") + 1] == "4"
    one = bench.command({**case, "network": "1gbit"}, (), (), [], "t.json", 1, 2)
    assert "--nodes" not in one and one[one.index("--rate") + 1] == "1gbit"
    base = machines.load(os.path.join(os.path.dirname(bench.HERE), "docs", "machine_vm.yaml"))
    link = {"bandwidth_bytes_per_s": 1.25e8, "latency_s": 3e-5}
    m = bench.machine_for(base, case, link)
    assert (m.processes_per_node, m.cores, m.node_aware_collectives) == (2, 1, True)
    assert m.link("inter") == machines.Link(3e-5, 1.25e8, background=True) and m.link("intra") == base.link("intra")
    flat = bench.machine_for(base, {**case, "network": "1gbit"}, link)
    assert (flat.processes_per_node, flat.node_aware_collectives) == (4, False)
    runs = [{"flags": ["--parallel", "data"], "predicted_s": 0.30, "measured_s": 0.33, "rounds_s": [0.33, 0.363]},
            {"flags": ["--parallel", "model"], "predicted_s": 0.40, "measured_s": 0.30, "rounds_s": [0.36, 0.30]},
            {"flags": ["--parallel", "pipeline"], "predicted_s": 0.50, "measured_s": 0.60, "rounds_s": [0.6, 0.6]}]
    saved = {"host": "test host", "commit": "abc", "wall_s": 1.0,
             "cases": [bench.summarize({**case, "runs": runs})]}
    assert saved["cases"][0]["regret"] == pytest.approx(1.1) and saved["cases"][0]["best"] == ["--parallel", "model"]
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    assert bench.main(["--from_json", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert ("| resnet20_cifar10 | 1gbit-2nodes | 4 | `--parallel data` | 300 | 330 | `--parallel model` | 300 | 1.100 "
            "| +0.50 | 10% |") in out  # rounds apart: the median of 10%, 20% and 0%
    assert (tmp_path / "p.png").stat().st_size > 1000
