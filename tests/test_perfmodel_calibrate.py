"""pydtnn-perfmodel calibrate: the alpha-beta fit on known data, a quick calibration that writes a
machine file within physical bounds, the MPI probe's timeout, and bad arguments as one line and exit 2."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pydtnn.errors import PydtnnError
from pydtnn.perfmodel import calibrate, kernel_timing, mpi_links, overheads
from pydtnn.perfmodel.cli import main
from pydtnn.perfmodel.machine import DEFAULT, KERNEL_CLASSES, Link, load, save

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIZES = [8 * 4**k for k in range(12)] + [16 << 20]


def test_fit_alpha_beta_recovers_exact_line():
    alpha, beta = 4e-6, 1 / 3e9  # 4 us, 3 GB/s
    times = [alpha + n * beta for n in SIZES]
    got = mpi_links.fit_alpha_beta(SIZES, times)
    assert got == pytest.approx((alpha, beta), rel=1e-9)


def test_fit_alpha_beta_with_noise_keeps_the_small_messages_latency():
    alpha, beta = 2e-5, 1 / 1.25e8  # 20 us, 1 Gbit/s
    noise = np.random.default_rng(0).uniform(0.97, 1.03, len(SIZES))
    got_alpha, got_beta = mpi_links.fit_alpha_beta(SIZES, [(alpha + n * beta) * e for n, e in zip(SIZES, noise)])
    assert got_alpha == pytest.approx(alpha, rel=0.05)
    assert got_beta == pytest.approx(beta, rel=0.05)


def test_fit_alpha_beta_clamps_a_negative_latency_to_zero():
    beta = 1e-9
    times = [n * beta * (0.8 if n == 8 else 1.0) for n in SIZES]  # the smallest message faster than the line
    alpha, got_beta = mpi_links.fit_alpha_beta(SIZES, times)
    assert alpha == 0.0
    assert got_beta == pytest.approx(beta, rel=0.05)


@pytest.mark.parametrize("sizes,times,match", [
    ([8, 8, 8], [1e-6, 1e-6, 1e-6], "two distinct sizes"),
    ([8, 64], [1e-6, 0.0], "times > 0"),
    ([8, 64, 512], [1e-6, 1e-6], "same length"),
    ([8, 1 << 20], [1e-3, 1e-6], "do not grow"),
])
def test_fit_alpha_beta_rejects_bad_data(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        mpi_links.fit_alpha_beta(sizes, times)


@pytest.mark.parametrize("op", ["allgather", "reduce_scatter", "allreduce"])
@pytest.mark.parametrize("p", [2, 4])
def test_fit_collective_recovers_the_link_the_ring_formula_was_given(op, p):
    from pydtnn.perfmodel.collectives import FORMULAS

    alpha, beta, gamma = 3e-5, 1 / 2.5e9, 1 / 1e10
    times = [FORMULAS[op]["ring"](n, p, alpha, beta, gamma) for n in SIZES]
    link = mpi_links.fit_collective(op, p, SIZES, times, gamma)
    assert link.latency_s == pytest.approx(alpha, rel=1e-6) and link.beta == pytest.approx(beta, rel=1e-6)


def test_fit_collective_by_hand():
    """An allgather over 2 is alpha + (n / 2) beta: 20 us at 8 bytes and 0.43 ms at 2 MiB give
    beta = (4.3e-4 - 2e-5) / (2**20 - 4) s/byte (2.557 GB/s) and alpha = 2e-5 - 4 beta. A reduce-scatter over
    2 adds (n / 2) gamma: the same times with gamma = 1e-10 leave beta - 1e-10."""
    beta = (4.3e-4 - 2e-5) / (2**20 - 4)
    link = mpi_links.fit_collective("allgather", 2, [8, 2 << 20], [2e-5, 4.3e-4], gamma=1e-10)
    assert link.beta == pytest.approx(beta, rel=1e-9) and link.latency_s == pytest.approx(2e-5 - 4 * beta, rel=1e-9)
    scatter = mpi_links.fit_collective("reduce_scatter", 2, [8, 2 << 20], [2e-5, 4.3e-4], gamma=1e-10)
    assert scatter.beta == pytest.approx(beta - 1e-10, rel=1e-9)
    with pytest.raises(ValueError, match="no more than its reductions"):
        mpi_links.fit_collective("reduce_scatter", 2, [8, 2 << 20], [2e-5, 4.3e-4], gamma=1e-8)
    assert mpi_links.collective_links({"np": 2, "pingpong": [], "allreduce": []}, 1e-10) == {}  # an older probe


def _span(name, cat, ts, dur, tid):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": tid, "pid": 0}


def test_fixed_costs_from_a_trace_by_hand():
    """Two layers, 4 parameter tensors, one warm-up step then two steps of 1000 and 1200 us. Step 1: layer a
    forward 10 / backward 30, b 20 / 40, optimizer 40; step 2: a 14 / 34, b 20 / 40, optimizer 48. Per call:
    forward mean(median(10, 14), 20) = 16 us, backward mean(32, 40) = 36 us; per tensor median(40, 48) / 4 =
    11 us; per step median(1000 - 140, 1200 - 156) = 952 us. The warm-up step and its 5000 us span count nowhere."""
    events = [_span("step 1", "step", 0, 9000, 0), _span("a", "forward", 10, 5000, 0)]
    for start, (af, ab, bf, bb, opt, dur) in ((10000, (10, 30, 20, 40, 40, 1000)), (20000, (14, 34, 20, 40, 48, 1200))):
        events += [_span("step", "step", start, dur, 0), _span("a", "forward", start + 1, af, 0),
                   _span("b", "forward", start + 50, bf, 0), _span("b", "backward", start + 100, bb, 0),
                   _span("a", "backward", start + 200, ab, 0), _span("optimizer", "optimizer", start + 300, opt, 1),
                   _span("data", "data", start, 5, 1)]  # the trainer's phases other than the optimizer: the rest
    fixed, detail = overheads.fixed_costs_from_trace(events, ["a", "b"], 4, warm_up=1)
    assert fixed.layer_forward_s == pytest.approx(16e-6) and fixed.layer_backward_s == pytest.approx(36e-6)
    assert fixed.parameter_s == pytest.approx(11e-6) and fixed.step_s == pytest.approx(952e-6)
    assert detail["steps"] == 2 and detail["step_s"] == pytest.approx(1100e-6)
    # by kind, a and b being of different kinds: a's forward median(10, 14) = 12, backward 32; b's 20 / 40
    fixed, _ = overheads.fixed_costs_from_trace(events, ["a", "b"], 4, warm_up=1, kinds={"a": "ReLU", "b": "Dense"})
    assert set(fixed.layer_calls) == {"ReLU", "Dense"}
    assert fixed.call_s("ReLU") == pytest.approx((12e-6, 32e-6)) and fixed.call_s("Dense") == pytest.approx((20e-6, 40e-6))
    assert fixed.layer_forward_s == pytest.approx(16e-6) and fixed.call_s("Conv2D") == pytest.approx((16e-6, 36e-6))
    with pytest.raises(RuntimeError, match="0 steps after 3 warm-up"):
        overheads.fixed_costs_from_trace(events, ["a", "b"], 4, warm_up=3)


def test_a_rate_leaves_out_the_fixed_cost_of_the_calls():
    """1e6 FLOPs in 1.1 ms, of which 0.1 ms are the two calls: 1e6 / 1e-3 = 1 GFLOP/s."""
    t = kernel_timing.Timing("x", "gemm", None, flops=10**6, bytes=2 * 10**6, seconds=1.1e-3, call_s=1e-4)
    assert t.rate == pytest.approx(1e9) and t.bandwidth == pytest.approx(2e9)
    with pytest.raises(RuntimeError, match="no more than the fixed cost"):
        kernel_timing.Timing("y", "gemm", None, 1, 1, seconds=1e-5, call_s=2e-5)


def test_thread_fit_recovers_the_serial_part_and_the_speed_ups_it_was_given():
    """Timings made by the model itself (a call of s seconds takes a + (s - a) / S at 2 threads, a per kernel
    call) give back a and each class's S; without a serial part, S is the plain ratio of the times."""
    def timing(label, cls, seconds, phases=3):
        return kernel_timing.Timing(label, cls, None, 1, 1, seconds, 0.0, phases)

    speed, serial = {"gemm": 1.6, "direct3x3": 1.9}, 1.2e-4
    large = [("g1", "gemm", 20e-3, 3), ("g2", "gemm", 9e-3, 2), ("d1", "direct3x3", 7e-3, 3)]
    small = [("g1 b1", "gemm", 1.2e-3, 3), ("g2 b1", "gemm", 6e-4, 2), ("d1 b1", "direct3x3", 4e-4, 3)]

    def at(rows, threads, a):
        return [timing(n, c, s if threads == 1 else a * p + (s - a * p) / speed[c], p) for n, c, s, p in rows]

    scaling, got = kernel_timing.thread_fit(at(large, 1, serial), at(large, 2, serial), at(small, 1, serial),
                                            at(small, 2, serial), 2)
    assert got == pytest.approx(serial, rel=1e-6) and scaling == pytest.approx(speed, rel=1e-6)
    scaling, got = kernel_timing.thread_fit(at(large, 1, 0), at(large, 2, 0), at(small, 1, 0), at(small, 2, 0), 2)
    assert got == pytest.approx(0, abs=1e-12) and scaling == pytest.approx(speed, rel=1e-9)


