"""pydtnn-train --parallel auto: the planner (planner.py) chooses the layout; rank 0 decides, every rank takes
its choice.

    choose(args, comm, say, built=simulate.build(args) if comm.rank == 0 else None)   # args' layout flags set
                                 # to the fastest predicted layout that fits

The machine the planner predicts on: --machine, else this machine's file for the job's process count, which
the first such run calibrates (calibrate.calibrate, quick; its MPI link measured over the job's own processes)
into the cache, $XDG_CACHE_HOME/pydtnn/machines (else ~/.cache/pydtnn/machines), and says so in one line.
The global batch is --global_batch_size, else --batch_size (or the model's recipe batch) per process; each
layout divides it over its replicas. --memory_per_process (GB) bounds what a process may hold.
"""

import contextlib
import os
import re

from pydtnn.errors import ConfigError


def cache_path(np_):
    """This machine's file for np_ processes in the per-user cache."""
    from pydtnn.perfmodel.calibrate import cores, cpu_model

    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cpu = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model() or "cpu").strip("-").lower()
    return os.path.join(root, "pydtnn", "machines", f"{cpu}-{cores()}cores-np{np_}.yaml")


def check_flags(args):
    """ConfigError where a flag that --parallel auto decides was given."""
    from pydtnn.perfmodel.planner import LAYOUT_FLAGS

    for flag in ("local_sgd", "reduction_staleness"):  # they replace the reduction that auto chooses
        if getattr(args, flag):
            raise ConfigError(f"--parallel auto chooses the layout and its reduction; --{flag} {getattr(args, flag)} "
                              f"replaces the reduction: leave --{flag} out, or name the layout (--parallel data)")
    for flag in LAYOUT_FLAGS[1:]:
        if flag in args.explicit:
            raise ConfigError(f"--parallel auto chooses --{flag} itself, but --{flag} {getattr(args, flag)} was "
                              f"given; leave --{flag} out, or name the layout (--parallel data, model, hybrid or "
                              f"pipeline)")


@contextlib.contextmanager
def unwatched(comm):
    """comm's waits block, unwatched for stalls, while rank 0 calibrates or plans (minutes for a large model)."""
    watch = getattr(comm, "watch", None)
    saved = watch.stall_timeout if watch is not None else None
    if watch is not None:
        watch.stall_timeout = None
    try:
        yield
    finally:
        if watch is not None:
            watch.stall_timeout = saved


def machine_for(args, comm, say):
    """The Machine the planner predicts on (rank 0's; None on the others): --machine, the cached file, or one
    calibrated now and cached (every rank takes part in its MPI probe)."""
    from pydtnn.perfmodel import machine

    if args.machine:
        return machine.load(args.machine) if comm.rank == 0 else None
    path = cache_path(comm.size)
    if os.path.exists(path):
        say(f"pydtnn: --parallel auto plans on {path}")
        return machine.load(path) if comm.rank == 0 else None
    say(f"pydtnn: --parallel auto: calibrating this machine for {comm.size} processes, once (a minute or two), "
        f"into {path}")
    probe = None
    if comm.size > 1:
        from pydtnn.perfmodel.mpi_probe import measure

        probe = measure(comm.comm, comm, quick=True)
    if comm.rank != 0:
        return None
    from pydtnn.perfmodel.calibrate import calibrate

    m, _ = calibrate(threads=(1,), np_=comm.size, quick=True, mpi=probe is not None, probe=probe)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    machine.save(m, path)
    return m


def choose(args, comm, say, np_=None, machine=None, built=None):
    """Plan args' run over np_ processes (default: comm's) on rank 0 and set every rank's layout flags to its
    choice: the plan's first layout within --memory_per_process (planner.keep_default); say names it, its
    predicted step and the runner-up. machine: the Machine to plan on (default: machine_for's); built: rank 0's
    (name, Model) of the run's model (perfmodel.simulate.build), which the others do not need."""
    from pydtnn.models.families import recipe
    from pydtnn.perfmodel import planner

    check_flags(args)
    np_ = np_ or comm.size
    with unwatched(comm):
        m = machine or machine_for(args, comm, say)
        decision = None
        if comm.rank == 0:
            name, model = built
            per = args.batch_size or recipe(name, args.optimizer)["batch_size"]
            limit = None if args.memory_per_process is None else args.memory_per_process * 1e9
            choices, refused, common = planner.plan(name, np_, m, args.global_batch_size or per * np_, limit,
                                              args.optimizer, base=args, built=(name, model))
            planner.check_fits(choices, refused, limit, name, np_)
            decision = {"common": list(common), "choices": [c.to_dict() for c in choices if c.fits][:2]}
        decision = comm.bcast_obj(decision)
    best = decision["choices"][0]
    planner.apply(args, best["flags"], decision["common"])
    line = (f"pydtnn: --parallel auto chose {' '.join(best['flags']) or 'one process'}: {best['step_s'] * 1e3:.1f} ms "
            f"a step predicted, {best['memory_bytes'] / 1e9:.3f} GB a process")
    if len(decision["choices"]) > 1:
        second = decision["choices"][1]
        line += f"; runner-up {' '.join(second['flags'])}: {second['step_s'] * 1e3:.1f} ms"
        if second["step_s"] < best["step_s"]:
            line += f" (within {100 * planner.MARGIN:g}%: --parallel data kept)"
    say(line)
    return best


def for_simulate(args, say=print):
    """--simulate --parallel auto: args' layout flags set to the plan's choice for --np processes on --simulate's
    machine (--machine, else the built-in one); nothing where --parallel is not auto."""
    from pydtnn.distributed.comm import SingleProcess
    from pydtnn.perfmodel import machine
    from pydtnn.perfmodel.simulate import build
    from pydtnn.plan import check_memory_limit

    check_memory_limit(args)
    if args.parallel != "auto":
        return None
    m = machine.DEFAULT if args.machine is None else machine.load(args.machine)
    return choose(args, SingleProcess(), say, args.np, m, built=build(args))
