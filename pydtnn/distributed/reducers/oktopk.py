"""Ok-Topk (Li and Hoefler, PPoPP 2022): a sparse allreduce whose bytes per process stay O(k) whatever the number
of processes P, with error feedback.

Each step every rank forms its accumulated gradient as topk does (topk.py: its weighted gradients plus what it has
not sent yet; with momentum correction the velocity), k = ceil(density x size), and then:

1. Local selection: the entries whose magnitude reaches the rank's local threshold, about k of them. The threshold
   is the k-th largest magnitude, found exactly when due and kept in between, unless it then selects fewer than
   0.8k or more than 1.25k entries (DRIFT; a rank's own decision: no message).
2. Split and reduce: the index range is cut into P regions that each hold about k / P of the selected entries (the
   boundaries: every rank's quantiles of its selected indices, averaged in one small allreduce when due). Each
   rank sends the selected entries of region j to rank j in one alltoallv (MPICH posts them to rotating
   destinations: rank r to r + 1, r + 2, ...), and rank j sums what arrives, in rank order.
3. Global selection: of its region's sums, rank j keeps those whose magnitude reaches the global threshold, an
   estimate of the k-th largest of all regions' sums: every rank sends every P-th of its region's k largest
   magnitudes (about k values in all, whatever P), and the sample at which the values they stand for (P each, and
   about (P - 1) / 2 a region beyond its last sample) reach k is the threshold. It is estimated when due, and after a step that kept fewer than 0.8k or more than
   1.25k entries in all (every rank knows the total from the gather's counts).
4. Balanced gather: one allgatherv of every region's kept entries (about k / P each), so every rank holds the same
   sparse sum, which becomes the gradients.

A rank clears from its accumulation only the entries it sent that the global selection kept (and their velocity):
what it did not select, and what it selected that the global selection dropped, joins the next step.

Bytes a process sends per step (sent_bytes, counted as the collectives send them: a ring allgather passes on every
block but its successor's): about k (P - 1) / P entries in the split and as many in the gather, each an int64 index
and a value, so about 2k entries whatever P, where topk's allgather sends k (P - 1). Typically no more than
2.5k (P - 1) / P: the thresholds' drift lets a rank select up to 1.25k and the regions keep up to 1.25k before
they are estimated again (a step whose global threshold drifted keeps what it keeps: the next step corrects it),
plus the regions' imbalance, the counts (one int64 to each rank) and, when due, the boundaries (P - 1 float64 in an
allreduce) and the magnitudes (about k / P from each rank). The paper bounds its version at 6k (P - 1) / P.

When due: the thresholds at the first step of each epoch and every threshold_every steps after it; the region
boundaries at the first step of each epoch and every repartition_every steps after it. A checkpoint is written at
the end of an epoch, so a resumed run re-estimates at the steps the whole run does: it is bit-identical. The
residuals (and velocities) are the checkpointed state, one row per rank, as topk's.

At density 1 every entry passes every threshold: the regions' sums are the dense sum, in rank order.
The arrays are the host's (NumPy): the registry gives this reducer the CPU only.
"""

import numpy as np

from pydtnn.distributed.reducers.topk import TopKReducer, largest
from pydtnn.errors import ConfigError

DRIFT = (0.8, 1.25)  # a threshold that selects (or keeps) outside these multiples of k is estimated again


def kth_largest(mag, k, sample=None):
    """The k-th largest value of the 1-D array mag; -inf when k >= mag.size (everything passes)."""
    if k >= mag.size:
        return -np.inf
    return mag[largest(mag, k, sample)].min()


def passing(mag, threshold):
    """Indices (ascending) of the magnitudes at or above threshold; above it where it is 0 (fewer than k nonzero
    entries: the zeros are not sent)."""
    return np.flatnonzero(mag > 0 if threshold == 0 else mag >= threshold)


def sampled_threshold(samples, stride, total, k):
    """The k-th largest of `total` values estimated from `samples`, every stride-th of each of `stride` ranks' largest
    in descending order (each stands for `stride` values at or above it): the m-th largest sample, where the m
    samples stand for m x stride values and the values between a rank's last sample above the threshold and the
    threshold, (stride - 1) / 2 a rank on average, make up the rest of k; -inf when total <= k (everything passes)."""
    if total <= k:
        return -np.inf
    ordered = np.sort(samples)[::-1]
    m = max(1, round((k - stride * (stride - 1) / 2) / stride))
    return ordered[min(ordered.size, m) - 1] if ordered.size else -np.inf


def region_bounds(quantiles, n):
    """[0, b_1, ..., b_{P-1}, n]: the P regions' boundaries from the sum over the ranks of their quantiles (P - 1
    values each, float64), averaged, kept in [0, n] and non-decreasing."""
    p = quantiles.size + 1
    cuts = np.maximum.accumulate(np.clip(np.floor(quantiles / p), 0, n).astype(np.int64))
    return np.concatenate([[0], cuts, [n]])


