"""Layer profiles (pydtnn/perfmodel/layer_profile.py): measured layer times, their interpolation in the batch,
their file and a machine file that names one, and predict() taking them in place of the roofline."""

import dataclasses
import json

import pytest

from pydtnn.errors import ConfigError
from pydtnn.perfmodel import layer_profile, layer_timing, machine
from pydtnn.perfmodel.cli import main
from pydtnn.perfmodel.costs import layer_costs
from pydtnn.perfmodel.predict import predict
from pydtnn.perfmodel.simulate import build_model

MODEL = "simplecnn"


@pytest.fixture(scope="module")
def profile():
    return layer_timing.measure([MODEL], batches=(2, 8), threads=(1,), steps=2, warmup=1)


def test_interpolation_is_linear_between_and_beyond_the_measured_batches():
    by_batch = {8: (1.0, 2.0), 32: (3.0, 7.0)}
    assert layer_profile.interpolate(by_batch, 8) == (1.0, 2.0)
    assert layer_profile.interpolate(by_batch, 16) == pytest.approx((1.0 + 2 / 3, 2.0 + 5 / 3))
    assert layer_profile.interpolate(by_batch, 64) == pytest.approx((3 + 32 / 12, 7 + 32 * 5 / 24))  # their line
    assert layer_profile.interpolate(by_batch, 2) == pytest.approx((1 - 6 / 12, 2 - 6 * 5 / 24))
    steep = {8: (1.0, 2.0), 32: (9.0, 2.5)}  # the line goes below zero at batch 1: half of 1/8 of batch 8's
    assert layer_profile.interpolate(steep, 1) == pytest.approx((1.0 / 16, 2.0 - 7 * 0.5 / 24))
    assert layer_profile.interpolate({4: (1.0, 3.0)}, 8) == (2.0, 6.0)  # one batch: scaled


def test_every_leaf_layer_is_measured_and_the_file_round_trips(profile, tmp_path):
    _, model = build_model(MODEL)
    leaves = {c.signature for c in layer_costs(model, 2) if not c.kind.endswith("Block")}
    assert set(profile.layers) == leaves
    assert all(sorted(profile.layers[s][1]) == [2, 8] for s in leaves)
    assert all(f > 0 and b > 0 for s in leaves for f, b in profile.layers[s][1].values())
    path = tmp_path / "layers.json"
    layer_profile.save(profile, path)
    again = layer_profile.load(path)
    assert again.layers == profile.layers and again.path == str(path)
    assert again.about["models"] == [MODEL] and again.about["steps"] == 2


def test_predict_takes_the_measured_times(profile):
    """Each layer's forward and backward are the profile's (interpolated at batch 4), and the step's parts add
    up to them; 4 processes on the built-in machine's 2 cores double them (crowding)."""
    _, model = build_model(MODEL)
    base = dataclasses.replace(machine.DEFAULT, processes_per_node=4)  # every process on one node
    m = dataclasses.replace(base, layer_profile=profile)
    costs = layer_costs(model, 4)
    for np_, crowding in ((1, 1.0), (4, 4 / base.cores)):
        p = predict(model, 4, np_, m)
        plain = predict(model, 4, np_, base)
        for c, lt in zip(costs, p.layers):
            want = profile.seconds(c, 1)
            assert want is not None
            assert lt.forward_s == pytest.approx(want[0] * crowding)
            assert lt.backward_data_s + lt.backward_weights_s == pytest.approx(want[1] * crowding)
        measured = sum(lt.forward_s + lt.backward_data_s + lt.backward_weights_s for lt in p.layers)
        rest = plain.step_s - sum(lt.forward_s + lt.backward_data_s + lt.backward_weights_s for lt in plain.layers)
        assert p.step_s == pytest.approx(measured + rest)
    assert predict(model, 4, 1, m, threads=2).layers == predict(model, 4, 1, machine.DEFAULT, threads=2).layers


