"""Measured convolution algorithms (backends/cpu/autotune.py): which candidates a shape has, the margin
rule, the cache file, training unchanged whatever is picked, and the command line's --conv_autotune."""

import json

import numpy as np
import pytest

from pydtnn.backends.cpu import CPUBackend, autotune, conv_direct, conv_plan, threads
from pydtnn.backends.cpu.tuning import Tuning
from pydtnn.backends.geometry import ConvGeometry
from pydtnn.cli import main, parse_args
from pydtnn.layers import Conv2D, Dense, Flatten, ReLU
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.optim import SGD
from pydtnn.trainer import Trainer

TUNING = Tuning()
CONV3 = ConvGeometry(16, 32, 32, 3, 3, pt=1, pb=1, pl=1, pr=1)  # 3x3 stride 1, one group, 16 -> 16
DEPTHWISE = ConvGeometry(32, 16, 16, 3, 3, pt=1, pb=1, pl=1, pr=1, groups=32)
DEPTHWISE_S2 = ConvGeometry(32, 16, 16, 3, 3, 2, 2, pt=1, pb=1, pl=1, pr=1, groups=32)
POINTWISE = ConvGeometry(32, 16, 16, 1, 1)  # 32 -> 64
CONV5 = ConvGeometry(8, 16, 16, 5, 5, pt=2, pb=2, pl=2, pr=2)


@pytest.mark.parametrize("g,co,numba,numpy", [
    (CONV3, 16, ("direct", "winograd", "gemm"), ("gemm",)),
    (DEPTHWISE, 32, ("direct", "depthwise", "gemm"), ("depthwise", "gemm")),
    (DEPTHWISE_S2, 32, ("direct_stride2", "depthwise", "gemm"), ("depthwise", "gemm")),
    (POINTWISE, 64, ("pointwise", "gemm"), ("pointwise", "gemm")),
])
def test_candidates_are_the_eligible_algorithms_threshold_choice_first(g, co, numba, numpy):
    for kernels, want in (("numba", numba), ("numpy", numpy)):
        found = autotune.candidates(g, co, kernels, TUNING)
        assert found == want, (kernels, found)
        assert found[0] == conv_plan.choose(g, co, kernels, TUNING).algorithm


def test_a_5x5_layer_has_gemm_and_the_direct_kernels_where_they_take_it():
    found = autotune.candidates(CONV5, 8, "numba", TUNING)
    assert set(found) == {"gemm"} | ({"direct"} if conv_direct.direct_ok(CONV5, 8) else set())
    assert autotune.candidates(CONV5, 8, "numpy", TUNING) == ("gemm",)


def test_the_margin_keeps_the_threshold_choice_unless_another_is_clearly_faster():
    assert autotune.pick({"direct": 1.0, "gemm": 0.96}, "direct", 0.05) == "direct"  # 4%: noise
    assert autotune.pick({"direct": 1.0, "gemm": 0.94}, "direct", 0.05) == "gemm"
    assert autotune.pick({"direct": 1.0, "depthwise": 0.5, "gemm": 0.8}, "direct", 0.05) == "depthwise"
    assert autotune.pick({"direct": 0.5, "gemm": 0.8}, "direct", 0.05) == "direct"


class FakeMeasure:
    """measure() with fixed times: `fastest` takes 1 s, every other algorithm 2 s; counts its calls."""

    def __init__(self, fastest="gemm"):
        self.fastest, self.calls = fastest, []

    def __call__(self, g, co, algorithms, dtype, kernels, tuning, batch):
        self.calls.append((g, co, algorithms, batch))
        return {a: 1.0 if a == self.fastest else 2.0 for a in algorithms}


