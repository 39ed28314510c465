"""Start every rank from rank 0's state (never rely on equal seeds), and refuse ranks that disagree."""

import hashlib
import time

import numpy as np

from pydtnn.errors import ConfigError


def broadcast_state(comm, model, optimizer=None):
    """Copy rank 0's parameters, buffers and optimizer state (arrays, step, hyperparameters) to all ranks."""
    if comm.size == 1:
        return
    for _, arr in model.named_state():
        comm.bcast(arr, root=0)
    if optimizer is not None and optimizer.sharded:  # each holds its own shard: only the scalars are shared
        optimizer.load_scalars(comm.bcast_obj(optimizer.scalars(), root=0))
    elif optimizer is not None:
        state = optimizer.state_dict()
        for name in sorted(state["arrays"]):
            comm.bcast(state["arrays"][name], root=0)
        scalars = comm.bcast_obj(state["scalars"], root=0)
        optimizer.load_state_dict({"arrays": state["arrays"], "scalars": scalars})


def sample_digest(dataset, count=16):
    """'N samples of (C, H, W), K classes, sha256 ...': what identifies a dataset across ranks.

    The hash covers `count` samples spread over the dataset (their pixels as the evaluation view
    gives them, and their labels), so two nodes holding different copies of "the same" files differ.
    """
    n = len(dataset)
    idx = np.unique(np.linspace(0, n - 1, min(n, count)).astype(np.int64)) if n else np.zeros(0, np.int64)
    x, y = dataset.get_batch(idx, np.float64)
    digest = hashlib.sha256(np.ascontiguousarray(x).tobytes() + np.asarray(y, np.int64).tobytes()).hexdigest()
    return f"{n} samples of {tuple(dataset.input_shape)}, {dataset.num_classes} classes, sha256 {digest[:16]}"


def check_agreement(comm, facts, grace=5.0):
    """Raise ConfigError unless every rank holds the same `facts` ({name: JSON value}).

    The error names the first differing fact and each rank's value. Rank 0 raises it (and so ends the
    job with one line); the other ranks wait `grace` seconds for that before raising it themselves.
    """
    if comm.size == 1:
        return
    every = comm.allgather_obj(facts)
    for key in dict.fromkeys(k for f in every for k in f):  # rank 0's order: flags, then data, then model
        values = [f.get(key) for f in every]
        if all(v == values[0] for v in values):
            continue
        groups = {}
        for rank, v in enumerate(values):
            groups.setdefault(repr(v), []).append(rank)
        told = "; ".join(f"{_ranks(ranks)}: {v[:200]}" for v, ranks in groups.items())
        msg = (f"the processes disagree on {key} ({told}); start every process with the same flags, data and "
               f"checkpoint")
        if comm.rank != 0:
            time.sleep(grace)
        raise ConfigError(msg)


def _ranks(ranks):
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