def test_a_machine_file_names_its_profile_relative_to_itself(profile, tmp_path):
    (tmp_path / "sub").mkdir()
    layer_profile.save(profile, tmp_path / "sub" / "layers.json")
    data = machine.to_dict(machine.DEFAULT)
    data["layer_profile"] = "layers.json"
    (tmp_path / "sub" / "m.json").write_text(json.dumps(data))
    m = machine.load(tmp_path / "sub" / "m.json")
    assert m.layer_profile.layers == profile.layers
    assert machine.to_dict(m)["layer_profile"] == str(tmp_path / "sub" / "layers.json")
    assert "layer_profile" not in machine.to_dict(machine.DEFAULT)
    data["layer_profile"] = "missing.json"
    (tmp_path / "sub" / "m.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="missing.json does not exist"):
        machine.load(tmp_path / "sub" / "m.json")


@pytest.mark.parametrize("text, says", [
    ('{"format": "other"}', "is not a pydtnn layer profile"),
    ('{"format": "pydtnn-layer-profile", "version": 1, "layers": {"x": {"1": {"4": [1.0]}}}}', "a bad entry"),
    ('{"format": "pydtnn-layer-profile", "version": 1, "layers": {"x": {"1": {"0": [1.0, 2.0]}}}}', "below 1"),
    ("[1, 2", "is not JSON"),
    ('{"format": "pydtnn-layer-profile", "version": 1, "layers": {}, "about": [1]}', "expected a mapping"),
    ('{"format": "pydtnn-layer-profile", "version": 1, "layers": {"x": {"1": {"4": [1.0, Infinity]}}}}', "a bad entry"),
])
def test_a_bad_profile_is_one_error(tmp_path, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        layer_profile.load(path)


@pytest.mark.parametrize("argv, says", [
    (["--model", "no_such_model"], "no_such_model"),
    (["--model", MODEL, "--batch_sizes", "0,4"], "expected a comma list of positive integers"),
])
def test_profile_refuses_in_one_line(tmp_path, capsys, argv, says):
    out = tmp_path / "p.json"
    assert main(["profile", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and not out.exists()


def test_profile_checks_its_output_and_its_cpu_before_measuring(tmp_path, capsys, monkeypatch):
    from pydtnn.perfmodel import layer_timing

    monkeypatch.setattr(layer_timing, "measure", lambda *a, **k: pytest.fail("measured before refusing"))
    assert main(["profile", "--model", MODEL, "--out", str(tmp_path / "no" / "p.json")]) == 2
    assert "no" in capsys.readouterr().err.strip().splitlines()[-1]
    other = tmp_path / "other.json"
    layer_profile.save(layer_profile.LayerProfile({}, {"cpu": "another CPU"}), other)
    assert main(["profile", "--model", MODEL, "--out", str(other), "--merge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was measured on 'another CPU'" in err[0]


def test_measuring_leaves_the_thread_count_as_it_was():
    from pydtnn import runtime

    runtime.configure(threads=1)
    layer_timing.measure([MODEL], batches=(2,), threads=(2,), steps=1, warmup=0)
    assert runtime.configured()["threads"] == 1


def test_profile_writes_and_merges(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", MODEL, "--batch_sizes", "2", "--steps", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    assert main(["profile", "--model", MODEL, "--batch_sizes", "4", "--steps", "1", "--warmup", "0",
                 "--out", str(out), "--merge"]) == 0
    got = layer_profile.load(out)
    assert all(sorted(by_t[1]) == [2, 4] for by_t in got.layers.values())
    assert "distinct layers of simplecnn" in capsys.readouterr().err


def test_split_layers_take_the_ratio_of_their_kind_in_the_whole_model():
    """Model parallelism holds split layers the profile lacks: each is scaled by the ratio of measured to roofline
    time that the whole model's profiled layers of its kind and algorithm show (here 2x, by construction)."""
    from pydtnn.perfmodel.step_parts import phase_seconds, profile_scales

    _, model = build_model(MODEL)
    base = dataclasses.replace(machine.DEFAULT, processes_per_node=2)
    layers = {}
    for c in layer_costs(model, 4):
        call_f, call_b = base.overheads.call_s(c.kind)
        f, bd, bw = (phase_seconds(ph, c.kernel_class, base)[0]
                     for ph in (c.forward, c.backward_data, c.backward_weights))
        layers[c.signature] = {1: {4: (2 * (call_f + f), 2 * (call_b + bd + bw))}}
    m = dataclasses.replace(base, layer_profile=layer_profile.LayerProfile(layers))
    scales = profile_scales(model, 4, m, 1)
    assert scales and all(v == pytest.approx((2.0, 2.0)) for v in scales.values())
    split, plain = predict(model, 4, 2, m, parallel="model"), predict(model, 4, 2, base, parallel="model")
    scaled = [(a, b) for a, b in zip(split.layers, plain.layers) if (a.kind, a.algorithm) in scales]
    assert scaled
    for a, b in scaled:
        assert a.forward_s == pytest.approx(2 * b.forward_s)
        assert a.backward_data_s + a.backward_weights_s == pytest.approx(2 * (b.backward_data_s + b.backward_weights_s))