def test_small_shapes_are_the_large_ones_at_a_smaller_batch():
    small = kernel_timing.small_shapes()
    large = {s.label: s for s in kernel_timing.shapes()}
    assert small and all(s.batch == max(1, large[s.label.rsplit(" ", 1)[0]].batch // kernel_timing.SMALL_DIVISOR)
                         for s in small)
    assert {kernel_timing.Probe(s).cost.kernel_class for s in small} == {"gemm", "direct3x3", "depthwise"}


def test_every_kernel_class_has_a_shape_in_quick_and_full():
    for quick in (True, False):
        classes = {kernel_timing.Probe(s).cost.kernel_class for s in kernel_timing.shapes(quick)}
        assert classes == set(KERNEL_CLASSES)


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pydtnn.perfmodel.cli", "calibrate", *args], check=False,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_calibration_writes_a_plausible_machine(tmp_path):
    base = DEFAULT.with_link("inter", bandwidth=3.0e8, latency=7e-5)
    save(base, tmp_path / "base.yaml")
    out = tmp_path / "machine.yaml"
    r = run_cli("--quick", "--out", str(out), "--base", str(tmp_path / "base.yaml"), "--name", "test box")
    assert r.returncode == 0, r.stderr
    m = load(out)
    assert m.name == "test box"
    for kernel in KERNEL_CLASSES:
        assert 1e7 < m.rates[kernel] < 1e12, (kernel, m.rates[kernel])
    assert 1e8 < m.rates["gemm"] < 1e12
    assert 1e8 < m.memory_bandwidth < 1e12
    assert 1e8 < m.reduce_rate < 1e12
    assert m.thread_scaling[1] == 1.0 and 0.05 < m.thread_scaling[2] < 4
    assert set(m.thread_scaling_by_class) == set(KERNEL_CLASSES)
    assert all(s[1] == 1.0 and 0.05 < s[2] < 4 for s in m.thread_scaling_by_class.values())
    assert set(m.thread_serial_s) == {2} and 0 <= m.thread_serial_s[2] < 1e-2 and "serial part" in r.stdout
    o = m.overheads  # a layer call costs microseconds, a step of the tiny model less than a second
    assert 1e-7 < o.layer_forward_s < 1e-2 and 1e-7 < o.layer_backward_s < 1e-2 and 0 < o.parameter_s < 1e-2
    assert 0 <= o.step_s < 1.0 and "fixed costs: layer call" in r.stdout
    assert set(o.layer_calls) == {"Conv2D", "BatchNorm", "ReLU", "MaxPool2D", "Flatten", "Dense"}  # tiny_model's
    assert all(0 < f < 1e-2 and 0 < b < 1e-2 for f, b in o.layer_calls.values())
    intra = m.links["intra"]
    assert 0 <= intra.latency_s < 1e-3 and 1e7 < intra.bandwidth_bytes_per_s < 1e12
    assert m.links["inter"] == Link(7e-5, 3.0e8)  # the level not measured is the base's
    assert m.processes_per_node == 2 and m.cores >= 1
    assert "calibrate: MPI probe" in r.stderr and "allreduce over 2 processes" in r.stdout
    assert set(intra.collectives) == {"allgather", "reduce_scatter", "allreduce"}  # each its own fit
    for fit in intra.collectives.values():
        assert 0 <= fit.latency_s < 1e-2 and 1e6 < fit.bandwidth_bytes_per_s < 1e12
    assert m.links["inter"].collectives == {}
    assert 0 <= o.oversubscribed_collective_s < 0.1 and "per collective on oversubscribed cores (measured)" in r.stdout


def test_no_mpi_keeps_the_base_links_and_one_thread_keeps_its_scaling(tmp_path):
    out = tmp_path / "machine.json"
    r = run_cli("--quick", "--no_mpi", "--threads", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = load(out)
    assert dict(m.links) == dict(DEFAULT.links)
    assert m.overheads.oversubscribed_collective_s == DEFAULT.overheads.oversubscribed_collective_s
    assert dict(m.thread_scaling) == dict(DEFAULT.thread_scaling)
    assert m.processes_per_node == DEFAULT.processes_per_node
    assert "MPI probe" not in r.stderr


def test_the_mpi_probe_times_every_size_it_names_on_two_processes():
    """The probe calibrate runs under mpiexec: one timing per message size of mpi_probe.sizes, for the
    ping-pong, the allreduce and each collective model parallelism runs, each a positive number of seconds."""
    from pydtnn.perfmodel import mpi_probe

    if calibrate.mpi_missing():
        pytest.skip(calibrate.mpi_missing())
    r = mpi_links.run_mpi_probe(2, quick=True)
    assert r["np"] == 2 and set(r["collectives"]) == set(mpi_probe.COLLECTIVES)
    sizes = [n for n, _ in r["pingpong"]]
    assert sizes == mpi_probe.sizes(sizes[-1], quick=True) and [n for n, _ in r["allreduce"]] == sizes
    for series in [r["pingpong"], r["allreduce"], *r["collectives"].values()]:
        assert series and all(seconds > 0 for _, seconds in series)


def test_a_hanging_probe_fails_with_a_clear_error():
    if calibrate.mpi_missing():
        pytest.skip(calibrate.mpi_missing())
    with pytest.raises(PydtnnError, match=r"did not finish in 0.2 s"):
        mpi_links.run_mpi_probe(2, quick=True, timeout=0.2)


@pytest.mark.parametrize("argv,match", [
    (["--out", "m.yaml", "--threads", "2"], "expected 1 among the thread counts"),
    (["--out", "m.yaml", "--threads", "one"], "comma list of thread counts"),
    (["--out", "m.yaml", "--level", "rack"], "invalid choice"),
    (["--out", "m.yaml", "--np", "1"], "at least 2 processes"),
    (["--quick"], "--out"),
    (["--out", "m.yaml", "--base", "no/such/file.yaml"], "does not exist"),
])
def test_bad_arguments_exit_2_with_one_line(argv, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: pytest.fail("measured despite a bad argument"))
    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pydtnn-perfmodel: error: ") and match in err, err
    assert not (tmp_path / "m.yaml").exists()


def test_outputs_are_checked_before_anything_is_measured(capsys, monkeypatch, tmp_path):
    """The machine file to write may not be the --base it reads (by name, symbolic or hard link), a FIFO or a
    device, nor sit in a folder that does not exist (none is made); each refusal is one line and exit 2."""
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: pytest.fail("measured despite a bad output"))
    save(DEFAULT, "m.yaml")
    before = (tmp_path / "m.yaml").read_bytes()
    (tmp_path / "soft.yaml").symlink_to("m.yaml")
    os.link(tmp_path / "m.yaml", tmp_path / "hard.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    for out, words in [("m.yaml", ["machine file m.yaml", "base machine file"]),
                       ("soft.yaml", ["base machine file"]), ("hard.yaml", ["base machine file"]),
                       ("fifo.yaml", ["fifo.yaml", "FIFO"]), (os.devnull, ["character device"]),
                       ("absent/m.yaml", ["absent", "not a writable directory"])]:
        assert main(["calibrate", "--no_mpi", "--base", "m.yaml", "--out", out]) == 2, out
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("pydtnn-perfmodel: error: "), err
        assert all(w in err for w in words), (out, err)
    assert (tmp_path / "m.yaml").read_bytes() == before and not (tmp_path / "absent").exists()


def test_missing_mpi_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate, "mpi_missing", lambda: "mpi4py is not installed (pip install mpi4py mpich)")
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: pytest.fail("measured without MPI"))
    assert main(["calibrate", "--out", "m.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mpi4py is not installed" in err and "--no_mpi" in err, err