def test_the_fastest_candidate_is_chosen_and_cached(tmp_path):
    path = tmp_path / "tune.json"
    fake = FakeMeasure("gemm")
    lines = []
    tuner = autotune.Tuner(path=str(path), measure=fake)
    shapes = [(CONV3, 16), (DEPTHWISE, 32), (POINTWISE, 64)]
    got = tuner.choose(shapes, np.float32, "numba", TUNING, say=lines.append)
    assert got == {s: "gemm" for s in shapes}
    assert len(fake.calls) == 3 and {c[3] for c in fake.calls} == {32}
    assert lines[0] == f"pydtnn: timing convolution algorithms for 3 layer shapes, first run only (cached in {path})"
    assert len(lines) == 2 and lines[1].startswith("pydtnn: timed 3 layer shapes in ")  # and when it is done

    again = autotune.Tuner(path=str(path), measure=FakeMeasure())  # a later run: read from the file, nothing timed
    assert again.choose(shapes, np.float32, "numba", TUNING, say=lines.append) == got
    assert again.measure.calls == [] and len(lines) == 2  # nothing timed: nothing said
    doc = json.loads(path.read_text())
    assert doc["format"] == autotune.FORMAT and sorted(doc["choices"].values()) == ["gemm"] * 3


def test_the_cache_is_keyed_by_cpu_isa_threads_dtype_kernels_batch_and_shape(tmp_path):
    def k(g=CONV3, co=16, dtype=np.float32, n=1, kernels="numba", batch=32, cpu=("CPU A", "avx2"), bits=256):
        return autotune.key(g, co, dtype, n, kernels, batch, cpu=cpu, bits=bits)

    others = [k(cpu=("CPU B", "avx2")), k(cpu=("CPU A", "avx512f")), k(n=2), k(dtype=np.float64), k(kernels="numpy"),
              k(batch=16), k(co=32), k(g=ConvGeometry(16, 32, 32, 3, 3)), k(bits=128)]
    assert len({k(), *others}) == len(others) + 1
    assert "CPU A" in k() and "avx2" in k()

    tuner = autotune.Tuner(path=str(tmp_path / "tune.json"), measure=FakeMeasure())
    tuner.choose([(CONV3, 16)], np.float32, "numba", TUNING)
    assert tuner.cached(CONV3, 16, np.float32, "numba", TUNING) == "gemm"
    assert tuner.cached(CONV3, 16, np.float64, "numba", TUNING) is None
    assert tuner.cached(CONV3, 8, np.float32, "numba", TUNING) is None
    assert autotune.Tuner(path=tuner.path, batch=16).cached(CONV3, 16, np.float32, "numba", TUNING) is None
    assert autotune.Tuner(path=tuner.path).cached(CONV3, 16, np.float32, "numba", TUNING) == "gemm"
    before = threads.threads()
    try:
        threads.set_threads(before + 1)
        assert tuner.cached(CONV3, 16, np.float32, "numba", TUNING) is None
    finally:
        threads.set_threads(before)


@pytest.mark.parametrize("content", [b"{not json", b"\x80\x81\xff", b"[1, 2]", b"[" * 100000,
                                     b'{"format": "other", "choices": {}}',
                                     b'{"format": "pydtnn conv autotune 3", "choices": []}',
                                     b'{"format": "pydtnn conv autotune 1", "choices": {}}',  # before Winograd
                                     b'{"format": "pydtnn conv autotune 2", "choices": {}}'])  # Winograd's old dw
def test_a_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, content):
    path = tmp_path / "tune.json"
    path.write_bytes(content)
    tuner = autotune.Tuner(path=str(path), measure=FakeMeasure("direct"))
    assert tuner.read() == {}
    assert tuner.choose([(CONV3, 16)], np.float32, "numba", TUNING) == {(CONV3, 16): "direct"}
    assert autotune.Tuner(path=str(path)).cached(CONV3, 16, np.float32, "numba", TUNING) == "direct"


