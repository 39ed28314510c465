"""Gradient reduction strategies, one class per file behind the Reducer interface (base.py), registered here
once: name, class, options and their defaults, the compressions, progress modes and devices it takes, and its
messages as a pure function (layout.py) that the reducer and the performance model both follow.

    reducers.validate("topk", compression="fp16")     # ConfigError: one line naming what topk takes
    reducer = reducers.create("bucketed", comm, bucket_mb=8.0, compression="fp16")
    reducers.messages("bucketed", counts, 4, bucket_mb=8.0)                # [Message] as the reducer sends them
"""

import inspect
from dataclasses import dataclass

import numpy as np

from pydtnn.distributed.communicator import DEVICES
from pydtnn.distributed.compression import COMPRESSIONS, compression_of
from pydtnn.distributed.reducers import base, layout
from pydtnn.distributed.reducers.base import PROGRESS, Reducer
from pydtnn.distributed.reducers.blocking import BlockingReducer
from pydtnn.distributed.reducers.bucketed import BucketedReducer
from pydtnn.distributed.reducers.hierarchical import HierarchicalReducer
from pydtnn.distributed.reducers.local_sgd import LocalSGDReducer
from pydtnn.distributed.reducers.oktopk import OkTopkReducer
from pydtnn.distributed.reducers.per_layer import PerLayerReducer
from pydtnn.distributed.reducers.powersgd import PowerSGDReducer
from pydtnn.distributed.reducers.stale import StaleReducer
from pydtnn.distributed.reducers.topk import TopKReducer
from pydtnn.errors import ConfigError

_DEVICE_WORDS = {"cpu": "the CPU", "gpu": "a GPU over MPI", "nccl": "a GPU over NCCL"}


@dataclass(frozen=True)
class Strategy:
    """One registered reduction strategy. options: its own keyword options and their defaults (those of
    cls's constructor besides comm, compression and progress); compressions, progress, devices: what it takes
    (communicator.DEVICES names the devices); messages(counts, itemsize, piece_bytes, **options): its
    messages per step (layout.Message), from the gradients' entry counts in parameter order."""

    name: str
    cls: type
    compressions: tuple
    progress: tuple
    devices: tuple
    messages: object

    @property
    def options(self):
        skip = ("self", "comm", "compression", "progress")
        return {p.name: p.default for p in inspect.signature(self.cls.__init__).parameters.values()
                if p.name not in skip}


STRATEGIES = {s.name: s for s in (
    Strategy("blocking", BlockingReducer, COMPRESSIONS, ("test",), DEVICES, layout.blocking_messages),
    Strategy("per_layer", PerLayerReducer, COMPRESSIONS, PROGRESS, DEVICES, layout.per_layer_messages),
    Strategy("bucketed", BucketedReducer, COMPRESSIONS, PROGRESS, DEVICES, layout.bucketed_messages),
    # its chains start their next stage from test(), on the calling thread; its node and leader groups
    # are MPI communicators of host arrays
    Strategy("hierarchical", HierarchicalReducer, COMPRESSIONS, ("test",), ("cpu",), layout.bucketed_messages),
    # each rank's largest entries travel as they are (indices and values), summed on arrival
    Strategy("topk", TopKReducer, ("none",), ("test",), DEVICES, layout.topk_messages),
    # each rank's largest entries summed region by region on the rank that owns the region (an alltoallv), the
    # largest sums gathered: O(k) bytes per rank whatever the process count; host arrays
    Strategy("oktopk", OkTopkReducer, ("none",), ("test",), ("cpu",), layout.oktopk_messages),
    # low-rank: each matrix's P and Q summed in two allreduces after backward, the small gradients whole
    Strategy("powersgd", PowerSGDReducer, ("none",), ("test",), DEVICES, layout.powersgd_messages),
    # no reduction of the gradients (after its first post_local steps): the replicas' parameters and optimizer
    # state averaged every so many steps (--local_sgd)
    Strategy("local_sgd", LocalSGDReducer, ("none",), ("test",), DEVICES, layout.local_sgd_messages),
    # one allreduce of every gradient started after backward and waited for after the next step's: the update of
    # step t applies g(t - 1) (--reduction_staleness 1)
    Strategy("stale", StaleReducer, ("none",), PROGRESS, ("cpu",), layout.stale_messages),
)}
NAMES = tuple(STRATEGIES)


def _taking(accepts):
    """The names of the strategies s for which accepts(s) holds, as text."""
    return ", ".join(s.name for s in STRATEGIES.values() if accepts(s))


