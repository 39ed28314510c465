"""MPI timings for `pydtnn-perfmodel calibrate`, run under mpiexec (at least 2 processes):

    mpiexec -n 2 python -m pydtnn.perfmodel.mpi_probe [--quick] [--max_bytes 16777216]
    mpiexec -n 4 python -m pydtnn.perfmodel.mpi_probe --oversubscribed --burst_work 2000

Rank 0 prints one JSON line to stdout:

    {"np": 2, "pingpong": [[bytes, one-way seconds], ...], "allreduce": [[bytes, seconds], ...],
     "collectives": {"allgather": [[bytes, seconds], ...], "reduce_scatter": [...], "allreduce": [...]}}

pingpong: rank 0 sends n bytes to rank 1, which sends them back (the other ranks wait); the one-way
time is half the round trip. allreduce: an in-place float32 sum over every rank, n bytes per rank; its
time is the slowest rank's. collectives: the operations model parallelism runs, through pydtnn's own
communicator (distributed/comm.py's MPIComm, with the trainer's default stall_timeout, so that a wait
polls as it does in training), n bytes being the whole vector as collectives.py counts it: allgather
(Allgatherv, n / p float32 bytes from each rank), reduce_scatter (Reduce_scatter, n bytes in, n / p
out) and allreduce (n bytes in place). Each figure is the median over several batches of k
repetitions, k chosen from a first timing so that a batch lasts about TARGET_BATCH_S (one repetition
at least).

--oversubscribed (run with more ranks than cores): the cost of one collective where ranks share cores.
Every rank runs `rounds` bursts of --burst_work in-cache additions (the compute between two
collectives); once with a small allreduce (8 bytes, through MPIComm) after each burst, once without.
The extra seconds per burst are that collective's cost under oversubscription: the wait, at a point
where every rank must run, for the ranks that the scheduler has off the cores while waiting ranks
poll. It prints {"np", "burst_work", "rounds", "with_s", "without_s", "collective_s"} (seconds per
burst, medians over batches, the slowest rank's).
"""

import argparse
import json
import statistics
import sys

import numpy as np

TARGET_BATCH_S = 0.005
MAX_REPEATS = 1000  # per batch
TRAINER_STALL_TIMEOUT_S = 300.0  # pydtnn-train's default --stall_timeout: waits poll (stall_watch.StallWatch.wait)
COLLECTIVES = ("allgather", "reduce_scatter", "allreduce")
BURST_ELEMENTS = 4096  # float32 elements added per unit of burst work: 16 KiB, in cache


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


