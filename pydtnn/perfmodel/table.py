"""A Prediction (perfmodel/predict.py) as text: the per-layer table, a pipeline's stages, the step's split and
its throughput; seconds and rates written as a reader writes them."""

import math


def duration(seconds):
    """Seconds as a reader writes them, in the unit that fits: '196.1 s', '12.35 ms', '850 us', '1,234 s'."""
    if not math.isfinite(seconds) or seconds == 0:
        return f"{seconds:g} s"
    if abs(seconds) >= 1000:
        return f"{seconds:,.0f} s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds * 1e9:.4g} ns"


def rate(per_second):
    """A rate to 4 significant digits, thousands separated: '5.223', '1,234', '123,456'."""
    if math.isfinite(per_second) and abs(per_second) >= 1000:
        return f"{per_second:,.0f}"
    return f"{per_second:.4g}"


def table(p):
    """The per-layer table (milliseconds, one column unit) and the step's split and throughput, as text."""
    ms = lambda s: f"{1e3 * s:9.3f}"
    if p.pipeline_stages > 1:
        how = (f"batch {p.batch_size} per pipeline in {p.micro_batches} micro-batch(es), {p.np} process(es) "
               f"({p.pipeline_stages} stages per pipeline, {p.schedule})")
    elif p.model_parallel_size == 1:
        how = f"batch {p.batch_size} per process, {p.np} process(es)"
    else:
        how = f"batch {p.batch_size} per replica, {p.np} process(es) ({p.model_parallel_size} per replica)"
    if p.pipeline_stages == 1 and p.micro_batches > 1:
        how += f" in {p.micro_batches} micro-batches"
    if p.recompute != "none":
        how += f", recompute {p.recompute}"
    if p.zero:
        how += f", ZeRO {p.zero} (" + {2: "the reduced gradients and ", 3: "parameters, reduced gradients and "}.get(
            p.zero, "") + "optimizer state sharded)"
    per = " (first micro-batch)" if p.micro_batches > 1 and p.pipeline_stages > 1 else ""
    lines = [(f"{p.model}: {how} x {p.threads} thread(s), {p.parallel} "
             f"parallel, {p.reduction} reduction ({p.algorithm}, progress {p.progress}) on {p.machine}"),
             f"{'layer':32s} {'kind':18s} {'algorithm':14s} {'fwd ms':>9s} {'bwd ms':>9s} {'bound':>7s}{per}"]
    for t in p.layers:
        lines.append(f"{t.name[:32]:32s} {t.kind[:18]:18s} {str(t.algorithm or '')[:14]:14s} {ms(t.forward_s)} "
                     f"{ms(t.backward_data_s + t.backward_weights_s)} {t.bound:>7s}")
    if p.stages:
        header = (f"{'stage':6s} {'layers':30s} {'fwd ms':>9s} {'bwd ms':>9s} {'msg ms':>9s} {'busy ms':>9s} "
                  f"{'idle ms':>9s} {'reduce ms':>9s} {'update ms':>9s}   (a step: every micro-batch)")
        lines += ["", header]
        for r in p.stages:
            span = r["first"] if r["first"] == r["last"] else f"{r['first']}..{r['last']}"
            lines.append(f"{r['stage']:<6d} {span[:30]:30s} {ms(r['forward_s'])} {ms(r['backward_s'])} "
                         f"{ms(r['message_s'])} {ms(r['busy_s'])} {ms(r['idle_s'])} {ms(r['reduce_s'])} "
                         f"{ms(r['update_s'])}")
    lines += ["", (f"step {duration(p.step_s)} = compute {duration(p.compute_s)} + memory-bound "
                  f"{duration(p.memory_s)} (update {duration(p.update_s)}) + fixed costs "
                  f"{duration(p.overhead_s)} + exposed communication "
                  f"{duration(p.exposed_comm_s)} (of {duration(p.comm_s)} in {p.messages} collective(s)"
                  + (f"; {duration(p.group_comm_s)} of them inside the model-parallel groups, blocking"
                     if p.model_parallel_size > 1 else "")
                  + (f"; {duration(p.sync_s)} waiting for ranks off oversubscribed cores" if p.sync_s else "")
                  + ")"
                  + (f" + pipeline bubble {duration(p.bubble_s)} (the busiest stage's fill, drain and waits; "
                     f"{duration(p.p2p_s)} of messages between stages)" if p.pipeline_stages > 1 else "")),
              (f"{rate(p.samples_per_second)} samples/s: a global batch of {p.global_batch:,} samples every "
               f"{duration(p.step_s)}")]
    if not math.isfinite(p.step_s):
        lines.append("the prediction is not finite: check the machine's rates")
    return "\n".join(lines)
