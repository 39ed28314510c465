"""pydtnn-perfmodel plan (pydtnn/perfmodel/planner.py): every layout the trainer accepts is planned, every planned
one runs, what does not fit in memory is dropped, recomputation is tried only where memory asks for it, and a
bad memory limit is one line and exit status 2.

Multi-process runs use the mpiexec next to the Python in use, as subprocesses with a timeout.
"""

import itertools
import json
import subprocess
import sys

import pytest
from test_zero import ENV, MPIEXEC

from pydtnn.cli import build_parser
from pydtnn.errors import ConfigError
from pydtnn.perfmodel import machine, planner
from pydtnn.perfmodel.cli import main
from pydtnn.plan import PARALLEL, RunPlan

MODEL = "simplecnn"


def shape(args, np_):
    """What a layout is, whatever its micro-batches and bucket sizes: the trainer's layout, ZeRO stage (none over
    one replica: nothing to shard), reducer and schedule."""
    plan = RunPlan.from_args(args, np_)
    lay = plan.layout
    pipelined = lay.pipeline_stages > 1
    parallel = lay.parallel  # hybrid of one replica is the pipeline, or the split model, it names
    if parallel == "hybrid" and lay.replicas == 1 and (lay.model_parallel_size == 1 or not pipelined):
        parallel = "pipeline" if pipelined else "model"
    zero = plan.zero if lay.replicas > 1 else 0
    return (parallel, lay.model_parallel_size, lay.pipeline_stages, zero,
            "bucketed" if zero >= 2 else plan.reduction.name,  # stages 2 and 3 reduce-scatter themselves
            args.pipeline_schedule if pipelined else None, args.accumulation_steps > 1 if pipelined else None)


@pytest.fixture(scope="module")
def plans():
    return {n: planner.plan(MODEL, n, machine.DEFAULT) for n in (1, 2, 4)}


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_every_layout_the_trainer_accepts_is_planned(np_, plans):
    """A grid of the trainer's layout flags over np_ processes: every combination its RunPlan accepts is among
    the planned layouts (as a layout, ZeRO stage, reducer and schedule), and nothing planned was refused."""
    choices, refused, common = plans[np_]
    parser = build_parser()
    planned = {shape(parser.parse_args([*common, *c.flags]), np_) for c in choices}
    assert refused == [] and len(planned) > (8 if np_ == 4 else 0)
    sizes = range(1, np_ + 1)
    for parallel, m, s, z, red, sched, micro in itertools.product(
            PARALLEL, sizes, sizes, (0, 1, 2, 3), planner.LOSSLESS, ("1f1b", "gpipe"), (1, 2 * np_)):
        argv = [*common, "--parallel", parallel, "--model_parallel_size", str(m), "--zero", str(z), "--reduction",
                red, "--pipeline_schedule", sched, "--micro_batches", str(micro)]
        argv += ["--pipeline_stages", str(s)] if s > 1 else []
        try:
            args = parser.parse_args(argv)
            accepted = shape(args, np_)
        except ConfigError:
            continue
        pipelined = accepted[2] > 1
        if not pipelined and micro > 1:
            continue  # the planner leaves accumulation to pipelines, where it is their micro-batches
        if accepted[0] != "data" and red != "bucketed":
            continue  # split and pipelined layouts take the default reducer
        if pipelined and micro == 1:
            continue  # a pipeline of one micro-batch keeps every stage but one idle
        assert accepted in planned, argv


@pytest.mark.parametrize("np_", [2, 4])
def test_no_two_planned_layouts_run_alike(np_, plans):
    """Flags the trainer ignores make no second row: ZeRO stage 3 works layer by layer (no bucket size, no
    reducer of its own), stage 2 by buckets (the reducer's name aside)."""
    choices, _, common = plans[np_]
    parser, keys = build_parser(), set()
    for c in choices:
        args = parser.parse_args([*common, *c.flags])
        key = shape(args, np_)
        bucket = args.bucket_size_mb if key[4] in ("bucketed", "hierarchical") and key[3] < 3 else None
        keys.add((*key, bucket, args.accumulation_steps, args.recompute))
    assert len(keys) == len(choices)


def test_a_plan_without_the_memory_model_ranks_alike(plans):
    choices, _, _ = plans[2]
    quick, _, _ = planner.plan(MODEL, 2, machine.DEFAULT, with_memory=False)
    assert [(c.flags, c.step_s) for c in quick] == [(c.flags, c.step_s) for c in choices]
    assert {c.memory_bytes for c in quick} == {0} and min(c.memory_bytes for c in choices) > 0


def test_a_node_size_that_does_not_divide_the_processes_is_one_line(capsys):
    assert main(["plan", "--model", MODEL, "--np", "4", "--ranks_per_node", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranks_per_node 3" in err[0] and "expected a divisor of 4 between 2 and 2" in err[0]


def test_the_planned_layouts_are_ranked_by_predicted_step(plans):
    """By predicted step, but for the default layout, first where nothing is predicted more than MARGIN faster."""
    choices, _, _ = plans[4]
    rest = choices[1:] if choices[0].flags == planner.DEFAULT else choices
    steps = [c.step_s for c in rest]
    assert steps == sorted(steps) and all(c.fits for c in choices)
    if rest is not choices:
        assert steps[0] >= choices[0].step_s * (1 - planner.MARGIN)
    assert {c.batch_per_replica for c in choices} == {64, 128, 256}  # 256 samples over 4, 2 or 1 replicas


def _choice(flags, step_s, fits=True):
    return planner.Choice(tuple(flags), step_s, 1.0 / step_s, 0, {}, 1, fits)


@pytest.mark.parametrize("faster, fits, kept", [(0.02, True, True), (0.049, True, True), (0.06, True, False),
                                                (0.20, True, False), (0.02, False, False)])
def test_the_default_stays_first_unless_beaten_by_more_than_the_margin(faster, fits, kept):
    other, third = ("--parallel", "data", "--zero", "3"), ("--parallel", "model")
    ranked = [_choice(other, 1.0 - faster), _choice(third, 0.999), _choice(planner.DEFAULT, 1.0, fits)]
    got = planner.keep_default(ranked, 0.05)
    assert sorted(map(id, got)) == sorted(map(id, ranked))
    assert [c.flags for c in got] == ([planner.DEFAULT, other, third] if kept else [c.flags for c in ranked])


def test_what_does_not_fit_is_dropped_and_recomputed_only_then(plans):
    """With a limit between the layouts' memories, the table lists only those within it; a layout over it is
    tried with --recompute segments (then all) and nothing that fits is."""
    free, _, _ = plans[2]
    mem = sorted(c.memory_bytes for c in free)
    limit = (mem[0] + mem[-1]) / 2
    choices, _, _ = planner.plan(MODEL, 2, machine.DEFAULT, memory_bytes=limit)
    fitting = [c for c in choices if c.fits]
    assert fitting and len(fitting) < len(choices)
    assert all((c.memory_bytes <= limit) == c.fits for c in choices)
    assert choices[: len(fitting)] == fitting  # fitting ones first
    recomputed = {c.flags[:-2] for c in choices if "--recompute" in c.flags}
    over = {c.flags for c in choices if not c.fits and "--recompute" not in c.flags}
    assert recomputed and recomputed <= over
    assert not any("--recompute" in c.flags for c in free)


def test_plan_prints_the_best_and_json_gives_them_all(capsys):
    assert main(["plan", "--model", MODEL, "--np", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["#", "step", "ms", "samples/s"] and len(out) == 4
    assert main(["plan", "--model", MODEL, "--np", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"model", "np", "machine", "global_batch_size", "memory_per_process_bytes", "optimizer",
                        "common_flags", "layouts", "refused"}
    assert len(got["layouts"]) == len(planner.candidates(2)) and got["refused"] == []
    for row in got["layouts"]:
        assert set(row) == {"flags", "command", "lossy", "step_s", "samples_per_second", "memory_bytes", "memory",
                            "batch_per_replica", "fits"}
        assert row["lossy"] is False
        assert row["command"].startswith("pydtnn-train --model simplecnn --optimizer sgd --global_batch_size")
        assert row["step_s"] > 0 and row["memory_bytes"] == sum(row["memory"].values())


LOSSY_REDUCERS = {"bucketed", "topk", "oktopk", "powersgd", "local_sgd", "stale"}  # bucketed: with fp16 on the wire


@pytest.fixture(scope="module")
def lossy_plan():
    return planner.plan(MODEL, 2, machine.DEFAULT, lossy=True)


def test_the_lossy_reductions_are_weighed_only_when_asked(plans, lossy_plan):
    """--lossy adds data parallelism under each reduction that changes the algorithm, each a layout the trainer runs
    with that reducer, marked lossy, its reducer's state in its memory; without it none is weighed."""
    assert not any(planner.is_lossy(f) for f in planner.candidates(4)) and not any(c.lossy for c in plans[2][0])
    choices, refused, common = lossy_plan
    lossy = [c for c in choices if c.lossy]
    assert refused == [] and len(choices) == len(plans[2][0]) + len(planner.LOSSY)
    parser, got = build_parser(), {}
    for c in lossy:
        plan = RunPlan.from_args(parser.parse_args([*common, *c.flags]), 2)
        got[plan.reduction.name, plan.reduction.compression] = c
    assert {name for name, _ in got} == LOSSY_REDUCERS and ("bucketed", "fp16") in got
    params = plans[2][0][0].memory["parameters"]
    assert got["topk", "none"].memory["reducer"] >= params and got["stale", "none"].memory["reducer"] >= 2 * params
    assert max(c.memory["reducer"] for c in choices if not c.lossy) < 0.05 * params


def test_a_lossy_layout_is_marked_and_sets_only_what_it_names(lossy_plan, capsys):
    """The table marks each lossy row; applying a lossless layout leaves a run's own lossy flags (--parallel auto
    keeps them), applying a lossy one sets its own."""
    choices, _, common = lossy_plan
    text = planner.table(choices, top=len(choices)).splitlines()
    assert sum(line.endswith("(lossy)") for line in text) == len(planner.LOSSY)
    parser = build_parser()
    args = parser.parse_args([*common, "--gradient_compression", "fp16"])
    planner.apply(args, planner.DEFAULT, common, parser)
    assert args.gradient_compression == "fp16" and args.reduction == "bucketed"
    planner.apply(args, ("--parallel", "data", "--reduction", "powersgd", "--rank", "4"), common, parser)
    assert (args.reduction, args.rank, args.gradient_compression) == ("powersgd", 4, "none")  # fp16: not powersgd's
    assert planner.is_lossy(("--parallel", "data", "--reduction", "topk")) and not planner.is_lossy(planner.DEFAULT)
    assert main(["plan", "--model", MODEL, "--np", "2", "--lossy", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert sum(r["lossy"] for r in rows) == len(planner.LOSSY)


@pytest.mark.slow
def test_every_lossy_layout_runs(lossy_plan, tmp_path):
    """Two steps of each lossy layout the planner weighs, under mpiexec over 2 processes."""
    choices, _, common = lossy_plan
    for c in (c for c in choices if c.lossy):
        r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", *common, *c.flags,
                            "--num_epochs", "1", "--steps_per_epoch", "2", "--progress", "false"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=180, env=ENV, check=False)
        assert r.returncode == 0, (c.flags, r.stderr[-2000:])


@pytest.mark.parametrize("limit, says", [("0", "expected a number > 0"), ("-1", "expected a number > 0"),
                                         ("0.001", "fits; expected at least 0.0")])
def test_a_bad_memory_limit_is_one_line_and_exit_2(limit, says):
    r = subprocess.run([sys.executable, "-m", "pydtnn.perfmodel.cli", "plan", "--model", MODEL, "--np", "2",
                        "--memory_per_process", limit], capture_output=True, text=True, timeout=300, env=ENV,
                       check=False)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and limit in lines[0], r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 4])
def test_every_planned_layout_runs(np_, plans, tmp_path):
    """Two steps of each planned layout (one per layout, ZeRO stage, reducer and schedule) under mpiexec."""
    choices, _, common = plans[np_]
    parser, seen = build_parser(), set()
    for c in choices:
        key = shape(parser.parse_args([*common, *c.flags]), np_)
        if key in seen:
            continue
        seen.add(key)
        r = subprocess.run([MPIEXEC, "-n", str(np_), sys.executable, "-m", "pydtnn", *common, *c.flags,
                            "--num_epochs", "1", "--steps_per_epoch", "2", "--progress", "false"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=180, env=ENV, check=False)
        assert r.returncode == 0, (c.flags, r.stderr[-2000:])
    assert len(seen) > (8 if np_ == 4 else 4)


# -- pydtnn-train --parallel auto ------------------------------------------------------------------------------
MACHINE = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "machine_xeon_avx512.yaml")
CHOOSE = """
import json
from pydtnn.cli import parse_args
from pydtnn.distributed import launch
from pydtnn.perfmodel.auto import choose
launch.start()
args = parse_args(["--model", "simplecnn", "--parallel", "auto", "--machine", {machine!r}])
out = {out!r}
comm = launch.init(1, 300.0, False)
from pydtnn.perfmodel.simulate import build
best = choose(args, comm, lambda line: None, built=build(args) if comm.rank == 0 else None)
with open(f"{out}/rank{{comm.rank}}.json", "w") as f:
    json.dump({{"rank": comm.rank, "chosen": best["flags"], "args": [args.parallel, args.model_parallel_size,
        args.pipeline_stages, args.zero, args.reduction, args.bucket_size_mb, args.accumulation_steps,
        args.pipeline_schedule, args.recompute, args.global_batch_size]}}, f)
"""


def test_parallel_auto_takes_rank_0s_choice_on_every_rank(tmp_path):
    """np 2: each rank's flags after choose() are those of the plan's first layout, the same on both."""
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", CHOOSE.format(machine=MACHINE, out=str(tmp_path))],
                       capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [d["rank"] for d in got] == [0, 1] and got[0]["args"] == got[1]["args"]
    best = planner.plan(MODEL, 2, machine.load(MACHINE))[0][0]
    assert got[0]["chosen"] == list(best.flags) == got[1]["chosen"]
    args = planner.apply(build_parser().parse_args(["--model", MODEL]), best.flags,
                         ("--model", MODEL, "--optimizer", "sgd", "--global_batch_size", str(got[0]["args"][-1])))
    assert got[0]["args"] == [args.parallel, args.model_parallel_size, args.pipeline_stages, args.zero, args.reduction,
                              args.bucket_size_mb, args.accumulation_steps, args.pipeline_schedule, args.recompute,
                              args.global_batch_size]


def test_parallel_auto_trains_with_its_choice(tmp_path):
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", MODEL, "--parallel", "auto",
                        "--machine", MACHINE, "--num_epochs", "1", "--steps_per_epoch", "2", "--progress", "false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    best = planner.plan(MODEL, 2, machine.load(MACHINE))[0][0]
    said = [line for line in (r.stdout + r.stderr).splitlines() if "--parallel auto chose" in line]
    assert len(said) == 1 and f"chose {' '.join(best.flags)}:" in said[0] and "runner-up" in said[0]
    assert "final: " in r.stdout


@pytest.mark.parametrize("argv, says", [
    (["--memory_per_process", "0"], "expected a number > 0"),
    (["--memory_per_process", "0.0001"], ("--memory_per_process 0.0001: no layout of simplecnn on 2 processes "
                                          "fits; expected at least 0.0")),
    (["--zero", "2"], "--parallel auto chooses --zero itself, but --zero 2 was given"),
])
def test_parallel_auto_refuses_in_one_line(argv, says):
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--model", MODEL, "--simulate", "true", "--np", "2",
                        "--parallel", "auto", *argv], capture_output=True, text=True, timeout=300, env=ENV, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr


def test_a_memory_limit_without_auto_is_refused():
    r = subprocess.run([sys.executable, "-m", "pydtnn", "--model", MODEL, "--simulate", "true", "--np", "2",
                        "--memory_per_process", "1"], capture_output=True, text=True, timeout=300, env=ENV,
                       check=False)
    assert r.returncode == 2 and "--memory_per_process 1 bounds the layouts --parallel auto weighs" in r.stderr


@pytest.mark.slow
def test_parallel_auto_calibrates_this_machine_once(tmp_path):
    """With no --machine, the first run calibrates into the per-user cache and says so; the next plans on it."""
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", MODEL, "--parallel", "auto", "--num_epochs",
           "1", "--steps_per_epoch", "1", "--progress", "false"]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    files = list((tmp_path / "cache" / "pydtnn" / "machines").glob("*-np2.yaml"))
    assert len(files) == 1 and "calibrating this machine for 2 processes, once" in first.stderr + first.stdout
    assert machine.load(files[0]).links["intra"].collectives  # the link measured over the job's processes
    second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert second.returncode == 0 and f"--parallel auto plans on {files[0]}" in second.stderr + second.stdout
