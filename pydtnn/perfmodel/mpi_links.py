"""The MPI side of calibrate.py: mpi_probe.py run under mpiexec, and the links fitted on its times.

    probe = run_mpi_probe(2, quick=True)              # {"np", "pingpong", "allreduce", "collectives"}
    alpha, beta = fit_alpha_beta(*zip(*probe["pingpong"]))
    links = collective_links(probe, gamma=1e-10)      # {op: Link}, each through collectives.py's ring formula

calibrate.py's docstring says what each fit means for the model.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np

from pydtnn.errors import PydtnnError
from pydtnn.perfmodel.kernel_timing import median_seconds
from pydtnn.perfmodel.machine import Link

MPI_TIMEOUT_S = 120.0
BURST_S = 2e-3  # compute between two collectives in the oversubscribed probe: a layer's worth, on one thread
FIT_ALGORITHM = "ring"  # the formula a collective's own link is fitted through (MPICH's for large messages)


def fit_alpha_beta(sizes, seconds):
    """(alpha, beta) of one-way time = alpha + n*beta by least squares over (n bytes, seconds) pairs.

    The residuals are relative (each divided by its measured time), so that the microsecond times of
    small messages set alpha as much as the millisecond ones of large messages set beta; with plain
    residuals a 1% error at 16 MiB outweighs every small message. A negative alpha (noise) is fitted
    again with alpha = 0. Raises ValueError unless there are two distinct sizes, every time is
    positive and beta comes out positive."""
    n = np.asarray(sizes, np.float64)
    t = np.asarray(seconds, np.float64)
    if n.ndim != 1 or n.shape != t.shape:
        raise ValueError(f"fit_alpha_beta: {n.shape[0] if n.ndim else 0} sizes and {t.size} times; expected "
                         "two lists of the same length")
    if len(np.unique(n)) < 2:
        raise ValueError(f"fit_alpha_beta: sizes {n.tolist()}; expected at least two distinct sizes")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n >= 0)):
        raise ValueError(f"fit_alpha_beta: times {t.tolist()}, sizes {n.tolist()}; expected times > 0, sizes >= 0")
    w = 1.0 / t
    (alpha, beta), *_ = np.linalg.lstsq(np.column_stack([w, n * w]), np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(n * w) / np.sum((n * w) ** 2))
    if not beta > 0:
        raise ValueError(f"fit_alpha_beta: the times {t.tolist()} do not grow with the sizes {n.tolist()} "
                         f"(fitted beta {beta:.3g} s/byte); expected bandwidth-bound large messages")
    return float(alpha), float(beta)


def fit_collective(op, p, sizes, seconds, gamma, algorithm=FIT_ALGORITHM):
    """Link (latency, bandwidth) that `op`'s `algorithm` formula (collectives.py) over p processes needs
    to give the measured (n bytes, seconds): each formula is a alpha + b n beta + c n gamma, so
    (t - c n gamma) / a = alpha + (b / a) n beta is fitted by fit_alpha_beta. ValueError as that one
    raises, or when gamma's share leaves no time to fit."""
    from pydtnn.perfmodel.collectives import FORMULAS

    formula = FORMULAS[op][algorithm]
    a, b, c = formula(0, p, 1.0, 0.0, 0.0), formula(1, p, 0.0, 1.0, 0.0), formula(1, p, 0.0, 0.0, 1.0)
    if a <= 0 or b <= 0:
        raise ValueError(f"fit_collective: {op} by {algorithm} over {p} processes has no latency or bandwidth term")
    rest = [(t - c * n * gamma) / a for n, t in zip(sizes, seconds)]
    if min(rest) <= 0:
        raise ValueError(f"fit_collective: {op} took {list(seconds)} s, no more than its reductions at "
                         f"{1 / gamma / 1e9:.2f} GB/s; expected times above the reduction's")
    alpha, beta = fit_alpha_beta([b / a * n for n in sizes], rest)
    return Link(latency_s=alpha, bandwidth_bytes_per_s=1.0 / beta)


def collective_links(probe, gamma):
    """{op: Link} fitted on the probe's "collectives" times (none for an older probe's result)."""
    return {op: fit_collective(op, probe["np"], *zip(*times), gamma)
            for op, times in (probe.get("collectives") or {}).items()}


def burst_work(seconds=BURST_S):
    """Units of mpi_probe.burst's work that take `seconds` here on one thread (the median of 5 timings)."""
    from pydtnn.perfmodel import mpi_probe

    a, b = np.zeros(mpi_probe.BURST_ELEMENTS, np.float32), np.ones(mpi_probe.BURST_ELEMENTS, np.float32)
    unit = median_seconds(lambda: mpi_probe.burst(100, a, b), 5) / 100
    return max(1, round(seconds / unit))


def mpiexec_path():
    """The mpiexec next to the Python in use (pip's mpich puts it there), else the first on PATH, else None."""
    mine = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return mine if os.access(mine, os.X_OK) else shutil.which("mpiexec")


def run_mpi_probe(np_, quick=False, timeout=MPI_TIMEOUT_S, extra=()):
    """The probe's result ({"np", "pingpong", "allreduce", "collectives"}, or with extra = ("--oversubscribed",
    ...) that mode's) from `mpiexec -n np_`; PydtnnError when it fails or runs past `timeout` seconds
    (its whole process group is then ended)."""
    cmd = [mpiexec_path(), "-n", str(np_), sys.executable, "-m", "pydtnn.perfmodel.mpi_probe"]
    cmd += (["--quick"] if quick else []) + list(extra)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    shown = " ".join(cmd[:3]) + " python -m pydtnn.perfmodel.mpi_probe"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        raise PydtnnError(f"the MPI probe ({shown}) did not finish in {timeout:g} s: MPI hangs or is very slow "
                          "here (under benchmarks/netem.py: is the burst at least 64 KiB?); raise --mpi_timeout "
                          "or pass --no_mpi to keep the base's links") from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise PydtnnError(f"the MPI probe ({shown}) failed with exit code {proc.returncode}: {last}")
    result = json.loads(lines[-1])
    if result["np"] != np_:
        raise PydtnnError(f"the MPI probe ran with {result['np']} processes under {shown}; the mpiexec found "
                          "belongs to another MPI than mpi4py's")
    return result


def _end_group(proc):
    """SIGTERM to the probe's process group (its own session), SIGKILL after 3 s."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 3)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
