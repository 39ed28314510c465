"""Predicted training step of model and hybrid parallelism, as pydtnn/distributed/model_parallel.py runs them.

    p = predict(model, batch_size=32, np=4, machine=m, parallel="hybrid", model_parallel_size=2)

The rewrite comes from model_parallel.plan(model, M), the same walk partition() applies, so the model
follows the code: M processes per group, np / M replicas (data parallel across groups), batch_size
samples per replica, all of them seen by every process of its group.

Compute. The layers are those of the model as partition() rewrites it for the group's rank 0 (the most
loaded: the first C mod M ranks hold one channel more), each costed by costs.py at the replica's batch:
a split convolution computes its output channels but still reads (im2col) its whole input and writes a
whole dx; a layer that needs its whole input costs what it costs whole; the inserted gathers and sums
cost their copies (costs.py), and their calls count among the fixed costs.

Communication in a group (blocking, on the critical path: nothing overlaps it). For each gather before
a layer that needs a whole tensor of E elements per sample: an allgather of batch x E elements forward;
backward, a reduce-scatter of the same size where the next layer is split (else nothing: each rank keeps
its slice). For each sum of dx: an allreduce of batch x E elements in backward; for each sum of a
transformer block's split outputs (Megatron's), one forward. Groups are consecutive
ranks: the intra-node link while M fits on a node, the inter-node one otherwise.

Across groups (hybrid): each replica's gradients, the split layers' slices (their share of the bytes),
are reduced over the np / M replicas by the reducer, as in data parallelism (predict.py), on the link
the whole job uses.
"""

import copy
import weakref

from pydtnn.distributed import model_parallel
from pydtnn.perfmodel import collectives
from pydtnn.plan import layout


def group_size(parallel, np, model_parallel_size):
    """M: processes per model replica, by the run plan's rule (pydtnn.plan.layout), as the trainer takes it."""
    return layout(parallel, np, model_parallel_size).model_parallel_size


def group_messages(steps, batch_size, itemsize, m, machine, algorithm):
    """[(phase, op, bytes, seconds)] of the collectives inside a group, per step of the forward pass."""
    level = "intra" if m <= machine.processes_per_node else "inter"
    out = []

    def cost(op, nbytes):
        if m <= 1 or nbytes == 0:
            return 0.0
        if algorithm == "best" or algorithm not in collectives.algorithms(op):
            return collectives.best(op, nbytes, m, machine, level=level)[1]
        return collectives.seconds(op, algorithm, nbytes, m, machine, level=level)

    for s in steps:
        nbytes = s.get("elements", 0) * batch_size * itemsize
        if s.get("op") == "allgather":
            out.append(("forward", "allgather", nbytes, cost("allgather", nbytes)))
            if s["backward"] == "reduce_scatter":
                out.append(("backward", "reduce_scatter", nbytes, cost("reduce_scatter", nbytes)))
        elif s.get("op") == "sum_dx":
            out.append(("backward", "allreduce", nbytes, cost("allreduce", nbytes)))
        elif s.get("op") == "sum_output":  # Megatron's sum of the row-split outputs
            out.append(("forward", "allreduce", nbytes, cost("allreduce", nbytes)))
    return out


_CLONES = weakref.WeakKeyDictionary()  # model -> {M: its rewrite as rank 0 of M runs it}, while the model lives


def split_model(model, m):
    """`model` rewritten by model_parallel.partition as rank 0 of a group of m holds it: a copy (the backend
    shared), kept while the model lives, so its layers' costs are the real sliced layers' with the
    algorithms the backend chose for them, and the gathers and sums inserted."""
    held = _CLONES.setdefault(model, {})
    if m not in held:
        clone = copy.deepcopy(model, {id(model.backend): model.backend})
        model_parallel.partition(clone, LocalRank0(m))
        held[m] = clone
    return held[m]


class LocalRank0:
    """Rank 0 of a group of `size`: all partition() asks of a communicator, and collectives that write what
    the real ones write into (the values aside: nothing is sent), so the split model (or ZeRO's sharded
    optimizer) runs a step as rank 0 would and the memory model can measure what it holds (perfmodel/memory.py)."""

    device = "cpu"  # host arrays, as reducers.create checks

    def __init__(self, size):
        self.rank, self.size = 0, size

    def allgatherv(self, send, recv, counts, label=""):
        recv[...] = 0
        recv[: send.size] = send
        return recv

    def reduce_scatterv(self, send, recv, counts, label=""):
        recv[...] = send[: recv.size]
        return recv

    def allreduce(self, buf, label=""):
        return buf
