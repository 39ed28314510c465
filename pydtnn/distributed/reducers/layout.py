"""The reducers' messages as pure functions of the gradients' sizes (PyTorch's bucket assignment).

Each reducer lays out its messages with these functions, and the performance model (perfmodel/predict.py)
predicts the same messages from the same functions, through the registry (reducers/__init__.py: messages()),
so a prediction and a run cannot disagree about what is sent. Nothing here touches an array.

    bucket_layout([4000, 40, 80000], bucket_bytes=2**20, first_bytes=2**10)   # [(0, 1), (1, 3)]
    piece_bounds(10, 4, 16)                                                   # [(0, 4), (4, 8), (8, 10)]
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    """One collective a reducer issues each step: `collective` ("allreduce"; "allgather" for topk and oktopk;
    "alltoall" for oktopk), the gradients it carries (`params`: indices into the model's parameter list, or None for
    a message sent once the whole backward pass has ended), and `nbytes`, what each rank contributes (an alltoall's:
    what each rank scatters over all of them, about nbytes / P to each)."""

    collective: str
    params: tuple | None
    nbytes: int


def piece_bounds(count, itemsize, piece_bytes):
    """[(start, stop)] element ranges that cut a message of `count` elements of `itemsize` bytes into pieces
    of at most piece_bytes (at least one element each); one empty piece for an empty message."""
    step = max(1, piece_bytes // itemsize)
    return [(i, min(i + step, count)) for i in range(0, max(count, 1), step)]


def bucket_layout(sizes, bucket_bytes, first_bytes):
    """[(start, stop)] index ranges of `sizes` (gradient bytes, in the order the reducer packs them): a
    bucket closes before the gradient that would take it past first_bytes (the first bucket) or bucket_bytes
    (the others); a gradient larger than that is a bucket of its own."""
    buckets, start, cap, size = [], 0, first_bytes, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > cap:
            buckets.append((start, i))
            start, cap, size = i, bucket_bytes, 0
        size += n
    if start < len(sizes):
        buckets.append((start, len(sizes)))
    return buckets


def topk_counts(counts, density, selection):
    """Entries each rank sends per step, from the gradients' entry counts: [ceil(density x total)] with
    selection "global", or each gradient's own ceil(density x count) with "per_layer"; at least one each."""
    if selection == "per_layer":
        return [min(n, max(1, math.ceil(density * n))) for n in counts]
    total = sum(counts)
    return [min(total, max(1, math.ceil(density * total)))]


def _pieced(params, count, itemsize, piece_bytes):
    """The allreduce Messages of one run of `count` elements carrying gradients `params`, in pieces."""
    return [Message("allreduce", params, (b - a) * itemsize) for a, b in piece_bounds(count, itemsize, piece_bytes)]


def compressed(messages, counts, itemsize, wire_itemsize, piece_bytes):
    """`messages` (allreduces of gradients of `itemsize` bytes an entry) as they travel compressed to
    `wire_itemsize` bytes an entry (compression.FP16Compression: 2): each run of pieces carrying the same
    gradients is first one allreduce of a float64 scale per gradient (the scales' collective), then the
    same elements cut into pieces of the wire buffer."""
    out, i = [], 0
    while i < len(messages):
        j = i
        while j < len(messages) and messages[j].params == messages[i].params:
            j += 1
        params = messages[i].params
        count = sum(m.nbytes for m in messages[i:j]) // itemsize
        out.append(Message("allreduce", params, 8 * (len(counts) if params is None else len(params))))
        out += _pieced(params, count, wire_itemsize, piece_bytes)
        i = j
    return out


def blocking_messages(counts, itemsize, piece_bytes):
    """Every gradient in one buffer after backward, in pieces. counts: entries per gradient, parameter order."""
    return _pieced(None, sum(counts), itemsize, piece_bytes)


def per_layer_messages(counts, itemsize, piece_bytes):
    """One allreduce per gradient (in pieces), in parameter order; each starts as its layer's backward ends."""
    return [m for i, n in enumerate(counts) for m in _pieced((i,), n, itemsize, piece_bytes)]


