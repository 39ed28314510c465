"""Launch helpers: world discovery, CPU threads per rank (pydtnn.runtime), abort-on-exception.

A plain `python` run needs no MPI: MPI is initialised only when a launcher's environment variables
say there are several processes (mpiexec/mpirun of MPICH or Open MPI, Slurm's srun).
"""

import os
import sys
import time
import traceback
import warnings

from pydtnn.distributed.comm import MPIComm, SingleProcess, abort_job
from pydtnn.errors import ConfigError, PydtnnError

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")

# A failing rank other than 0 waits this long before it speaks: when every rank meets the same error
# (a bad flag), rank 0's report and abort end the job first, and the job prints one line, not N.
GRACE_S = 2.0


def _launch_var():
    """(variable, process count) announced by the launcher's environment; (None, 1) for a plain run."""
    for var in _SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            if var == "SLURM_NTASKS" and "SLURM_STEP_ID" not in os.environ:
                continue  # inside an allocation but not started by srun
            return var, int(os.environ[var])
    return None, 1


def launched_size():
    """Process count announced by the launcher's environment (1 for a plain run)."""
    return _launch_var()[1]


def launched_rank():
    """This process's rank as the launcher's environment announces it (0 for a plain run)."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _mpi():
    """mpi4py's MPI module, initialised; ConfigError when the launcher and MPI disagree on the world.

    MPICH's own abort line ("Abort(2) on node ...: application called MPI_Abort ...") repeats the
    one pydtnn prints, so it is suppressed unless the user set the variable (abort_job hides the rest).
    mpi4py's warning about a suspicious environment is replaced by the one-line error below.
    """
    os.environ.setdefault("MPIR_CVAR_SUPPRESS_ABORT_MESSAGE", "1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "suspicious MPI execution environment", RuntimeWarning)
        from mpi4py import MPI
    var, n = _launch_var()
    if n > 1 and MPI.COMM_WORLD.Get_size() == 1:
        raise ConfigError(_mismatch(MPI, var, n))
    return MPI


def _mismatch(mpi, var, n):
    """The launcher-mismatch message: which MPI mpi4py uses and which launcher belongs to it."""
    library = " ".join(mpi.Get_library_version().splitlines()[0].split())
    try:
        import mpi4py

        built = mpi4py.get_config().get("mpicc")
    except Exception:  # get_config is informative only
        built = None
    mine = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if "open mpi" in library.lower():
        launcher = "Open MPI's mpirun"
    elif os.access(mine, os.X_OK):
        launcher = mine
    else:
        launcher = "the mpiexec of that MPI"
    return (f"the launcher announced {n} processes ({var}={os.environ[var]}) but MPI sees 1 in each, so every "
            f"process would train alone: mpi4py uses {library}" + (f" (built with {built})" if built else "")
            + f" and the launcher belongs to another MPI; start with {launcher} -n {n} ..., or install mpi4py "
            f"built against the launcher's MPI (docs/distributed.md, Launchers)")


def init(threads=1, stall_timeout=300.0, debug_collectives=False):
    """The world communicator; with several processes, `threads` CPU threads per process
    (pydtnn.runtime.configure: measured here, 2 ranks x 2 threads lose 10-30% against 2 x 1).

    stall_timeout (seconds; 0 or None: off) and debug_collectives: see distributed.comm.MPIComm.
    `threads` is the command line's --threads_per_process: more than the process can use is a ConfigError
    naming it, at any process count.
    """
    if threads:
        from pydtnn.backends.cpu.threads import check_threads

        check_threads(threads, "--threads_per_process")
    if launched_size() <= 1:
        return SingleProcess()
    try:
        _mpi()
    except ImportError:
        raise ConfigError("launched with several processes but mpi4py is missing; pip install mpi4py mpich") from None
    comm = MPIComm(stall_timeout=stall_timeout or None, debug=debug_collectives)
    if threads:
        from pydtnn import runtime

        runtime.configure(threads=threads)
    return comm


def start():
    """Under a launcher of several processes: bring MPI up and make any uncaught exception end the job.

    The command line calls this first, before a flag is parsed or a file is read: a rank that fails
    before MPI is up cannot abort the others, which would then wait in MPI_Init forever. Without a
    multi-process launcher (or without mpi4py, which init() then reports) it does nothing.
    Raises ConfigError when the launcher announced several processes but MPI sees one in each (a
    launcher of another MPI than mpi4py's): each would otherwise train alone, silently.
    """
    if launched_size() <= 1:
        return
    try:
        mpi = _mpi()
    except ImportError:
        return
    world = mpi.COMM_WORLD
    if world.Get_size() > 1:
        _abort_on_exception(world.Get_rank(), lambda code: abort_job(world, code))


def _world():
    """MPI's world communicator when this process is one of several under MPI, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return None
    return mpi.COMM_WORLD


def abort_others(now=False, code=2):
    """In a multi-process MPI run: the rank (now=False), or end every process with `code` (now=True).

    A user error found by one rank alone (a bad path only rank 0 writes to, a diverging loss) would
    otherwise leave the other ranks waiting in their next collective. Returns None without MPI.
    """
    world = _world()
    if world is None:
        return None
    if now:
        abort_job(world, code)
    return world.Get_rank()


def fail(message, code):
    """Report `message` as one line `pydtnn: error: [rank R: ]message` and end the run with `code`.

    One process: prints and returns `code`. Several under MPI: ends every rank (MPI_Abort). When
    every rank fails alike (a bad flag), the job prints one line, rank 0's: the others wait GRACE_S
    first, and rank 0's abort ends them before they speak; a rank that fails alone speaks after the
    wait. Processes that a mismatched launcher started alone print only on the launcher's rank 0.
    """
    world = _world()
    if world is None:
        if launched_size() <= 1 or launched_rank() == 0:
            print(f"pydtnn: error: {message}", file=sys.stderr, flush=True)
        return code
    _report(world.Get_rank(), f"pydtnn: error: rank {world.Get_rank()}: {message}")
    abort_job(world, code)
    return code  # not reached: MPI_Abort ends the process


def _report(rank, line):
    """Print `line` to stderr; ranks other than 0 wait GRACE_S first, for rank 0's abort to end them."""
    if rank:
        try:
            time.sleep(GRACE_S)
        except KeyboardInterrupt:  # a second Ctrl-C: speak at once
            pass
    print(line, file=sys.stderr, flush=True)


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
        _report(rank, msg)
        abort(2 if issubclass(kind, PydtnnError) else 130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook
