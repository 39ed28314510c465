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
    """[(a, b, lo, hi)]: for each micro-batch of a global batch of n samples (rows [a, b) of it, as a step cuts
    it: step.micro_bounds), the part rank `rank` of `size` takes: elements [lo, hi) of the micro-batch's
    samples in the epoch's order. The ranks' parts of micro-batch i make one process's micro-batch i, so
    statistics synchronized over the ranks per micro-batch (BatchNorm) are one process's; each micro-batch's
    remainder goes to the ranks after the last one's (rotating), so no rank is always the one with more.
    With one micro-batch, rank r's part is its shard_bounds share of the batch in the epoch's order."""
    from pydtnn.step import micro_bounds

    out = []
    for i, (a, b) in enumerate(micro_bounds(n, micro_batches)):
        base, extra = divmod(b - a, size)
        sizes = [base + ((r - i) % size < extra) for r in range(size)]
        lo = sum(sizes[:rank])
        out.append((a, b, lo, lo + sizes[rank]))
    return out


def local_rows(shares):
    """[(a, b)]: the rows of a rank's batch (its micro_shares' parts put one after another) each micro-batch takes."""
    out, at = [], 0
    for *_, lo, hi in shares:
        out.append((at, at + hi - lo))
        at += hi - lo
    return out
