"""`pydtnn-perfmodel sweep`: the five axes around a baseline, as PNGs and JSON."""

import itertools
import json
import subprocess
import sys

import pytest

from pydtnn.perfmodel import machine as machines
from pydtnn.perfmodel.cli import main
from pydtnn.perfmodel.predict import predict
from pydtnn.perfmodel.simulate import build_model
from pydtnn.perfmodel.sweep import AXES, Baseline, axis_values, crossovers

PNG = b"\x89PNG\r\n\x1a\n"
MODEL, NODES, BATCH = "simplecnn", 4, 8


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 3-point sweep of every axis of a small model: (the JSON it wrote, the folder of its PNG)."""
    out = tmp_path_factory.mktemp("sweep")
    code = main(["sweep", "--model", MODEL, "--points", "3", "--nodes", str(NODES), "--batch_size", str(BATCH),
                 "--out_dir", str(out), "--json", str(out / "sweep.json")])
    assert code == 0
    with open(out / "sweep.json") as f:
        return json.load(f), out


def line(data, axis, scheme="data"):
    return sorted((p for p in data["points"] if (p["axis"], p["scheme"]) == (axis, scheme)), key=lambda p: p["value"])


def test_writes_a_png_and_every_point_as_json(swept):
    data, out = swept
    with open(out / f"perfmodel_{MODEL}.png", "rb") as f:
        assert f.read(8) == PNG
    assert {p["axis"] for p in data["points"]} == set(AXES)
    assert all(len(line(data, a, s)) == 3 for a in AXES for s in ("data", "hybrid", "pipeline"))
    assert data["baseline"] == {"nodes": NODES, "batch_size": BATCH}
    assert data["schemes"] == ["data", "model", "hybrid", "pipeline"] and data["pipeline_micro_batches"] == 8
    # simplecnn's classifier has 10 outputs: model parallelism over the 16 processes of 8 nodes cannot run
    assert [p["nodes"] for p in line(data, "nodes", "model")] == [1, 4]
    for p in data["points"]:
        assert p["model"] == MODEL and p["processes"] == 2 * p["nodes"]
        assert p["throughput"] == pytest.approx(p["batch_size"] * p["processes"] / p["step_s"])
        assert 0 <= p["exposed_share"] <= 1


def test_throughput_rises_with_the_node_rate_and_the_link(swept):
    data, _ = swept
    for axis in ("rate", "link"):
        ys = [p["throughput"] for p in line(data, axis)]
        assert ys[-1] > ys[0], axis
        assert all(b >= a for a, b in itertools.pairwise(ys)), f"{axis}: {ys}"


def test_the_pipeline_scheme_is_a_pipeline_per_node_on_the_same_global_batch(swept):
    """2 processes a node: a pipeline of 2 stages per node, 8 micro-batches of the node's 2 x BATCH samples, data
    parallel across the nodes; its baseline point is that plan's direct prediction."""
    data, _ = swept
    _, model = build_model(MODEL)
    np_ = NODES * machines.DEFAULT.processes_per_node
    direct = predict(model, 2 * BATCH, np_, machines.DEFAULT, parallel="hybrid", pipeline_stages=2, micro_batches=8)
    (point,) = [p for p in line(data, "nodes", "pipeline") if p["value"] == NODES]
    assert point["step_s"] == direct.step_s and direct.global_batch == BATCH * np_


def test_the_baseline_of_every_axis_is_a_direct_prediction(swept):
    data, _ = swept
    _, model = build_model(MODEL)
    direct = predict(model, BATCH, NODES * machines.DEFAULT.processes_per_node, machines.DEFAULT, reduction="bucketed")
    base = Baseline(NODES, BATCH)
    for axis, value in (("batch", BATCH), ("rate", 1.0), ("bandwidth", 1.0),
                        ("link", machines.DEFAULT.link("inter").bandwidth_bytes_per_s), ("nodes", NODES)):
        assert value in axis_values(axis, machines.DEFAULT, base, points=3)
        (point,) = [p for p in line(data, axis) if p["value"] == value]
        for key in ("step_s", "compute_s", "memory_s", "comm_s", "exposed_comm_s"):
            assert point[key] == getattr(direct, key), (axis, key)


