"""The timeline of a pipeline's step: each stage runs its schedule's forwards and backwards in order
(pydtnn.distributed.pipeline.schedule, the one the stages run), each as soon as its stage is free and its
input has arrived: the activation from the stage before (its forward's end plus the message), or the
gradient from the stage after (its backward's end plus the message); the last stage's backward follows its
own forward (the loss is part of that forward here).

    t = timeline(forward, backward, forward_msg, backward_msg, "1f1b")
    t.end                    # seconds from the step's start to the last stage's last op
    t.busy[s], t.idle[s]     # stage s's computing and waiting (fill, drain, messages) before t.stage_end[s]

forward[s][i], backward[s][i]: seconds of micro-batch i's forward and backward on stage s; forward_msg[s][i]:
seconds of its activation's message from stage s to s + 1, backward_msg[s][i] of its gradient's from s + 1 to
s. A micro-batch of no samples has no ops, as in the stages. Messages overlap computation: a stage waits for
one only where it has not arrived.
"""

from dataclasses import dataclass

from pydtnn.distributed.pipeline import schedule as stage_schedule


@dataclass(frozen=True)
class Timeline:
    end: float
    stage_end: list
    busy: list
    ops: list  # per stage: [(op, micro-batch, start, end)]

    @property
    def idle(self):
        return [e - b for e, b in zip(self.stage_end, self.busy)]


def timeline(forward, backward, forward_msg, backward_msg, kind):
    """The Timeline of one step (see the module docstring)."""
    stages, m = len(forward), len(forward[0])
    plans = [[(op, i) for op, i in stage_schedule(kind, stages, s, m) if forward[s][i] is not None]
             for s in range(stages)]
    done = {}  # (stage, op, micro-batch) -> end
    at, free, busy = [0] * stages, [0.0] * stages, [0.0] * stages
    ops = [[] for _ in range(stages)]
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while at[s] < len(plans[s]):
                op, i = plans[s][at[s]]
                if op == "F":
                    key = None if s == 0 else (s - 1, "F", i)
                    ready = 0.0 if key is None else done.get(key)
                    if ready is not None and key is not None:
                        ready += forward_msg[s - 1][i]
                    cost = forward[s][i]
                else:
                    key = (s, "F", i) if s == stages - 1 else (s + 1, "B", i)
                    ready = done.get(key)
                    if ready is not None and s < stages - 1:
                        ready += backward_msg[s][i]
                    cost = backward[s][i]
                if ready is None:
                    break  # waits for another stage's op not placed yet
                start = max(free[s], ready)
                free[s] = done[(s, op, i)] = start + cost
                busy[s] += cost
                ops[s].append((op, i, start, free[s]))
                at[s] += 1
                moved = True
    if any(at[s] < len(plans[s]) for s in range(stages)):
        raise ValueError(f"the {kind} schedule of {stages} stages and {m} micro-batches deadlocks")
    return Timeline(max(free), free, busy, ops)