def test_choices_timed_before_winograds_own_weight_gradient_are_timed_again(tmp_path):
    """A cache of format 2 timed Winograd with the direct kernels' dw: its choices are not used, and the
    file is rewritten in the current format."""
    import json

    tuner = autotune.Tuner(path=str(tmp_path / "tune.json"), measure=FakeMeasure("winograd"))
    stored = {tuner.key(CONV3, 16, np.float32, "numba"): "gemm"}
    for fmt, want in ((autotune.FORMAT, "gemm"), ("pydtnn conv autotune 2", None)):
        (tmp_path / "tune.json").write_text(json.dumps({"format": fmt, "choices": stored}))
        fresh = autotune.Tuner(path=str(tmp_path / "tune.json"), measure=FakeMeasure("winograd"))
        assert fresh.cached(CONV3, 16, np.float32, "numba", TUNING) == want, fmt
    assert fresh.choose([(CONV3, 16)], np.float32, "numba", TUNING) == {(CONV3, 16): "winograd"}
    assert json.loads((tmp_path / "tune.json").read_text())["format"] == autotune.FORMAT


def test_a_cached_algorithm_that_cannot_compute_the_shape_is_ignored(tmp_path):
    path = tmp_path / "tune.json"
    k = autotune.Tuner(path=None).key(CONV3, 16, np.float32, "numba")
    path.write_text(json.dumps({"format": autotune.FORMAT, "choices": {k: "depthwise"}}))
    assert autotune.Tuner(path=str(path)).cached(CONV3, 16, np.float32, "numba", TUNING) is None
    path.write_text(json.dumps({"format": autotune.FORMAT, "choices": {k: "no_such_algorithm"}}))
    assert autotune.Tuner(path=str(path)).read() == {}
    # a name this build lacks (another build's algorithm) stays in the file when this build saves
    autotune.Tuner(path=str(path), measure=FakeMeasure("gemm")).choose([(POINTWISE, 64)], np.float32, "numba", TUNING)
    assert json.loads(path.read_text())["choices"][k] == "no_such_algorithm"


def test_measure_times_every_candidate():
    algorithms = autotune.candidates(DEPTHWISE, 32, "numpy", TUNING)
    times = autotune.measure(DEPTHWISE, 32, algorithms, np.float32, "numpy", TUNING, batch=2, rounds=1)
    assert set(times) == set(algorithms) and all(t > 0 for t in times.values())


def test_cpu_info_names_the_model_and_a_known_isa():
    model, isa = autotune.cpu_info()
    assert model and isa in ("avx512f", "avx2", "other")
    assert autotune.describe_cpu().startswith(f"{model} ({isa}; kernels: ")
    assert "-bit vectors" in autotune.describe_cpu()


# -- a model trains the same whatever was picked -----------------------------------------------------
def small_model(backend):
    layers = [Conv2D(8, 3, padding=1), ReLU(), Conv2D(16, 1), Conv2D(16, 3, padding=1, groups=16),
              Conv2D(16, 3, stride=2, padding=1, groups=16), ReLU(), Conv2D(8, 5, padding=2), Flatten(), Dense(10)]
    return Model(layers, (3, 16, 16), backend=backend)


def losses_of(backend, steps=4):
    model = small_model(backend)
    trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.05, momentum=0.9), progress=False)
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((8, 3, 16, 16)).astype(backend.dtype)
        y = np.eye(10, dtype=backend.dtype)[rng.integers(0, 10, 8)]
        out.append(trainer.train_step(x, y)[0])
    return model, out


def conv_algorithms(model):
    return [model.backend.plan_in_use(layer.plan).algorithm for _, layer in model.layers() if isinstance(layer, Conv2D)]


@pytest.mark.slow
@pytest.mark.parametrize("measure", [FakeMeasure("gemm"), FakeMeasure("winograd"), autotune.measure],
                         ids=["all-gemm", "winograd", "measured"])
def test_a_tuned_model_trains_like_the_threshold_choice(tmp_path, measure):
    ref_model, ref = losses_of(CPUBackend(np.float64, seed=3))
    tuner = autotune.Tuner(path=str(tmp_path / "tune.json"), measure=measure)
    model, got = losses_of(CPUBackend(np.float64, seed=3, autotune=tuner))  # timed at the first forward
    np.testing.assert_allclose(got, ref, rtol=1e-9)
    if isinstance(measure, FakeMeasure) and measure.fastest == "gemm":  # every plan replaced
        assert conv_algorithms(model) == ["gemm"] * 5
        assert conv_algorithms(ref_model) != ["gemm"] * 5
    elif isinstance(measure, FakeMeasure):  # the one-group 3x3 stride-1 layer, the only one it computes
        assert conv_algorithms(model)[0] == "winograd" and conv_algorithms(model).count("winograd") == 1


