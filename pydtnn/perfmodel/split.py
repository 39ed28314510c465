"""Predicted training step of model and hybrid parallelism, as pydtnn/distributed/model_parallel.py runs them.

    p = predict(model, batch_size=32, np=4, machine=m, parallel="hybrid", model_parallel_size=2)

The rewrite comes from model_parallel.plan(model, M), the same walk partition() applies, so the model
follows the code: M processes per group, np / M replicas (data parallel across groups), batch_size
samples per replica, all of them seen by every process of its group.

Compute. Every layer costs what it costs whole (costs.py) at the replica's batch, times the share of its
channels that the group's rank 0 computes (the most loaded: the first C mod M ranks hold one channel
more); a layer that needs its whole input (Flatten, blocks' sums and concatenations, layers it does not
split) costs what it costs whole. Fixed costs count the inserted layers' calls too.

Communication in a group (blocking, on the critical path: nothing overlaps it). For each gather before
a layer that needs a whole tensor of E elements per sample: an allgather of batch x E elements forward;
backward, a reduce-scatter of the same size where the next layer is split (else nothing: each rank keeps
its slice). For each sum of dx: an allreduce of batch x E elements in backward. Groups are consecutive
ranks: the intra-node link while M fits on a node, the inter-node one otherwise.

Across groups (hybrid): each replica's gradients, the split layers' slices (their share of the bytes),
are reduced over the np / M replicas by the reducer, as in data parallelism (predict.py), on the link
the whole job uses.
"""

from pydtnn.errors import ConfigError
from pydtnn.perfmodel import collectives
from pydtnn.perfmodel.costs import PhaseCost, parameter_bytes


def group_size(parallel, np, model_parallel_size):
    """M: processes per model replica, checked as the trainer checks it."""
    if parallel == "model":
        if model_parallel_size not in (None, np):
            raise ConfigError(f"parallel=model splits every layer over all {np} processes; model_parallel_size "
                              f"{model_parallel_size} needs parallel=hybrid")
        return np
    if model_parallel_size is None:
        raise ConfigError("parallel=hybrid needs model_parallel_size (processes per model replica)")
    if isinstance(model_parallel_size, bool) or not isinstance(model_parallel_size, int) or model_parallel_size < 1:
        raise ConfigError(f"model_parallel_size={model_parallel_size!r}; expected a positive integer")
    if np % model_parallel_size:
        raise ConfigError(f"model_parallel_size {model_parallel_size} does not divide np {np}")
    return model_parallel_size


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
    return out


def shares(model, steps):
    """({layer path: share of it rank 0 computes}, {layer path: its gradients' bytes on rank 0})."""
    fraction = {s["layer"]: s["fraction"] for s in steps if "kind" in s}
    grads = {path: int(round(n * fraction.get(path, 1.0))) for path, n in parameter_bytes(model).items()}
    return fraction, grads


def scaled(phase, f):
    """A PhaseCost times the share f of the layer one process computes."""
    return phase if f == 1.0 else PhaseCost(int(round(phase.flops * f)), int(round(phase.bytes * f)))