def bucketed_messages(counts, itemsize, piece_bytes, bucket_mb, first_bucket_mb):
    """The buckets of bucket_layout over the gradients in reverse parameter order, each in pieces."""
    order = list(range(len(counts)))[::-1]
    out = []
    for a, b in bucket_layout([counts[i] * itemsize for i in order], bucket_mb * 2**20, first_bucket_mb * 2**20):
        out += _pieced(tuple(order[a:b]), sum(counts[i] for i in order[a:b]), itemsize, piece_bytes)
    return out


def stale_messages(counts, itemsize, piece_bytes):
    """Every gradient in one buffer after backward, in pieces, as blocking_messages; it has the next step's forward
    and backward to travel (the performance model: perfmodel/predict.py)."""
    return _pieced(None, sum(counts), itemsize, piece_bytes)


def topk_messages(counts, itemsize, piece_bytes, density, selection):
    """Two allgathers after backward: each rank's k int64 indices and k values (k from topk_counts)."""
    k = sum(topk_counts(counts, density, selection))
    return [Message("allgather", None, k * 8), Message("allgather", None, k * itemsize)]


def oktopk_messages(counts, itemsize, piece_bytes, density, threshold_every, repartition_every, replicas):
    """Ok-Topk's collectives after backward (OkTopkReducer.finish) over `replicas` ranks, k from topk_counts: the
    boundaries' allreduce (P - 1 float64) and the gathered magnitudes (every P-th of k from each, with their count) as
    their share of a step (once every repartition_every and threshold_every steps); the split's counts (an alltoall of
    one int64 to each rank) and its two alltoalls (k int64 indices, k values); the kept counts (one int64) and the balanced gather of
    about k / P indices and values from each rank."""
    k = sum(topk_counts(counts, density, "global"))
    share = math.ceil(k / replicas)
    return [Message("allreduce", None, math.ceil(8 * (replicas - 1) / repartition_every)),
            Message("allgather", None, math.ceil((8 + share * itemsize) / threshold_every)),
            Message("alltoall", None, 8 * replicas),
            Message("alltoall", None, k * 8), Message("alltoall", None, k * itemsize),
            Message("allgather", None, 8),
            Message("allgather", None, share * 8), Message("allgather", None, share * itemsize)]


def powersgd_matrices(shapes, rank, min_compression_rate):
    """[(n, m, r), or None] per gradient of these shapes: a gradient of two or more dimensions as the matrix of its
    first dimension by the rest (n x m; a convolution's Cout x Cin*kh*kw) at rank r = min(rank, n, m), where r
    makes it more than min_compression_rate times smaller ((n + m) r x rate < n m, PyTorch's rule); None for a
    gradient sent as it is (biases, normalizations' vectors, matrices too small to gain)."""
    out = []
    for shape in shapes:
        n = shape[0] if len(shape) >= 2 else 0
        m = math.prod(shape[1:]) if n else 0
        r = min(rank, n, m)
        out.append((n, m, r) if n and (n + m) * r * min_compression_rate < n * m else None)
    return out


def powersgd_counts(counts, mats):
    """(entries of the first message, of the second) for gradients of `counts` entries and their powersgd_matrices:
    every compressed gradient's P (n x r) and the entries of those sent as they are; every Q (m x r)."""
    first = sum(mat[0] * mat[2] if mat else count for count, mat in zip(counts, mats))
    return first, sum(mat[1] * mat[2] for mat in mats if mat)


def powersgd_messages(counts, itemsize, piece_bytes, rank, min_compression_rate, shapes):
    """Two allreduces after backward (powersgd_counts): every compressed gradient's P and the gradients sent as
    they are, then every Q; the second only where some gradient is compressed."""
    first, second = powersgd_counts(counts, powersgd_matrices(shapes, rank, min_compression_rate))
    out = _pieced(None, first, itemsize, piece_bytes)
    return out + (_pieced(None, second, itemsize, piece_bytes) if second else [])


def local_sgd_messages(counts, itemsize, piece_bytes, every, state_arrays=1):
    """Local SGD's average of the parameters and the optimizer's `state_arrays` arrays per parameter (1: SGD's
    momentum) every `every` steps, as the step it costs on average: one allreduce of 1 / every of their bytes (the
    first post_local steps of data parallelism are left out)."""
    return _pieced(None, math.ceil(sum(counts) * (1 + state_arrays) / every), itemsize, piece_bytes)
