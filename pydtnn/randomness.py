"""Training randomness keyed by each sample, not by process or step: the same draws at any process count.

    streams = SampleStreams(seed, epoch, indices)   # indices: the dataset rows of a batch, in its order
    streams.random(len(indices))                    # one uniform number per sample
    streams.integers(0, 9, len(indices))            # one integer in [0, 9) per sample
    streams.generator(i)                            # row i's own numpy Generator (per-image loops)
    streams.rows(key, lo, hi)                       # the streams of rows [lo, hi) under another key

Every sample of every epoch has its own counter-based generator (NumPy's Philox4x64-10): its key is
(seed, stream) and its counter starts at (0, 0, epoch, sample index), so no two samples, epochs or
streams ever share draws, and a sample's draws do not depend on which process holds it, on which step
or micro-batch it falls, or on the other samples of its batch. The trainer hands a batch's streams to
the dataset (augmentation: flips, crops, resized crops) and to the backend (dropout masks, one stream
per layer: the CRC-32 of the layer's path). So N data-parallel processes draw what one process draws,
and a resumed run draws what the uninterrupted run drew, with nothing to save.
"""

import zlib

import numpy as np

AUGMENT, DROPOUT = 0, 1  # stream kinds: the data's augmentation; a dropout layer's masks (xor its path's CRC)


def layer_stream(path):
    """The dropout stream of the layer at `path` (its dotted name in a Model)."""
    return (DROPOUT << 32) | zlib.crc32((path or "").encode())


class SampleStreams:
    """Per-sample generators of the rows of one batch (see the module docstring)."""

    def __init__(self, seed, epoch, indices, stream=AUGMENT):
        self.seed, self.epoch, self.stream = int(seed), int(epoch), int(stream)
        self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._gens = [None] * len(self.indices)

    def __len__(self):
        return len(self.indices)

    def generator(self, i):
        """Row i's Generator (made once, then drawn from in order)."""
        g = self._gens[i]
        if g is None:
            key = (self.seed & (2**64 - 1)) | (self.stream << 64)
            g = self._gens[i] = np.random.Generator(np.random.Philox(
                key=key, counter=[0, 0, self.epoch, int(self.indices[i])]))
        return g

    def rows(self, stream=None, lo=0, hi=None):
        """The streams of rows [lo, hi) of this batch, under another stream (a layer's) or this one."""
        return SampleStreams(self.seed, self.epoch, self.indices[lo:hi], self.stream if stream is None else stream)

    def _check(self, n):
        if n != len(self.indices):
            raise ValueError(f"{n} values asked of the streams of {len(self.indices)} samples; expected one per sample")

    # the Generator methods batch augmentation uses, one value per sample
    def random(self, n):
        self._check(n)
        return np.array([self.generator(i).random() for i in range(n)])

    def integers(self, low, high, n):
        self._check(n)
        return np.array([self.generator(i).integers(low, high) for i in range(n)], dtype=np.int64)

    def uniform_rows(self, shape, dtype=np.float32):
        """Uniform [0, 1) numbers of `shape` (rows first: one row per sample), each row from its sample."""
        self._check(shape[0])
        out = np.empty(shape, dtype)
        for i in range(shape[0]):
            out[i] = self.generator(i).random(shape[1:], dtype=dtype)
        return out