def collective(comm, op, n, batches):
    """Median seconds of `op` (COLLECTIVES) on n bytes (the whole vector) through pydtnn's communicator
    `comm` (MPIComm), the slowest rank's."""
    from mpi4py import MPI

    p, elements = comm.size, max(comm.size, n // 4)
    counts = [elements // p + (r < elements % p) for r in range(p)]  # as the channel blocks are cut
    whole = np.ones(elements, np.float32)
    mine = np.ones(counts[comm.rank], np.float32)
    calls = {"allgather": lambda: comm.allgatherv(mine, whole, counts, "probe"),
             "reduce_scatter": lambda: comm.reduce_scatterv(whole, mine, counts, "probe"),
             "allreduce": lambda: comm.allreduce(whole, "probe")}
    call = calls[op]

    def run(k):
        comm.comm.Barrier()
        start = MPI.Wtime()
        for _ in range(k):
            call()
        return comm.comm.allreduce((MPI.Wtime() - start) / k, op=MPI.MAX)

    run(1)
    k = _repeats(comm.comm, run(1))
    return statistics.median(run(k) for _ in range(batches))


def burst(work, a, b):
    """`work` in-cache additions of BURST_ELEMENTS float32 (a += b): one thread of compute."""
    for _ in range(work):
        np.add(a, b, out=a)


def oversubscribed(comm, work, rounds, batches):
    """{"with_s", "without_s", "collective_s"}: seconds per burst of `work` with and without an 8-byte
    allreduce after it (medians over `batches` of `rounds` bursts, the slowest rank's), and their
    difference."""
    from mpi4py import MPI

    a, b = np.zeros(BURST_ELEMENTS, np.float32), np.full(BURST_ELEMENTS, 1e-7, np.float32)
    small = np.zeros(2, np.float32)

    def run(sync):
        comm.comm.Barrier()
        start = MPI.Wtime()
        for _ in range(rounds):
            burst(work, a, b)
            if sync:
                comm.allreduce(small, "probe")
        comm.comm.Barrier()  # the slowest rank's bursts are in every rank's time
        return (MPI.Wtime() - start) / rounds

    run(True), run(False)
    times = {True: [], False: []}
    for _ in range(batches):  # interleaved, so that a load that comes and goes falls on both alike
        for sync in (True, False):
            times[sync].append(run(sync))
    with_s, without_s = statistics.median(times[True]), statistics.median(times[False])
    return {"with_s": with_s, "without_s": without_s, "collective_s": max(0.0, with_s - without_s)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pydtnn.perfmodel.mpi_probe",
                                description="MPI ping-pong and allreduce times (run under mpiexec -n 2 or more).")
    p.add_argument("--quick", action="store_true", help="fewer sizes and batches")
    p.add_argument("--max_bytes", type=int, default=16 << 20, help="largest message (default 16 MiB)")
    p.add_argument("--oversubscribed", action="store_true",
                   help="time a small collective between bursts of compute instead (run with more ranks than cores)")
    p.add_argument("--burst_work", type=int, default=1000,
                   help=f"with --oversubscribed: additions of {BURST_ELEMENTS} float32 per burst (default 1000)")
    p.add_argument("--rounds", type=int, default=40, help="with --oversubscribed: bursts per batch (default 40)")
    args = p.parse_args(argv)

    from mpi4py import MPI

    from pydtnn.distributed.comm import MPIComm

    comm = MPI.COMM_WORLD
    if comm.size < 2:
        print(f"mpi_probe: error: {comm.size} process; the ping-pong needs at least 2 (mpiexec -n 2 ...), "
              "and an mpiexec of the MPI mpi4py uses", file=sys.stderr, flush=True)
        return 2
    batches = 3 if args.quick else 5
    trainer_comm = MPIComm(comm, stall_timeout=TRAINER_STALL_TIMEOUT_S)
    if args.oversubscribed:
        result = {"np": comm.size, "burst_work": args.burst_work, "rounds": args.rounds,
                  **oversubscribed(trainer_comm, args.burst_work, args.rounds, batches)}
        if comm.rank == 0:
            print(json.dumps(result), flush=True)
        return 0
    result = measure(comm, trainer_comm, args.max_bytes, args.quick)
    if comm.rank == 0:
        print(json.dumps(result), flush=True)
    return 0


def measure(comm, trainer_comm, max_bytes=16 << 20, quick=False):
    """{"np", "pingpong", "allreduce", "collectives"}: the times of every size up to max_bytes, over mpi4py
    communicator `comm` and its pydtnn Communicator `trainer_comm` (a collective: every rank calls it; the
    ping-pong runs between ranks 0 and 1). calibrate fits the links on rank 0's."""
    batches = 3 if quick else 5
    result = {"np": comm.size, "pingpong": [], "allreduce": [], "collectives": {op: [] for op in COLLECTIVES}}
    for n in sizes(max_bytes, quick):
        result["pingpong"].append([n, pingpong(comm, n, batches)])
    for n in sizes(max_bytes, quick):
        result["allreduce"].append([n, allreduce(comm, n, batches)])
    for op in COLLECTIVES:
        for n in sizes(max_bytes, quick):
            result["collectives"][op].append([n, collective(trainer_comm, op, n, batches)])
    return result


if __name__ == "__main__":
    sys.exit(main())
