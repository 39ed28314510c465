"""A pipeline's step as it ran: every stage's forwards and backwards of each micro-batch, from the ranks' traces,
under GPipe and 1F1B, beside the step the performance model lays out for the same run.

    python benchmarks/pipeline_timeline.py [--model resnet20_cifar10] [--stages 2] [--micro_batches 8] [--batch 64]
                                           [--plot docs/pipeline_timeline.png] [--json t.json]

Each schedule trains --steps steps of --model on synthetic CIFAR-sized images under `mpiexec -n STAGES` with
--tracing, one thread per process; the last step is drawn. The ranks' traces share the machine's monotonic
clock (their otherData.t0_ns), so their spans line up. The k-th forward (backward) span of a stage in a step
is the k-th forward (backward) of its schedule (pipeline.schedule), which names its micro-batch. Below each
measured panel, the model's timeline (perfmodel schedule.py) of the same cut, schedule and micro-batches on
--machine, its stages' forward and backward times per micro-batch being the prediction's.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from pydtnn.distributed import pipeline
from pydtnn.perfmodel.mpi_links import mpiexec_path


def run(model, stages, micro_batches, batch, kind, steps, directory):
    """Train under mpiexec with tracing; the ranks' trace files."""
    trace = os.path.join(directory, f"{kind}.json")
    cmd = [mpiexec_path(), "-n", str(stages), sys.executable, "-m", "pydtnn", "--model", model,
           "--use_synthetic_data", "true", "--parallel", "pipeline", "--pipeline_stages", str(stages),
           "--micro_batches", str(micro_batches), "--pipeline_schedule", kind, "--batch_size", str(batch),
           "--steps_per_epoch", str(steps), "--num_epochs", "1", "--tracing", "true", "--tracer_output", trace,
           "--progress", "false", "--threads_per_process", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    if r.returncode:
        sys.exit(f"{kind}: exit status {r.returncode}\n{r.stderr[-2000:]}")
    from pydtnn.profiling.tracer import trace_paths

    return trace_paths(trace, stages)


def last_step(paths, stages, micro_batches, kind):
    """Per stage: [(op, micro-batch, start s, end s)] of the last step, times from the last step's earliest start,
    and the receive waits [(start, end)] (tid 2)."""
    ranks = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        shift = doc["otherData"]["t0_ns"] / 1e3  # microseconds on the shared clock
        ranks.append([{**e, "ts": e["ts"] + shift} for e in doc["traceEvents"] if e.get("ph") == "X"])
    starts = [max(e["ts"] for e in evs if e["name"] == "data" and e["tid"] == 1) for evs in ranks]
    ends = [max(e["ts"] + e["dur"] for e in evs if e["name"] == "optimizer" and e["tid"] == 1) for evs in ranks]
    t0 = min(starts)
    ops, waits = [], []
    for s, evs in enumerate(ranks):
        inside = [e for e in evs if starts[s] <= e["ts"] <= ends[s]]
        plan = pipeline.schedule(kind, stages, s, micro_batches)
        spans = {op: sorted((e for e in inside if e["tid"] == 1 and e["name"] == name), key=lambda e: e["ts"])
                 for op, name in (("F", "forward"), ("B", "backward"))}
        taken = {"F": 0, "B": 0}
        mine = []
        for op, i in plan:
            e = spans[op][taken[op]]
            taken[op] += 1
            mine.append((op, i, (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6))
        ops.append(mine)
        waits.append([((e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6) for e in inside
                      if e["tid"] == 2 and e["name"].startswith("receive")])
    return ops, waits, (max(ends) - t0) / 1e6


def predicted(model_name, stages, micro_batches, batch, kind, machine_file):
    """(per stage [(op, micro-batch, start, end)], the predicted step seconds) of the performance model."""
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.perfmodel import machine
    from pydtnn.perfmodel.pipelined import predict_pipeline_timeline
    from pydtnn.perfmodel.predict import predict

    model = models.create(model_name, backend=CPUBackend(seed=0))
    m = machine.load(machine_file)
    line = predict_pipeline_timeline(model, batch, stages, m, micro_batches, kind)
    p = predict(model, batch, stages, m, parallel="pipeline", micro_batches=micro_batches, schedule=kind)
    return line.ops, p.step_s


def draw(panels, path, title):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(12, 2.1 * len(panels)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    span = max(p["end"] for p in panels)
    for ax, p in zip(axes, panels):
        stages = len(p["ops"])
        for s, ops in enumerate(p["ops"]):
            for op, i, a, b in ops:
                ax.barh(s, b - a, left=a, height=0.8, color="#9ecae1" if op == "F" else "#3182bd",
                        edgecolor="black", linewidth=0.4)
                if b - a > span / 90:
                    ax.text((a + b) / 2, s, str(i), ha="center", va="center", fontsize=7,
                            color="black" if op == "F" else "white")
            for a, b in p.get("waits", [[]] * stages)[s]:
                if b - a > span / 400:
                    ax.barh(s + 0.45, b - a, left=a, height=0.12, color="#e6550d")
        ax.axvline(p["end"], color="black", ls="--", lw=1)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1.02)
        ax.set_title(p["title"], fontsize=10, loc="left")
        ax.set_xlabel("seconds into the step")
    handles = [Patch(color="#9ecae1", label="forward (micro-batch)"), Patch(color="#3182bd", label="backward"),
               Patch(color="#e6550d", label="waiting for a message (measured)"),
               Patch(facecolor="white", edgecolor="black", ls="--", label="end of the step")]
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=len(handles))
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet20_cifar10")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro_batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--machine", default=os.path.join(ROOT, "docs", "machine_vm.yaml"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "pipeline_timeline.png"))
    p.add_argument("--json", default=None, help="the measured and predicted ops, as JSON")
    args = p.parse_args(argv)
    panels, record = [], {}
    with tempfile.TemporaryDirectory(prefix="pipeline-timeline-") as tmp:
        for kind in pipeline.SCHEDULES:
            paths = run(args.model, args.stages, args.micro_batches, args.batch, kind, args.steps, tmp)
            ops, waits, end = last_step(paths, args.stages, args.micro_batches, kind)
            model_ops, model_step = predicted(args.model, args.stages, args.micro_batches, args.batch, kind,
                                              args.machine)
            panels.append({"title": f"{kind}: measured, step {1e3 * end:.0f} ms", "ops": ops, "waits": waits,
                           "end": end})
            panels.append({"title": f"{kind}: the performance model's layout, step {1e3 * model_step:.0f} ms "
                                    f"(compute and messages; the update and reduction after the last op)",
                           "ops": model_ops, "end": max(b for stage in model_ops for *_, b in stage)})
            record[kind] = {"measured": {"ops": ops, "waits": waits, "step_s": end},
                            "predicted": {"ops": model_ops, "step_s": model_step}}
            print(f"{kind}: measured step {1e3 * end:.1f} ms, predicted {1e3 * model_step:.1f} ms", flush=True)
    import perfmodel_validation as validation

    title = (f"{args.model}, {args.stages} stages, {args.micro_batches} micro-batches of "
             f"{args.batch // args.micro_batches} ({validation.host()}, one thread per process)")
    draw(panels, args.plot, title)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"title": title, **record}, f)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
