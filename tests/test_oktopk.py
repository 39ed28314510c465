"""Ok-Topk (--reduction oktopk): its arithmetic against a NumPy version of the algorithm over every rank's
gradients, density 1 equal to one process, its bytes per process flat in the process count where topk's grow, a
resumed run equal to an uninterrupted one, its messages as the performance model prices them, and what it
refuses."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_distributed import (  # noqa: F401 (single: a fixture)
    ENV,
    MPIEXEC,
    assert_same_parameters,
    launch,
    refused_in_one_line,
    resumed_equals_whole,
    single,
)

from pydtnn.distributed import reducers
from pydtnn.distributed.reducers.layout import oktopk_messages

WORKER = str(Path(__file__).with_name("oktopk_worker.py"))


def _run(n, out, *extra):
    r = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, WORKER, str(out), *extra], capture_output=True,
                       text=True, timeout=180, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return [np.load(out / f"rank{i}.npz") for i in range(n)]


def _kth(values, k):
    """The k-th largest of values; -inf where there are no more than k."""
    return -np.inf if k >= values.size else np.sort(values)[::-1][k - 1]


def _passing(mag, threshold):
    """The entries at or above threshold; above it where it is 0 (zeros are not sent)."""
    return np.flatnonzero(mag > 0 if threshold == 0 else mag >= threshold)


def _bounds(chosen, n):
    """The regions' boundaries: the average over the ranks of each rank's P-quantiles of its chosen indices."""
    p = len(chosen)
    q = sum(idx[(np.arange(1, p) * idx.size) // p].astype(float) for idx in chosen)
    return [0, *np.maximum.accumulate(np.floor(q / p)).astype(int).tolist(), n]


def _sampled(sums, arrived, bounds, k):
    """The global threshold: the sample, of every P-th of each region's k largest magnitudes (sorted), at which
    the values they stand for (P each, and (P - 1) / 2 a region beyond) reach k; -inf when no more than k sums
    arrived."""
    p, samples = len(bounds) - 1, []
    for j in range(p):
        mags = np.sort(np.abs(sums[bounds[j]:bounds[j + 1]][arrived[bounds[j]:bounds[j + 1]]]))[::-1][:k]
        samples += mags[p - 1::p].tolist()
    if arrived.sum() <= k:
        return -np.inf
    m = max(1, round((k - p * (p - 1) / 2) / p))  # m samples and (P - 1) / 2 a region beyond them: about k
    return sorted(samples, reverse=True)[min(len(samples), m) - 1]


def reference(given, k, threshold_every, repartition_every):
    """Ok-Topk over every rank's gradients `given` [(steps, n) per rank], each weighted 1/P, as the algorithm reads:
    per rank the accumulation (residual + weighted gradient) and its entries at or above the local threshold (the
    k-th largest magnitude, estimated every threshold_every steps or when the old one selects fewer than 0.8k or
    more than 1.25k); their sum over the ranks in rank order; the sums at or above the global threshold (sampled
    from each region, estimated every threshold_every steps or after a step that kept fewer than 0.8k or more than
    1.25k) kept;
    and each rank's residual cleared where it sent a kept entry. Returns ([result per step], [residual per rank])."""
    p, n = len(given), given[0].shape[1]
    residual = [np.zeros(n) for _ in range(p)]
    local, results, global_th, drift, bounds = [None] * p, [], None, False, None
    for step in range(given[0].shape[0]):
        due = step % threshold_every == 0
        acc = [residual[r] + given[r][step] / p for r in range(p)]
        sums, arrived, chosen = np.zeros(n), np.zeros(n, bool), []
        for r in range(p):
            idx = None if due else _passing(np.abs(acc[r]), local[r])
            if idx is None or not 0.8 * k <= idx.size <= 1.25 * k:
                local[r] = _kth(np.abs(acc[r]), k)
                idx = _passing(np.abs(acc[r]), local[r])
            sums[idx] += acc[r][idx]
            arrived[idx] = True
            chosen.append(idx)
        if step % repartition_every == 0:
            bounds = _bounds(chosen, n)
        if due or drift:
            global_th = _sampled(sums, arrived, bounds, k)
        kept = np.zeros(n, bool)
        kept[_passing(np.where(arrived, np.abs(sums), -1.0), global_th)] = True
        drift = not 0.8 * k <= kept.sum() <= 1.25 * k
        results.append(np.where(kept, sums, 0.0))
        for r in range(p):
            acc[r][chosen[r][kept[chosen[r]]]] = 0
        residual = acc
    return results, residual


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_oktopk_arithmetic_equals_a_numpy_version_over_every_ranks_gradients(tmp_path, n):
    """Six steps at density 0.05 (k = 22 of 427 entries), thresholds re-estimated every 2 steps and regions every 3:
    every rank ends each step with the reference's sparse sum, and its own residual."""
    ranks = _run(n, tmp_path, "--density", "0.05", "--steps", "6", "--threshold_every", "2",
                 "--repartition_every", "3")
    k = int(ranks[0]["k"])
    assert k == 22
    results, residual = reference([r["given"] for r in ranks], k, 2, 3)
    for r, saved in enumerate(ranks):
        for step, want in enumerate(results):
            np.testing.assert_allclose(saved["got"][step], want, rtol=1e-12, atol=1e-15, err_msg=f"rank {r} {step}")
        np.testing.assert_allclose(saved["residual"], residual[r], rtol=1e-12, atol=1e-15, err_msg=f"rank {r}")
    kept = [np.count_nonzero(x) for x in results]
    assert all(k // 2 <= c <= 3 * k for c in kept), kept  # a sparse sum of about k entries, not all or nothing
    assert all(np.any(res) for res in residual)  # and something left behind


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_oktopk_at_density_one_equals_one_process(single, tmp_path, n):  # noqa: F811 (the fixture)
    r = launch(n, tmp_path, "--strategies", "oktopk", "--density", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_parameters(single, tmp_path, ("oktopk",), what=f"np={n}")


@pytest.mark.slow
def test_oktopk_bytes_per_process_stay_flat_where_topks_grow(tmp_path):
    """At density 0.01 of 60,007 entries (k = 601), over 5 steps of independent draws (the thresholds estimated at
    the first, then again only where they drift): each process sends between 2k (P - 1) / P entries of 16 bytes and
    Ok-Topk's bound of 6k (P - 1) / P with oktopk, and k (P - 1) with topk, as a ring allgather sends them."""
    sent = {}
    for strategy in ("oktopk", "topk"):
        for n in (2, 4):
            out = tmp_path / f"{strategy}{n}"
            out.mkdir()
            ranks = _run(n, out, "--strategy", strategy, "--density", "0.01", "--size", "8572", "--steps", "5",
                         "--threshold_every", "32", "--repartition_every", "64")
            sent[strategy, n] = max(float(r["sent"][-1]) for r in ranks) / 5
            k = int(ranks[0]["k"])
    assert k == 601
    assert sent["topk", 2] == 601 * 16 and sent["topk", 4] == 3 * 601 * 16  # k (P - 1) entries, as a ring sends them
    for n in (2, 4):  # between the split and gather of k each and Ok-Topk's bound, 6k (P - 1) / P
        assert 2 * k * 16 * (n - 1) / n < sent["oktopk", n] < 6 * k * 16 * (n - 1) / n, (n, sent)
    assert sent["oktopk", 4] < sent["topk", 4], sent


def test_oktopk_messages_are_those_the_model_prices():
    counts = [40000, 100]
    sent = oktopk_messages(counts, 4, 1 << 24, 0.01, 32, 64, 4)  # k = 401
    assert [(m.collective, m.nbytes) for m in sent] == [
        ("allreduce", 1), ("allgather", 13), ("alltoall", 32), ("alltoall", 401 * 8), ("alltoall", 401 * 4),
        ("allgather", 8), ("allgather", 101 * 8), ("allgather", 101 * 4)]
    priced = reducers.messages("oktopk", counts, 4, replicas=4, density=0.01)
    assert [m.nbytes for m in priced] == [m.nbytes for m in sent]
    with pytest.raises(Exception, match="expected replicas >= 1, got None"):
        reducers.messages("oktopk", counts, 4)


@pytest.mark.parametrize("flags, words", [
    (["--reduction", "topk", "--oktopk_threshold_every", "8"],
     "--oktopk_threshold_every applies to the oktopk reducer over several processes"),
    pytest.param(["--reduction", "oktopk", "--zero", "1"], "oktopk leaves each replica its own residual",
                 marks=pytest.mark.slow),
    pytest.param(["--reduction", "oktopk", "--gradient_compression", "fp16"], "oktopk reducer: compression 'fp16'",
                 marks=pytest.mark.slow),
])
def test_oktopk_refuses_what_it_cannot_take_in_one_line(tmp_path, flags, words):
    refused_in_one_line(tmp_path, flags, words)


@pytest.mark.slow
def test_an_oktopk_run_resumes_bit_identically(tmp_path):
    """The residuals and velocities (one row per rank) are saved at the end of an epoch; the thresholds and regions
    are estimated again at each epoch's first step, so 1 + 1 epochs end exactly where 2 do."""
    base = [MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn", "--dataset", "mnist5k",
            "--dtype", "float64", "--global_batch_size", "32", "--steps_per_epoch", "5", "--progress", "false",
            "--reduction", "oktopk", "--density", "0.05", "--oktopk_threshold_every", "2",
            "--oktopk_repartition_every", "3", "--momentum_correction", "true"]

    def something_left(saved):
        assert saved["@reducer.residual"].shape[0] == 2 and saved["@reducer.residual"].any()
        assert saved["@reducer.velocity"].any()

    resumed_equals_whole(base, tmp_path, something_left)