def validate(name, compression="none", progress="test", device="cpu"):
    """Nothing when strategy `name` takes this compression ("none", "fp16"), progress ("test", "thread") and
    device ("cpu", "gpu", "nccl": the arrays its communicator takes, communicator.DEVICES); else a
    ConfigError, one line naming the combination and what is accepted."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown reduction strategy {name!r}; expected one of {', '.join(NAMES)}")
    s = STRATEGIES[name]
    for what, value, known in (("gradient compression", compression, COMPRESSIONS), ("progress", progress, PROGRESS),
                               ("device", device, DEVICES)):
        if value not in known:
            raise ConfigError(f"unknown {what} {value!r}; expected one of {', '.join(known)}")
    if compression not in s.compressions:
        raise ConfigError(f"{name} reducer: compression {compression!r}; expected {' or '.join(s.compressions)} "
                          f"(compression {compression} is taken by {_taking(lambda s: compression in s.compressions)})")
    if progress not in s.progress:
        raise ConfigError(f"{name} reducer: progress {progress!r}; expected {' or '.join(s.progress)}")
    if device not in s.devices:
        raise ConfigError(f"{name} reducer: device {device!r}; expected {' or '.join(s.devices)} (on "
                          f"{_DEVICE_WORDS[device]}: {_taking(lambda s: device in s.devices)})")
    if progress == "thread" and device == "nccl":
        raise ConfigError(f"{name} reducer: progress 'thread' on device 'nccl'; expected test (the thread tests "
                          f"MPI's requests; NCCL's reductions progress on their own stream)")


def defaults(name):
    """{option: default} of strategy `name`'s own options (besides compression and progress)."""
    validate(name)
    return STRATEGIES[name].options


def create(name, comm, **options):
    """Reducer `name` over Communicator `comm`; options: compression ("none", "fp16" or a compression object
    of pydtnn.distributed.compression), progress ("test" or "thread"), and the strategy's own (defaults(name):
    bucket_mb and first_bucket_mb for bucketed and hierarchical, ranks_per_node for hierarchical, density,
    momentum, warmup_epochs and selection for topk, density, momentum, warmup_epochs, threshold_every and
    repartition_every for oktopk, rank, start_step and min_compression_rate for powersgd,
    every, average and post_local for local_sgd, staleness for stale: defaults(name)). The combination is checked first
    (validate, with comm.device)."""
    compression = compression_of(options.get("compression", "none"))
    validate(name, compression.name, options.get("progress", "test"), comm.device)
    own = STRATEGIES[name].options
    unknown = sorted(k for k in options if k not in own and k not in ("compression", "progress"))
    if unknown:
        raise ConfigError(f"{name} reducer: unknown option {unknown[0]!r}; expected "
                          f"{', '.join(own) or 'none besides compression and progress'}")
    return STRATEGIES[name].cls(comm, **{**options, "compression": compression})


def messages(name, counts, itemsize, compression="none", shapes=None, replicas=None, state_arrays=None, **options):
    """[layout.Message] that strategy `name` sends per step, in the order it lays them out (before any
    reordering by readiness), for gradients of `counts` entries each (parameter order) of `itemsize` bytes,
    and of `shapes` (parameter order; powersgd's messages need them, the others' do not), over `replicas` ranks
    (oktopk's messages need it, the others' do not), with the optimizer keeping `state_arrays` arrays per parameter
    (local SGD averages them too; None: its layout's default),
    with `compression` on the wire ("none", "fp16": layout.compressed), cut at base.PIECE_BYTES as the
    reducer cuts them; options: any of the strategy's own (defaults(name)), of which those that shape its
    messages are used (bucket_mb, density, ...); an option not given (or None) takes the reducer's default."""
    own = defaults(name)
    unknown = sorted(k for k in options if k not in own)
    if unknown:
        raise ConfigError(f"{name} reducer: unknown option {unknown[0]!r}; expected {', '.join(own) or 'none'}")
    validate(name, compression)
    fn = STRATEGIES[name].messages
    shaping = inspect.signature(fn).parameters
    given = {k: v for k, v in options.items() if v is not None}
    if "shapes" in shaping:
        if shapes is None or len(shapes) != len(counts):
            raise ConfigError(f"{name} reducer: its messages follow the gradients' shapes; expected one shape per "
                              f"gradient, got {'none' if shapes is None else len(shapes)} for {len(counts)}")
        given["shapes"] = [tuple(s) for s in shapes]
    if "replicas" in shaping:
        if not replicas or replicas < 1:
            raise ConfigError(f"{name} reducer: its messages follow the number of ranks; expected replicas >= 1, "
                              f"got {replicas!r}")
        given["replicas"] = int(replicas)
    if "state_arrays" in shaping and state_arrays is not None:
        given["state_arrays"] = int(state_arrays)
    sent = fn(counts, itemsize, base.PIECE_BYTES,
              **{k: v for k, v in {**own, **given}.items() if k in shaping})
    wire = compression_of(compression).wire_dtype
    if wire is None:
        return sent
    return layout.compressed(sent, counts, itemsize, np.dtype(wire).itemsize, base.PIECE_BYTES)


__all__ = [
    "COMPRESSIONS",
    "DEVICES",
    "NAMES",
    "PROGRESS",
    "STRATEGIES",
    "BlockingReducer",
    "BucketedReducer",
    "HierarchicalReducer",
    "LocalSGDReducer",
    "OkTopkReducer",
    "PerLayerReducer",
    "PowerSGDReducer",
    "StaleReducer",
    "Reducer",
    "TopKReducer",
    "create",
    "defaults",
    "messages",
    "validate",
]