def test_without_autotune_the_backend_times_nothing(tmp_path):
    b = CPUBackend(np.float64)
    assert b.tuner is None
    model = small_model(b)
    b.tune_convolutions()  # nothing to do
    assert conv_algorithms(model) == [conv_plan.choose(layer.geometry, layer.filters, b.kernels, b.tuning).algorithm
                                      for _, layer in model.layers() if isinstance(layer, Conv2D)]


# -- the command line ----------------------------------------------------------------------------------
def test_the_flag_parses_and_defaults_to_the_environment():
    assert parse_args([]).conv_autotune is None  # resolved by run(): $PYDTNN_CONV_AUTOTUNE, else true
    assert parse_args(["--conv_autotune", "false"]).conv_autotune is False
    assert parse_args(["--conv-autotune"]).conv_autotune is True


@pytest.mark.slow
@pytest.mark.parametrize("flag,environment,timed", [("true", None, True), ("false", None, False),
                                                    (None, "0", False), (None, None, True)])
def test_the_flag_reaches_the_backend(tmp_path, monkeypatch, capsys, flag, environment, timed):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if environment is None:
        monkeypatch.delenv("PYDTNN_CONV_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("PYDTNN_CONV_AUTOTUNE", environment)
    argv = ["--model", "simplecnn", "--num_epochs", "1", "--steps_per_epoch", "1", "--batch_size", "8",
            "--progress", "false"] + ([] if flag is None else ["--conv_autotune", flag])
    assert main(argv) == 0
    cache = tmp_path / "pydtnn" / "conv_autotune.json"
    assert cache.exists() == timed
    assert ("pydtnn: timing convolution algorithms for 2 layer shapes" in capsys.readouterr().err) == timed
    if timed:  # the second run finds them cached
        assert main(argv) == 0
        assert "timing convolution" not in capsys.readouterr().err


def test_two_shapes_with_one_geometry_keep_their_own_choices(tmp_path):
    """A depthwise geometry with 32 and with 64 output channels (a channel multiplier): equal plans are
    handed out for both, and each runs as its own measured choice."""
    def fake(g, co, algorithms, dtype, kernels, tuning, batch):
        return {a: 1.0 if a == ("gemm" if co == 64 else "depthwise") else 2.0 for a in algorithms}

    b = CPUBackend(np.float32, kernels="numpy", autotune=autotune.Tuner(path=None, measure=fake))
    p32, p64 = b.conv2d_plan(DEPTHWISE, (32, 1, 3, 3)), b.conv2d_plan(DEPTHWISE, (64, 1, 3, 3))
    assert p32 == p64 and p32.algorithm == "depthwise"
    b.tune_convolutions()
    assert b.plan_in_use(p32).algorithm == "depthwise" and b.plan_in_use(p64).algorithm == "gemm"
    assert b.conv2d_plan(DEPTHWISE, (64, 1, 3, 3)) is p64  # a layer built later runs as the measured one too


def test_timing_many_shapes_says_how_far_it_is():
    """Timing goes on for minutes on a large model: a line at each interval (every shape here), then the end."""
    fake = FakeMeasure("gemm")
    lines = []
    shapes = [(CONV3, 16), (DEPTHWISE, 32), (POINTWISE, 64)]
    autotune.Tuner(path=None, measure=fake).choose(shapes, np.float32, "numba", TUNING, say=lines.append, every=0.0)
    assert [s.split(" (")[0] for s in lines[1:3]] == [f"pydtnn: timed {i} of 3 layer shapes" for i in (1, 2)]
    assert lines[3].startswith("pydtnn: timed 3 layer shapes in ") and len(lines) == 4
