"""Sharding a global batch over ranks so that every rank issues the same collectives, always."""


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
