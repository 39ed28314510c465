"""Sharding a global batch over ranks so that every rank issues the same collectives, always, and each takes
its part of every micro-batch (so N ranks' micro-batches are one process's)."""


def shard_bounds(n, size):
    """Offsets splitting n samples over `size` ranks as evenly as possible: rank r takes [o[r], o[r+1]).

    The first n % size ranks take one more; with n < size the last ranks take none (they still
    take part in every collective, with weight 0).
    """
    base, extra = divmod(n, size)
    out = [0]
    for r in range(size):
        out.append(out[-1] + base + (1 if r < extra else 0))
    return out


def micro_shares(n, micro_batches, size, rank):
    """[(lo, hi)]: the positions, in a global batch of n samples cut into micro_batches micro-batches as a step
    cuts it (step.micro_bounds), that rank `rank` of `size` takes: its shard_bounds share of each micro-batch.
    So the ranks' i-th parts make one process's i-th micro-batch, and statistics synchronized over the ranks
    per micro-batch (BatchNorm) are one process's. With one micro-batch, a contiguous share of the batch."""
    from pydtnn.step import micro_bounds

    out = []
    for a, b in micro_bounds(n, micro_batches):
        bounds = shard_bounds(b - a, size)
        out.append((a + bounds[rank], a + bounds[rank + 1]))
    return out


def local_rows(shares):
    """[(a, b)]: the rows of a rank's batch (its micro_shares put one after another) that each micro-batch takes."""
    out, at = [], 0
    for lo, hi in shares:
        out.append((at, at + hi - lo))
        at += hi - lo
    return out