def test_every_scheme_trains_the_same_global_batch_on_the_same_processes(swept):
    """At the baseline, model parallelism is one replica with batch x processes samples and hybrid one per node
    with batch x processes_per_node: predict() with those arguments gives the points' step times."""
    data, _ = swept
    (_, model), m = build_model(MODEL), machines.DEFAULT
    np_ = NODES * m.processes_per_node
    model_step = predict(model, BATCH * np_, np_, m, parallel="model").step_s
    hybrid_step = predict(model, BATCH * 2, np_, m, parallel="hybrid", model_parallel_size=2).step_s
    for scheme, step in (("model", model_step), ("hybrid", hybrid_step)):
        (point,) = [p for p in line(data, "nodes", scheme) if p["value"] == NODES]
        assert point["step_s"] == step and point["throughput"] == pytest.approx(BATCH * np_ / step)


def test_scheme_crossings_are_read_on_the_throughput_ratio():
    from pydtnn.perfmodel.sweep import Point, scheme_crossings

    def point(scheme, value, step):
        return Point("m", scheme, "nodes", value, value, 2 * value, 8, 1.0, 1.0, 1e9, step, step, 0, 0, 0)

    points = [point("data", 1, 1.0), point("data", 4, 1.0), point("data", 16, 1.0),
              point("model", 1, 0.5), point("model", 4, 2.0)]  # 2x faster, then 2x slower: equal at 2 nodes
    found, ratios, missing = scheme_crossings(points, "model")["nodes"]
    assert found == [pytest.approx(2.0)] and ratios == [(1, 2.0), (4, 0.5)] and missing == [16]


def test_crossover_is_read_between_the_points_that_straddle_the_share():
    from pydtnn.perfmodel.sweep import Point

    def point(value, exposed):
        return Point("m", "data", "nodes", value, value, 2 * value, 8, 1.0, 1.0, 1e9, 1.0, 0.5, 0.1, exposed, exposed)

    found = crossovers([point(1, 0.2), point(4, 0.3), point(16, 0.7)])
    assert found[("data", "nodes")] == [pytest.approx(8.0)]  # 0.5 is halfway from 4 to 16 in log2: 2^3


def test_a_bad_axis_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pydtnn.perfmodel.cli", "sweep", "--model", MODEL, "--axes",
                        "rate,noodes", "--out_dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "noodes" in r.stderr and "nodes" in r.stderr
    assert r.stderr.startswith("pydtnn-perfmodel: error:") and not list(tmp_path.iterdir())


