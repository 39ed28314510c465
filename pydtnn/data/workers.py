"""A batch assembled by several threads: each reads, decodes, augments and normalizes a share of its samples.

    with BatchWorkers(8) as workers:                       # --data_workers 8
        x, y = workers.get_batch(train, idx, np.float32, SampleStreams(seed, epoch, idx))

The batch is one array made up front; each worker writes its contiguous share of rows straight into it
(datasets whose get_batch takes out=, as every pydtnn dataset does; others' shares are copied in), so
the finished batch is handed over as it is. Pillow and NumPy release the GIL while they decode, resize
and convert, so threads run in parallel where the time goes; nothing is pickled or copied between processes.

Every random draw of a training batch comes from its sample's own stream (pydtnn.randomness), so a
share drawn on its own equals the same rows of the whole batch: the batch is the same for any number
of workers, to the bit. A batch whose rng is a plain Generator (one stream for the batch) is not split.
"""

import inspect
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pydtnn.distributed.sampler import shard_bounds
from pydtnn.errors import ConfigError

MIN_ROWS = 2  # samples a worker's share holds at least: smaller batches use fewer workers


def check_workers(n):
    """n as an int >= 1; ConfigError naming the bad value otherwise."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"data_workers must be a positive integer (threads assembling each batch), got {n!r}")
    return int(n)


def takes_out(dataset):
    """Whether dataset.get_batch writes into a given array (an out= argument)."""
    try:
        return "out" in inspect.signature(dataset.get_batch).parameters
    except (TypeError, ValueError):
        return False


def splittable(rng):
    """Whether a batch drawn with `rng` may be drawn in shares: no randomness, or per-sample streams."""
    return rng is None or hasattr(rng, "rows")


class BatchWorkers:
    """n threads that assemble a batch in shares (n = 1: the calling thread, no pool). A context manager:
    the threads live until it exits."""

    def __init__(self, n=1):
        self.n = check_workers(n)
        self.pool = None

    def __enter__(self):
        if self.n > 1:
            self.pool = ThreadPoolExecutor(self.n, thread_name_prefix="pydtnn-decode")
        return self

    def __exit__(self, exc_type, *exc):
        if self.pool is not None:
            self.pool.shutdown(wait=exc_type is None, cancel_futures=True)
            self.pool = None

    def get_batch(self, dataset, idx, dtype=np.float32, rng=None):
        """dataset.get_batch(idx, dtype, rng), assembled by the workers: the same (x, y)."""
        idx = np.asarray(idx, dtype=np.int64)
        parts = min(self.n, len(idx) // MIN_ROWS)
        if self.pool is None or parts < 2 or not splittable(rng):
            return dataset.get_batch(idx, dtype, rng=rng)
        shape = getattr(dataset, "input_shape", None)
        if shape is None:  # a dataset that does not say its sample shape is read in one piece
            return dataset.get_batch(idx, dtype, rng=rng)
        bounds = shard_bounds(len(idx), parts)
        x = np.empty((len(idx),) + tuple(shape), dtype)
        direct = takes_out(dataset)

        def share(k):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            r = None if rng is None else rng.rows(lo=lo, hi=hi)
            if direct:
                return dataset.get_batch(idx[lo:hi], dtype, rng=r, out=x[lo:hi])[1]
            x[lo:hi], y = dataset.get_batch(idx[lo:hi], dtype, rng=r)
            return y

        ys = [f.result() for f in [self.pool.submit(share, k) for k in range(parts)]]  # a share's error, raised here
        return x, np.concatenate([np.asarray(y) for y in ys])  # the targets as the dataset gives them
