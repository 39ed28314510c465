"""Launch helpers: world discovery, one BLAS thread per rank, abort-on-exception.

A plain `python` run needs no MPI: MPI is initialised only when a launcher's environment variables
say there are several processes (mpiexec/mpirun of MPICH or Open MPI, Slurm's srun).
"""

import os
import sys
import traceback

from pydtnn.distributed.comm import MPIComm, SingleProcess, abort_job
from pydtnn.errors import ConfigError, PydtnnError

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def launched_size():
    """Process count announced by the launcher's environment (1 for a plain run)."""
    for var in _SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            if var == "SLURM_NTASKS" and "SLURM_STEP_ID" not in os.environ:
                continue  # inside an allocation but not started by srun
            return int(os.environ[var])
    return 1


def init(threads=1, stall_timeout=300.0, debug_collectives=False):
    """The world communicator; limits BLAS to `threads` threads per process when there are several.

    stall_timeout (seconds; 0 or None: off) and debug_collectives: see distributed.comm.MPIComm.
    """
    if launched_size() <= 1:
        return SingleProcess()
    try:
        comm = MPIComm(stall_timeout=stall_timeout or None, debug=debug_collectives)
    except ImportError:
        raise ConfigError("launched with several processes but mpi4py is missing; pip install mpi4py mpich") from None
    if threads:
        limit_blas_threads(threads)
    return comm


def limit_blas_threads(n):
    """n threads per rank for the CPU backend, one by default: measured here, 2 ranks x 2 threads
    lose 10-30%. The backend's own pool splits the work (backends/threads.py); BLAS runs one
    thread inside each chunk."""
    from pydtnn.backends.threads import set_threads

    set_threads(n)


def start():
    """Under a launcher of several processes: bring MPI up and make any uncaught exception end the job.

    The command line calls this first, before a flag is parsed or a file is read: a rank that fails
    before MPI is up cannot abort the others, which would then wait in MPI_Init forever. Without a
    multi-process launcher (or without mpi4py, which init() then reports) it does nothing.
    """
    if launched_size() <= 1:
        return
    try:
        from mpi4py import MPI
    except ImportError:
        return
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        _abort_on_exception(world.Get_rank(), lambda code: abort_job(world, code))


def abort_others(now=False, code=2):
    """In a multi-process MPI run: the rank (now=False), or end every process with `code` (now=True).

    A user error found by one rank alone (a bad path only rank 0 writes to, a diverging loss) would
    otherwise leave the other ranks waiting in their next collective. Returns None without MPI.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return None
    if now:
        abort_job(mpi.COMM_WORLD, code)
    return mpi.COMM_WORLD.Get_rank()


def install_abort_handler(comm):
    """Any uncaught exception on any rank prints `rank R: <error>` and aborts the whole job.

    Without it, the other ranks would wait forever in their next collective.
    """
    if comm.size > 1:
        _abort_on_exception(comm.rank, comm.abort)


def _abort_on_exception(rank, abort):
    def hook(kind, value, tb):
        if issubclass(kind, PydtnnError):
            msg = f"pydtnn: error: rank {rank}: {' '.join(str(value).split())}"
        elif issubclass(kind, KeyboardInterrupt):
            msg = f"pydtnn: error: rank {rank}: interrupted; ending the job"
        else:
            msg = f"rank {rank}: " + "".join(traceback.format_exception(kind, value, tb)).rstrip()
        print(msg, file=sys.stderr, flush=True)
        abort(2 if issubclass(kind, PydtnnError) else 130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook
