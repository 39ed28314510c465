"""benchmarks/perfmodel_validation.py: the trace reading, the error figures and the report, on made-up numbers;
and one --quick run end to end (slow)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import perfmodel_validation as pv

from pydtnn.perfmodel import machine


def span(name, cat, ts, dur, tid=0):
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur}


def rank_trace(step_us, conv_us):
    """Steps of step_us[i] microseconds each; in each, a layer "c" forward of conv_us[i] and backward of twice it."""
    events, t = [{"name": "process_name", "ph": "M", "pid": 0}], 0.0
    for s, c in zip(step_us, conv_us):
        events += [span("c", "forward", t + 1, c), span("c", "backward", t + 2 + c, 2 * c),
                   span("forward", "forward", t + 0.5, c + 1, tid=1), span("wait x", "wait", t + 3 + 3 * c, 1, tid=1),
                   span("allreduce x", "allreduce", t + 3 + 3 * c, 1, tid=2), span(f"s{t}", "step", t, s)]
        t += s + 10
    return events


def test_rank_timings_leave_out_the_warm_up_and_sum_per_step():
    steps, layers, phases = pv.rank_timings(rank_trace([900, 100, 120], [500, 10, 20]), warmup=1)
    assert steps == pytest.approx([100e-6, 120e-6])
    assert layers[("c", "forward")] == pytest.approx([10e-6, 20e-6])
    assert layers[("c", "backward")] == pytest.approx([20e-6, 40e-6])
    assert phases["wait"] == pytest.approx([1e-6, 1e-6]) and "allreduce" not in phases
    with pytest.raises(ValueError, match="3 steps"):
        pv.rank_timings(rank_trace([1, 1, 1], [0.1] * 3), warmup=3)


def test_combine_ranks_takes_the_slowest_rank_per_step_and_averages_layers():
    a = pv.rank_timings(rank_trace([0, 100, 300, 100], [0, 10, 10, 10]), warmup=1)
    b = pv.rank_timings(rank_trace([0, 200, 100, 100], [0, 30, 30, 30]), warmup=1)
    m = pv.combine_ranks([a, b])
    assert m["steps_s"] == pytest.approx([200e-6, 300e-6, 100e-6])
    assert m["step_s"] == pytest.approx(200e-6)
    assert m["layers"]["c"]["forward_s"] == pytest.approx(20e-6)  # mean of the ranks' medians 10 and 30


def point(label, pred_ms, meas_ms, network="unlimited", layers=()):
    """A made-up point; layers: (name, kind, predicted ms, measured ms), all forward."""
    model, np_ = label.split()[0], 2 if network != "unlimited" else 1
    return {"label": label, "config": {"model": model, "batch": 16, "threads": 1, "np": np_,
                                       "reduction": "blocking" if np_ > 1 else None, "network": network},
            "predicted": {"step_s": pred_ms / 1e3, "exposed_comm_s": 0.0, "compute_s": 0.0, "memory_s": 0.0,
                          "update_s": 0.0, "comm_s": 0.0, "messages": 0,
                          "layers": {n: {"kind": k, "forward_s": p / 1e3, "backward_s": 0.0} for n, k, p, _ in layers}},
            "measured": {"step_s": meas_ms / 1e3, "foreign_cores": 0.0,
                         "layers": {n: {"forward_s": m / 1e3} for n, _, _, m in layers}},
            "error_pct": pv.error_pct(pred_ms, meas_ms)}


def test_summary_gives_the_median_the_worst_and_the_layer_errors():
    layers = [("a", "Conv2D", 44.0, 40.0), ("b", "ReLU", 0.5, 1.0), ("tiny", "Flatten", 0.0, 0.1)]
    points = [point("m1 x", 110, 100, layers=layers), point("m1 y", 80, 100, "1gbit"), point("m2 z", 95, 100),
              point("m2 w", 300, 200, "200mbit")]
    s = pv.summarize(points)
    assert s["configurations"] == 4
    assert s["median_abs_step_error_pct"] == pytest.approx(15.0)  # |10|, |-20|, |-5|, |50|
    assert s["worst_step_error_pct"] == pytest.approx(50.0) and s["worst_config"] == "m2 w"
    assert s["within_25pct"] == 3 and s["within_10pct"] == 2
    # "tiny" is 0.1% of its 100 ms step: only a (+10%) and b (-50%) count
    assert s["layer_points"] == 2 and s["median_abs_layer_error_pct"] == pytest.approx(30.0)
    assert s["layer_points_all"] == 3 and s["by_kind"]["Conv2D"]["median_pct"] == pytest.approx(10.0)
    assert s["met"] == {"median_step": False, "worst_step": False, "median_layer": False}
    assert s["by_network"]["1gbit"]["median_pct"] == pytest.approx(-20.0)


def test_emulated_link_is_shared_by_every_rank():
    link = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 125e6}
    m = pv.machine_for(machine.DEFAULT, 4, link)
    assert m.processes_per_node == 4
    assert m.links["intra"].bandwidth_bytes_per_s == pytest.approx(125e6 / 4)
    assert m.links["intra"].latency_s == 1e-5
    assert pv.machine_for(machine.DEFAULT, 2).links == machine.DEFAULT.links


def test_report_and_plot_from_a_saved_run(tmp_path):
    run = {"machine_file": "m.yaml", "machine": machine.to_dict(machine.DEFAULT), "host": "h", "commit": "c",
           "wall_s": 1.0, "links": {}, "points": [point("m1 x", 110, 100, layers=[("a", "Conv2D", 4.0, 5.0)]),
                                                   point("m2 y", 90, 100, "1gbit")]}
    run["summary"] = pv.summarize(run["points"])
    text = pv.report(run)
    assert "| m1 | 16 | 1 | 1 | - | - | - | 110.0 | - | 100.0 | +10.0 |" in text
    assert "| median absolute step error <= 10% | 10.0% | met |" in text
    pv.plot(run, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").stat().st_size > 10_000


def test_from_json_predicts_again_and_keeps_the_measurements(tmp_path):
    """A saved simplecnn point predicted again on a machine with a 1 ms fixed cost per step: the predicted step
    grows by exactly 1 ms, the measurement stays, and the error is recomputed from the two."""
    config = pv.Config("simplecnn", 16, 1, 2, "blocking", "1gbit")
    measured = {"step_s": 0.04, "layers": {"0": {"forward_s": 1e-4, "backward_s": 2e-4}}}
    link = {"rate": "1gbit", "bandwidth_bytes_per_s": 1.25e8, "latency_s": 1e-5,
            "allreduce": [{"np": 2, "bytes": 1 << 20, "seconds": 0.017, "predicted_s": 0.0}]}
    run = {"machine_file": "old.yaml", "machine": machine.to_dict(machine.DEFAULT), "host": "h", "commit": "c",
           "wall_s": 1.0, "links": {"1gbit": link},
           "points": [{"label": config.label, "config": dict(config.__dict__), "measured": measured,
                       "predicted": {"step_s": 1.0}, "error_pct": 0.0}]}
    bare = pv.repredict(json.loads(json.dumps(run)), machine.DEFAULT, "m.yaml")
    slower = dataclasses.replace(machine.DEFAULT, overheads=machine.Overheads(step_s=1e-3))
    again = pv.repredict(json.loads(json.dumps(run)), slower, "m.yaml")
    (b,), (a,) = bare["points"], again["points"]
    assert a["predicted"]["step_s"] == pytest.approx(b["predicted"]["step_s"] + 1e-3, rel=1e-12)
    assert a["measured"] == measured and b["predicted"]["step_s"] != 1.0
    assert a["error_pct"] == pytest.approx(100 * (a["predicted"]["step_s"] - 0.04) / 0.04)
    assert again["summary"]["configurations"] == 1 and again["machine"]["overheads"]["step_s"] == 1e-3
    # the emulated link's 1 MiB allreduce is predicted again from its latency and rate, each of the 2 ranks
    # getting half the rate: ring (= Rabenseifner at 2), 2 alpha + n beta + n gamma / 2, the cheapest
    n, beta = 1 << 20, 2 / 1.25e8
    by_hand = 2 * 1e-5 + n * beta + n / 2 / machine.DEFAULT.reduce_rate
    assert again["links"]["1gbit"]["allreduce"][0]["predicted_s"] == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.slow
def test_quick_run_measures_three_configurations(tmp_path):
    out = str(tmp_path / "v")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "..", "benchmarks", "perfmodel_validation.py"), "--quick",
                           "--out", out, "--wait_idle", "0"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out + ".json") as f:
        run = json.load(f)
    assert len(run["points"]) == 3
    for p in run["points"]:
        measured, predicted = p["measured"]["step_s"], p["predicted"]["step_s"]
        # the saved error is the relative error of the saved times, each kept to 5 significant digits (up to
        # 5e-5 of its value) in the file
        assert measured > 0 and 1 + p["error_pct"] / 100 == pytest.approx(predicted / measured, rel=5e-4)
        assert p["measured"]["layers"]  # the trainer's per-layer spans were read
    assert os.path.getsize(out + ".png") > 10_000
    assert "| target | reached |" in proc.stdout


def test_model_and_hybrid_configurations_run_and_predict_as_the_trainer_does():
    hybrid = pv.Config("resnet20_cifar10", 32, 1, 4, "bucketed", parallel="hybrid", model_parallel_size=2)
    argv = pv.command(hybrid, "t.json", 2, 3)
    assert argv[argv.index("--parallel") + 1] == "hybrid" and argv[argv.index("--model_parallel_size") + 1] == "2"
    assert hybrid.label == "resnet20_cifar10 b32 t1 np4 hybrid2 bucketed unlimited"
    split = [c for c in pv.full_configs() if c.parallel != "data"]
    assert {c.parallel for c in split} == {"model", "hybrid"} and {c.network for c in split} == set(pv.NETWORKS)
    assert "--parallel" not in pv.command(pv.Config("simplecnn", 16, 1, 2, "bucketed"), "t.json", 2, 3)


def test_merge_replaces_points_of_the_same_configuration_and_keeps_the_rest(tmp_path):
    def point(config, measured_s):
        return pv.make_point(config, {"step_s": 1.0, "layers": {}}, {"step_s": measured_s, "layers": {}})

    data, model = pv.Config("simplecnn", 64, 1, 2, "bucketed"), pv.Config("simplecnn", 64, 1, 2, "bucketed",
                                                                           parallel="model")
    old = {"points": [point(data, 1.0), point(model, 4.0)], "links": {"1gbit": {"rate": "1gbit"}}, "wall_s": 10.0,
           "machine_file": "a", "machine": {}, "host": "h", "commit": "c", "netem": "used"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    new = {"points": [point(model, 2.0)], "links": {}, "wall_s": 5.0, "machine_file": "b", "machine": {},
           "host": "h", "commit": "d", "netem": "used"}
    run = pv.merged(new, str(tmp_path / "old.json"))
    assert [p["measured"]["step_s"] for p in run["points"]] == [1.0, 2.0]  # full_configs() order, the new one
    assert run["commit"] == "d" and run["wall_s"] == 15.0 and "1gbit" in run["links"]
    assert run["summary"]["by_parallel"]["model"]["n"] == 1
