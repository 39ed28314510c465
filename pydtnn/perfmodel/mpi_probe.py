"""MPI timings for `pydtnn-perfmodel calibrate`, run under mpiexec (at least 2 processes):

    mpiexec -n 2 python -m pydtnn.perfmodel.mpi_probe [--quick] [--max_bytes 16777216]

Rank 0 prints one JSON line to stdout:

    {"np": 2, "pingpong": [[bytes, one-way seconds], ...], "allreduce": [[bytes, seconds], ...]}

pingpong: rank 0 sends n bytes to rank 1, which sends them back (the other ranks wait); the one-way
time is half the round trip. allreduce: an in-place float32 sum over every rank, n bytes per rank; its
time is the slowest rank's. Each figure is the median over several batches of k repetitions, k chosen
from a first timing so that a batch lasts about TARGET_BATCH_S (one repetition at least).
"""

import argparse
import json
import statistics
import sys

import numpy as np

TARGET_BATCH_S = 0.005
MAX_REPEATS = 1000  # per batch


def sizes(max_bytes, quick):
    """Message sizes in bytes: 8, 32, 128, ... (8, 64, 512, ... with quick), then max_bytes."""
    step = 8 if quick else 4
    out, n = [], 8
    while n < max_bytes:
        out.append(n)
        n *= step
    return out + [max_bytes]


def _repeats(comm, first_s):
    """Repetitions per batch, decided by rank 0 from one timing and sent to every rank."""
    k = max(1, min(MAX_REPEATS, int(TARGET_BATCH_S / max(first_s, 1e-9)))) if comm.rank == 0 else None
    return comm.bcast(k, root=0)


def pingpong(comm, n, batches):
    """Median one-way seconds of an n-byte message between ranks 0 and 1 (None on other ranks)."""
    from mpi4py import MPI

    buf = np.zeros(n, np.uint8)

    def round_trips(k):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(k):
            if comm.rank == 0:
                comm.Send(buf, dest=1, tag=1)
                comm.Recv(buf, source=1, tag=2)
            elif comm.rank == 1:
                comm.Recv(buf, source=0, tag=1)
                comm.Send(buf, dest=0, tag=2)
        return (MPI.Wtime() - start) / (2 * k)

    round_trips(1)  # the first message of a size sets up buffers and protocol
    k = _repeats(comm, round_trips(1))
    times = [round_trips(k) for _ in range(batches)]
    return statistics.median(times) if comm.rank == 0 else None


def allreduce(comm, n, batches):
    """Median seconds of an in-place float32 sum allreduce of n bytes per rank (slowest rank's time)."""
    from mpi4py import MPI

    buf = np.ones(max(1, n // 4), np.float32)

    def run(k):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(k):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return comm.allreduce((MPI.Wtime() - start) / k, op=MPI.MAX)

    run(1)
    k = _repeats(comm, run(1))
    return statistics.median(run(k) for _ in range(batches))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pydtnn.perfmodel.mpi_probe",
                                description="MPI ping-pong and allreduce times (run under mpiexec -n 2 or more).")
    p.add_argument("--quick", action="store_true", help="fewer sizes and batches")
    p.add_argument("--max_bytes", type=int, default=16 << 20, help="largest message (default 16 MiB)")
    args = p.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size < 2:
        print(f"mpi_probe: error: {comm.size} process; the ping-pong needs at least 2 (mpiexec -n 2 ...), "
              "and an mpiexec of the MPI mpi4py uses", file=sys.stderr, flush=True)
        return 2
    batches = 3 if args.quick else 5
    result = {"np": comm.size, "pingpong": [], "allreduce": []}
    for n in sizes(args.max_bytes, args.quick):
        t = pingpong(comm, n, batches)
        result["pingpong"].append([n, t])
    for n in sizes(args.max_bytes, args.quick):
        result["allreduce"].append([n, allreduce(comm, n, batches)])
    if comm.rank == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