def no_work(monkeypatch):
    """Make building a model or sweeping one fail the test: the checks must come first."""
    from pydtnn.perfmodel import sweep

    monkeypatch.setattr("pydtnn.perfmodel.simulate.build_model", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(sweep, "sweep", lambda *a, **k: pytest.fail("swept"))


def refused(capsys, argv, *words):
    assert main(["sweep", "--model", MODEL, "--points", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pydtnn-perfmodel: error: "), err
    assert all(w in err for w in words), err


def test_outputs_that_are_inputs_or_each_other_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    no_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    machines.save(machines.DEFAULT, "m.yaml")
    before = (tmp_path / "m.yaml").read_bytes()
    refused(capsys, ["--machine", "m.yaml", "--json", "m.yaml"], "--json file m.yaml", "machine file")
    (tmp_path / "link.yaml").symlink_to("m.yaml")
    refused(capsys, ["--machine", "m.yaml", "--json", "link.yaml"], "machine file")
    refused(capsys, ["--json", f"perfmodel_{MODEL}.png"], "each output needs a path of its own")
    refused(capsys, ["--model", f"{MODEL},{MODEL}"], "each output needs a path of its own")
    assert (tmp_path / "m.yaml").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "m.yaml"]


def test_a_device_a_fifo_or_a_missing_folder_as_output_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import os

    no_work(monkeypatch)
    os.mkfifo(tmp_path / "fifo")
    refused(capsys, ["--out_dir", str(tmp_path), "--json", str(tmp_path / "fifo")], "FIFO")
    refused(capsys, ["--out_dir", str(tmp_path), "--json", os.devnull], "character device")
    os.mkfifo(tmp_path / f"perfmodel_{MODEL}.png")
    refused(capsys, ["--out_dir", str(tmp_path), "--overwrite"], "FIFO")
    refused(capsys, ["--out_dir", str(tmp_path / "absent")], "not a writable directory")
    assert not (tmp_path / "absent").exists()


def test_existing_figures_and_json_are_kept_unless_overwrite(tmp_path, capsys, monkeypatch):
    """The default folder is the current one; a PNG or JSON already there is replaced only with --overwrite."""
    monkeypatch.chdir(tmp_path)
    png, out = tmp_path / f"perfmodel_{MODEL}.png", tmp_path / "points.json"
    for path in (png, out):
        path.write_bytes(b"committed")
        with monkeypatch.context() as m:
            no_work(m)
            refused(capsys, ["--json", "points.json"], str(path.name), "already exists", "--overwrite")
        assert path.read_bytes() == b"committed"
        path.unlink()
    assert main(["sweep", "--model", MODEL, "--points", "2", "--axes", "batch", "--json", "points.json"]) == 0
    assert png.read_bytes()[:8] == PNG and json.loads(out.read_text())["points"]
    png.write_bytes(b"committed")
    out.write_bytes(b"committed")
    assert main(["sweep", "--model", MODEL, "--points", "2", "--axes", "batch", "--json", "points.json",
                 "--overwrite"]) == 0
    assert png.read_bytes()[:8] == PNG and json.loads(out.read_text())["points"]


def test_a_family_name_is_swept_as_its_variant_and_says_so(tmp_path, capsys):
    """mobilenetv1 for 3x32x32 images is mobilenetv1_cifar10: the figure and the points carry that name."""
    assert main(["sweep", "--model", "mobilenetv1", "--input_shape", "3,32,32", "--points", "2", "--axes", "batch",
                 "--nodes", "1", "--out_dir", str(tmp_path), "--json", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    said = "pydtnn-perfmodel: mobilenetv1 -> mobilenetv1_cifar10 (--input_shape 3,32,32: 3x32x32 images, 10 classes)"
    assert said in err
    assert (tmp_path / "perfmodel_mobilenetv1_cifar10.png").read_bytes()[:8] == PNG
    points = json.loads((tmp_path / "p.json").read_text())["points"]
    assert {p["model"] for p in points} == {"mobilenetv1_cifar10"}


def test_zero_sweeps_every_scheme_with_the_stage_and_its_refusal_comes_first(tmp_path, capsys, monkeypatch):
    """--zero 2: the data scheme's baseline is predict()'s with ZeRO 2 (not plain data parallelism's), the JSON
    says the stage; --zero 1 with topk is one line before any work."""
    code = main(["sweep", "--model", MODEL, "--points", "2", "--axes", "nodes", "--nodes", str(NODES), "--batch_size",
                 str(BATCH), "--zero", "2", "--out_dir", str(tmp_path), "--json", str(tmp_path / "z.json")])
    assert code == 0
    data = json.loads((tmp_path / "z.json").read_text())
    assert data["zero"] == 2
    _, model = build_model(MODEL)
    np_ = NODES * machines.DEFAULT.processes_per_node
    sharded, plain = (predict(model, BATCH, np_, machines.DEFAULT, reduction="bucketed", zero=z) for z in (2, 0))
    (point,) = [p for p in line(data, "nodes") if p["value"] == NODES]
    assert point["step_s"] == sharded.step_s != plain.step_s
    capsys.readouterr()
    no_work(monkeypatch)
    refused(capsys, ["--zero", "1", "--reduction", "topk", "--out_dir", str(tmp_path / "none")],
            "--zero 1 with --reduction topk")
    refused(capsys, ["--zero", "2", "--progress", "thread", "--out_dir", str(tmp_path / "none")],
            "--zero 2 reduce-scatters the gradients itself", "--reduction_progress thread")


@pytest.mark.parametrize("reduction, option, values", [("powersgd", "rank", (1, 16)), ("local_sgd", "every", (1, 8))])
def test_the_lossy_reducers_options_reach_every_point(reduction, option, values):
    """--rank and --local_sgd move the data scheme's communication as the reducers' own option does in predict."""
    from pydtnn.perfmodel.sweep import scheme_step

    _, model = build_model("vgg11bn_cifar10")
    low, high = (scheme_step(model, "vgg11bn_cifar10", "data", 8, 8, machines.DEFAULT, reduction=reduction,
                             **{option: v}) for v in values)
    assert low.comm_s != high.comm_s
    assert (low.comm_s < high.comm_s) == (reduction == "powersgd")  # a lower rank, or averages less often