class OkTopkReducer(TopKReducer):
    name = "oktopk"

    def __init__(self, comm, density=0.01, compression="none", progress="test", momentum=0.0, warmup_epochs=0,
                 threshold_every=32, repartition_every=64):
        for what, value in (("threshold_every", threshold_every), ("repartition_every", repartition_every)):
            if int(value) != value or value < 1:
                raise ConfigError(f"oktopk {what}: a whole number of steps >= 1, got {value!r}")
        super().__init__(comm, density, compression, progress, momentum, warmup_epochs)
        self.threshold_every, self.repartition_every = int(threshold_every), int(repartition_every)
        self.epoch_step = 0  # steps since the epoch began: the re-estimations follow it
        self.local_threshold = self.global_threshold = self.bounds = None
        self.global_drift = False  # the last step kept outside DRIFT's multiples of k: estimate again

    def begin_epoch(self, epoch):
        super().begin_epoch(epoch)
        self.epoch_step = 0

    def _sent_gather(self, counts, itemsize):
        """Bytes this rank sends in an allgatherv of blocks of `counts` elements, as a ring sends them."""
        p, me = self.comm.size, self.comm.rank
        return (int(np.sum(counts)) - int(counts[(me + 1) % p])) * itemsize

    def _within(self, count):
        """Whether `count` entries are within DRIFT's multiples of k."""
        return DRIFT[0] * self.k <= count <= DRIFT[1] * self.k

    def _counts(self, size, label):
        """Every rank's `size`, in rank order (an allgatherv of one int64 each)."""
        p = self.comm.size
        counts = np.empty(p, np.int64)
        self.comm.allgatherv(np.array([size], np.int64), counts, [1] * p, label)
        self.sent_bytes += self._sent_gather(np.ones(p, np.int64), 8)
        return counts

    def _gather(self, send, counts, dtype, label):
        """Every rank's `send` (1-D, counts[r] elements from rank r) in rank order: one allgatherv."""
        out = np.empty(int(counts.sum()), dtype)
        self.comm.allgatherv(np.ascontiguousarray(send, dtype), out, counts, label)
        self.sent_bytes += self._sent_gather(counts, out.itemsize)
        return out

    def _repartition(self, idx, n):
        """The regions' boundaries from every rank's selected indices idx (sorted): one allreduce of P - 1 values."""
        p = self.comm.size
        if idx.size:
            quantiles = idx[(np.arange(1, p) * idx.size) // p].astype(np.float64)
        else:
            quantiles = np.arange(1, p) * (n / p)
        total = self.comm.allreduce_sum(quantiles.tolist(), "oktopk boundaries")
        self.sent_bytes += int(2 * (p - 1) / p * total.nbytes)  # as a ring allreduce sends it
        return region_bounds(total, n)

    def _split_and_reduce(self, idx, vals):
        """Send the selected entries (idx sorted, vals) of region j to rank j; sum what arrives into this rank's
        region of self.buf, in rank order. Returns the indices that arrived (sorted, unique)."""
        p, me = self.comm.size, self.comm.rank
        send_counts = np.diff(np.searchsorted(idx, self.bounds))
        recv_counts = np.empty(p, np.int64)
        self.comm.alltoallv(send_counts, [1] * p, recv_counts, [1] * p, "oktopk counts")
        got_idx = np.empty(int(recv_counts.sum()), np.int64)
        got_val = np.empty(got_idx.size, vals.dtype)
        self.comm.alltoallv(idx, send_counts, got_idx, recv_counts, "oktopk indices")
        self.comm.alltoallv(vals, send_counts, got_val, recv_counts, "oktopk values")
        away = int(send_counts.sum() - send_counts[me])
        self.sent_bytes += (p - 1) * 8 + away * (8 + vals.itemsize)
        lo, hi = int(self.bounds[me]), int(self.bounds[me + 1])
        region = self.buf[lo:hi]
        region[...] = 0
        at = 0
        for c in recv_counts.tolist():  # rank order: the same sums on every run
            region[got_idx[at:at + c] - lo] += got_val[at:at + c]  # indices are unique within a rank's block
            at += c
        arrived = np.zeros(hi - lo, bool)
        arrived[got_idx - lo] = True
        return lo + np.flatnonzero(arrived)

    def _global_threshold(self, smag):
        """The k-th largest magnitude of every region's sums (smag: this rank's), estimated from every P-th of each
        region's k largest, gathered: about k values in all, whatever P (sampled_threshold)."""
        p = self.comm.size
        top = np.sort(smag if smag.size <= self.k else smag[largest(smag, self.k)])[::-1]
        sizes = self._counts(top.size, "oktopk sizes")
        samples = top[p - 1::p]
        every = self._gather(samples, sizes // p, smag.dtype, "oktopk magnitudes")
        return sampled_threshold(every, p, int(sizes.sum()), self.k)

    def finish(self):
        self.order_done = True
        self.steps += 1
        acc = self._accumulate()
        n, due = acc.size, self.epoch_step % self.threshold_every == 0
        mag = np.abs(acc)
        idx = None if self.local_threshold is None or due else passing(mag, self.local_threshold)
        if idx is None or not self._within(idx.size):  # due, or drifted: this rank's decision alone
            self.local_threshold = kth_largest(mag, self.k, self.sample)
            idx = passing(mag, self.local_threshold)
        if self.bounds is None or self.epoch_step % self.repartition_every == 0:
            self.bounds = self._repartition(idx, n)
        vals = acc[idx]
        arrived = self._split_and_reduce(idx, vals)
        sums = self.buf[arrived]
        smag = np.abs(sums)
        if due or self.global_drift:
            self.global_threshold = self._global_threshold(smag)
        kept = passing(smag, self.global_threshold)
        counts = self._counts(kept.size, "oktopk kept counts")
        self.global_drift = not self._within(int(counts.sum()))  # every rank knows the total: all estimate next
        all_idx = self._gather(arrived[kept], counts, np.int64, "oktopk kept indices")
        all_val = self._gather(sums[kept], counts, acc.dtype, "oktopk kept values")
        self.bytes_reduced += int(idx.nbytes + vals.nbytes)
        self.buf[...] = 0
        self.buf[all_idx] = all_val  # the regions are disjoint: every index once, ascending
        if all_idx.size:  # the entries this rank sent that survived the global selection leave its residual
            pos = np.minimum(np.searchsorted(all_idx, idx), all_idx.size - 1)
            self._clear_sent(acc, idx[all_idx[pos] == idx])
        self.epoch_step += 1
        if self.views is not None:
            self._unpack(self.views, self.names)
