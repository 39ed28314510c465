"""A machine description: what the performance model knows about the hardware.

Units: rates in FLOP/s and bytes/s, latencies in seconds, all per process (one MPI rank). The file
layout (YAML or JSON, same keys):

    name: 2-core x86 VM
    cores: 2
    processes_per_node: 2
    rates: {gemm: 4.0e+10, direct3x3: 1.5e+10, depthwise: 2.0e+9, elementwise: 1.0e+9}  # FLOP/s, one thread
    thread_scaling: {1: 1.0, 2: 1.8}          # speed-up over one thread
    memory_bandwidth: 1.0e+10                 # bytes/s
    reduce_rate: 3.0e+9                       # bytes/s at which two buffers are added (1/gamma)
    links:
      intra: {latency_s: 2.0e-6, bandwidth_bytes_per_s: 5.0e+9}    # processes on one node
      inter: {latency_s: 5.0e-5, bandwidth_bytes_per_s: 1.25e+8}   # a node's link to the others
    # optional (older files without them load with the defaults):
    #   links[level].collectives: {op: {latency_s, bandwidth_bytes_per_s}}  the link as one collective sees it,
    #   fitted on that operation's own times (calibrate's MPI probe); ops without one use the level's figures
    #   links[level].background: true  the link moves posted bytes on its own (sockets, RDMA; default false)
    thread_scaling_by_class: {gemm: {2: 1.9}, depthwise: {2: 1.3}}  # per kernel class; default thread_scaling
    thread_serial_s: {2: 1.0e-4}              # seconds of each kernel call that t threads do not share (default 0)
    overheads:                                # seconds, fixed costs outside the layers' arithmetic (default 0)
      layer_forward_s: 2.0e-5                 # one layer's forward call (dispatch, output allocation, launch)
      layer_backward_s: 2.5e-5                # one layer's backward call
      parameter_s: 5.0e-6                     # per parameter tensor and step (the optimizer's loop)
      step_s: 4.0e-4                          # per step: data, loss, the trainer's bookkeeping
      oversubscribed_collective_s: 2.0e-3     # per collective when a node's ranks x threads exceed its cores
      layer_calls:                            # per layer kind (class name) where measured; others use the above
        ReLU: {forward_s: 1.0e-5, backward_s: 1.2e-5}
    layer_profile: layers.json                # measured layer times (pydtnn-perfmodel profile), relative to this file
    node_aware_collectives: true              # the MPI library composes allreduce and broadcast over the nodes
                                              # (MPICH's SMP collectives, on by default there; default false)
"""

import dataclasses
import json
import math
import numbers
import os
import types

from pydtnn.errors import ConfigError
from pydtnn.perfmodel.collectives import OPS as COLLECTIVE_OPS

KERNEL_CLASSES = ("gemm", "direct3x3", "depthwise", "elementwise")
LEVELS = ("intra", "inter")
FIELDS = ("name", "cores", "processes_per_node", "rates", "thread_scaling", "memory_bandwidth", "reduce_rate",
          "links")
OPTIONAL_FIELDS = ("thread_scaling_by_class", "thread_serial_s", "overheads", "layer_profile", "node_aware_collectives")
LINK_FIELDS = ("latency_s", "bandwidth_bytes_per_s")
LINK_OPTIONAL_FIELDS = ("collectives", "background")
OVERHEAD_FIELDS = ("layer_forward_s", "layer_backward_s", "parameter_s", "step_s", "oversubscribed_collective_s")
CALL_FIELDS = ("forward_s", "backward_s")
# what a machine file may hold: its layout nests 5 levels (links.intra.collectives.allgather.latency_s) and has
# a few hundred values; anything far past that is not a machine description
MAX_NESTING = 32
MAX_VALUES = 100_000


@dataclasses.dataclass(frozen=True)
class Overheads:
    """Fixed seconds outside the layers' arithmetic, on one process: per layer call (forward, backward),
    per parameter tensor and step (the optimizer's loop over the parameters), per step (data, loss,
    the trainer's bookkeeping), and per collective where a node's ranks x threads exceed its cores (the
    wait, at each point where every rank must run at once, for ranks that are off the cores; measured at
    twice as many ranks as cores). All default to 0, the pure roofline. layer_calls[kind] = (forward_s,
    backward_s): the calls of one layer kind (its class name) where measured apart; call_s(kind) gives
    them, or layer_forward_s and layer_backward_s."""

    layer_forward_s: float = 0.0
    layer_backward_s: float = 0.0
    parameter_s: float = 0.0
    step_s: float = 0.0
    oversubscribed_collective_s: float = 0.0
    layer_calls: dict = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self):
        for f in OVERHEAD_FIELDS:
            _check_number(f"overheads.{f}", getattr(self, f), "seconds", allow_zero=True)
        _check_mapping("overheads.layer_calls", self.layer_calls)
        calls = {}
        for kind, pair in self.layer_calls.items():
            if not isinstance(kind, str) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ConfigError(f"machine field overheads.layer_calls has {kind!r}: {pair!r}; expected a layer "
                                  "class name and its (forward_s, backward_s)")
            for f, value in zip(CALL_FIELDS, pair):
                _check_number(f"overheads.layer_calls[{kind!r}].{f}", value, "seconds", allow_zero=True)
            calls[kind] = tuple(float(v) for v in pair)
        object.__setattr__(self, "layer_calls", types.MappingProxyType(calls))

    def call_s(self, kind):
        """(forward, backward) seconds of one call of a layer of class name `kind`."""
        return self.layer_calls.get(kind, (self.layer_forward_s, self.layer_backward_s))


@dataclasses.dataclass(frozen=True)
class Link:
    """One network level: a message of n bytes takes latency_s + n / bandwidth_bytes_per_s seconds.
    collectives[op]: a Link fitted on that collective's own measured times where it differs from the
    point-to-point one (on shared memory an allgather also assembles blocks and the trainer's
    communicator polls for completion); for_op(op) gives it, or this link. background: the link moves a
    posted message's bytes while the ranks compute (sockets: the kernel sends them; an RDMA network card),
    so a non-blocking collective advances between the reducers' test() calls as under a progress thread;
    on shared memory (False) the bytes move only inside MPI calls."""

    latency_s: float
    bandwidth_bytes_per_s: float
    collectives: dict = dataclasses.field(default_factory=dict, hash=False)
    background: bool = False

    def __post_init__(self):
        _check_number("latency_s", self.latency_s, allow_zero=True)
        _check_number("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        if not isinstance(self.background, bool):
            raise ConfigError(f"machine field background = {self.background!r} is invalid; expected true or false")
        _check_mapping("collectives", self.collectives)
        for op, link in self.collectives.items():
            if op not in COLLECTIVE_OPS:
                raise ConfigError(f"machine field collectives has key {op!r}; expected collective operations "
                                  f"({', '.join(COLLECTIVE_OPS)})")
            if not isinstance(link, Link) or link.collectives:
                raise ConfigError(f"machine field collectives[{op!r}] = {link!r} is invalid; expected a Link "
                                  "(latency_s, bandwidth_bytes_per_s) of its own")
        object.__setattr__(self, "collectives", types.MappingProxyType(dict(self.collectives)))

    @property
    def beta(self):
        """Seconds per byte."""
        return 1.0 / self.bandwidth_bytes_per_s

    def for_op(self, op):
        """The Link that collective `op` pays on this level: its own fit where measured, else this one."""
        return self.collectives.get(op, self)


@dataclasses.dataclass(frozen=True)
class Machine:
    """A machine, per process: rates[kernel class] in FLOP/s on one thread, thread_scaling[threads] the
    speed-up over one thread, memory_bandwidth and reduce_rate in bytes/s, links[level] a Link for
    "intra" (same node) and "inter" (between nodes); thread_scaling_by_class[kernel class][threads] the
    speed-up of that class where it differs from thread_scaling; thread_serial_s[threads] the seconds of
    each kernel call (a layer's phase) that `threads` threads do not share (a small call gains less from
    threads than a large one; see threaded_seconds); overheads the fixed costs outside the arithmetic;
    layer_profile a layer_profile.LayerProfile whose measured layers replace the roofline (None: none);
    node_aware_collectives: the MPI library runs an allreduce or broadcast over processes on more than one node
    in three steps, inside each node, among one leader per node, inside again (MPICH's SMP collectives,
    MPIR_CVAR_ENABLE_SMP_COLLECTIVES, on by default; collectives.node_aware). Every field is checked when it
    is made (ConfigError)."""

    name: str
    cores: int
    processes_per_node: int
    rates: dict
    thread_scaling: dict
    memory_bandwidth: float
    reduce_rate: float
    links: dict
    thread_scaling_by_class: dict = dataclasses.field(default_factory=dict)
    thread_serial_s: dict = dataclasses.field(default_factory=dict)
    overheads: Overheads = dataclasses.field(default_factory=lambda: Overheads())
    layer_profile: object = None  # a layer_profile.LayerProfile: measured layer times, used where it has them
    node_aware_collectives: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"machine field name = {self.name!r} is invalid; expected a non-empty string")
        _check_count("cores", self.cores)
        _check_count("processes_per_node", self.processes_per_node)
        _check_mapping("rates", self.rates)
        for kernel, rate in self.rates.items():
            if not isinstance(kernel, str):
                raise ConfigError(f"machine field rates has key {kernel!r}; expected kernel class names "
                                  f"({', '.join(KERNEL_CLASSES)})")
            _check_number(f"rates[{kernel!r}]", rate, "FLOP/s per process, one thread")
        missing = [k for k in KERNEL_CLASSES if k not in self.rates]
        if missing:
            raise ConfigError(f"machine field rates lacks {', '.join(map(repr, missing))}; expected a rate in "
                              f"FLOP/s for each of {', '.join(KERNEL_CLASSES)}")
        _check_scaling("thread_scaling", self.thread_scaling)
        _check_mapping("thread_scaling_by_class", self.thread_scaling_by_class)
        for kernel, scaling in self.thread_scaling_by_class.items():
            if kernel not in KERNEL_CLASSES:
                raise ConfigError(f"machine field thread_scaling_by_class has key {kernel!r}; expected kernel class "
                                  f"names ({', '.join(KERNEL_CLASSES)})")
            _check_scaling(f"thread_scaling_by_class[{kernel!r}]", scaling)
        _check_mapping("thread_serial_s", self.thread_serial_s)
        for threads, seconds in self.thread_serial_s.items():
            _check_count(f"thread_serial_s key {threads!r}", threads)
            _check_number(f"thread_serial_s[{threads}]", seconds, "seconds", allow_zero=True)
        from pydtnn.perfmodel.layer_profile import LayerProfile

        if self.layer_profile is not None and not isinstance(self.layer_profile, LayerProfile):
            raise ConfigError(f"machine field layer_profile = {self.layer_profile!r} is invalid; expected a "
                              "LayerProfile (a file's layer_profile: the path of one)")
        if not isinstance(self.node_aware_collectives, bool):
            raise ConfigError(f"machine field node_aware_collectives = {self.node_aware_collectives!r} is invalid; "
                              "expected true or false")
        if not isinstance(self.overheads, Overheads):
            raise ConfigError(f"machine field overheads = {self.overheads!r} is invalid; expected Overheads")
        _check_number("memory_bandwidth", self.memory_bandwidth, "bytes/s")
        _check_number("reduce_rate", self.reduce_rate, "bytes/s")
        _check_mapping("links", self.links)
        if sorted(self.links) != sorted(LEVELS):
            raise ConfigError(f"machine field links has levels {sorted(map(str, self.links))}; expected exactly "
                              f"{', '.join(LEVELS)}")
        for level, link in self.links.items():
            if not isinstance(link, Link):
                raise ConfigError(f"machine field links[{level!r}] = {link!r} is invalid; expected a Link")
        # read-only views, so that a frozen Machine cannot be changed through its dicts
        for field in ("rates", "thread_scaling", "links", "thread_serial_s"):
            object.__setattr__(self, field, types.MappingProxyType(dict(getattr(self, field))))
        object.__setattr__(self, "thread_scaling_by_class", types.MappingProxyType(
            {k: types.MappingProxyType(dict(v)) for k, v in self.thread_scaling_by_class.items()}))

    def thread_speedup(self, threads, kernel_class=None):
        """The speed-up at `threads` threads over one, of `kernel_class` where the machine has one for it,
        else thread_scaling's; past the largest count measured, that count's (more threads gain nothing
        predicted), and 1.0 below the smallest."""
        scaling = self.thread_scaling_by_class.get(kernel_class, self.thread_scaling)
        if threads in scaling:
            return float(scaling[threads])
        below = [t for t in scaling if t <= threads]
        return float(scaling[max(below)]) if below else 1.0

    def serial_s(self, threads):
        """thread_serial_s at `threads` threads: its entry, else the largest count's below, else 0."""
        below = [t for t in self.thread_serial_s if t <= threads]
        return float(self.thread_serial_s[max(below)]) if below else 0.0

    def threaded_seconds(self, seconds, threads, kernel_class=None):
        """A kernel call of `seconds` on one thread, at `threads` threads: its first serial_s(threads)
        seconds run as on one thread, the rest thread_speedup times faster (Amdahl's law with a fixed
        serial part); a call no longer than the serial part gains nothing."""
        serial = self.serial_s(threads)
        if seconds <= serial:
            return seconds
        return serial + (seconds - serial) / self.thread_speedup(threads, kernel_class)

    @property
    def gamma(self):
        """Seconds per byte reduced (adding two buffers)."""
        return 1.0 / self.reduce_rate

    def link(self, level):
        """The Link of `level` ("intra" or "inter")."""
        _check_level(level)
        return self.links[level]

    def with_link(self, level, bandwidth=None, latency=None, background=None):
        """A copy with link `level` given a new bandwidth (bytes/s), latency (s) and/or background (a bool, see
        Link); None keeps a value. The level's per-collective fits are dropped: they were measured on the old link."""
        old = self.link(level)
        new = Link(old.latency_s if latency is None else latency,
                   old.bandwidth_bytes_per_s if bandwidth is None else bandwidth,
                   background=old.background if background is None else background)
        return dataclasses.replace(self, links={**self.links, level: new})


def to_dict(machine):
    """The plain-data layout of the file (the inverse of from_dict)."""
    return {"name": machine.name, "cores": machine.cores, "processes_per_node": machine.processes_per_node,
            "rates": {k: float(v) for k, v in machine.rates.items()},
            "thread_scaling": {int(k): float(v) for k, v in machine.thread_scaling.items()},
            "memory_bandwidth": float(machine.memory_bandwidth), "reduce_rate": float(machine.reduce_rate),
            "links": {level: _link_dict(link) for level, link in machine.links.items()},
            "thread_scaling_by_class": {k: {int(t): float(s) for t, s in v.items()}
                                        for k, v in machine.thread_scaling_by_class.items()},
            "thread_serial_s": {int(t): float(s) for t, s in machine.thread_serial_s.items()},
            "overheads": _overheads_dict(machine.overheads),
            **({"layer_profile": machine.layer_profile.path} if machine.layer_profile is not None
               and machine.layer_profile.path else {}),
            **({"node_aware_collectives": True} if machine.node_aware_collectives else {})}


def _overheads_dict(overheads):
    """Overheads' layout; "layer_calls" only where some kind has its own."""
    out = {f: float(getattr(overheads, f)) for f in OVERHEAD_FIELDS}
    if overheads.layer_calls:
        out["layer_calls"] = {kind: dict(zip(CALL_FIELDS, pair)) for kind, pair in overheads.layer_calls.items()}
    return out


def _link_dict(link):
    """A Link's layout; "collectives" only where the link has per-collective fits."""
    out = {"latency_s": float(link.latency_s), "bandwidth_bytes_per_s": float(link.bandwidth_bytes_per_s)}
    if link.collectives:
        out["collectives"] = {op: _link_dict(fit) for op, fit in link.collectives.items()}
    if link.background:
        out["background"] = True
    return out


def _link_from_dict(field, data, nested=False):
    """A Link from its layout (with its optional per-collective fits, which have none of their own);
    errors name `field`."""
    _check_mapping(field, data)
    _check_keys(field, data, LINK_FIELDS, optional=() if nested else LINK_OPTIONAL_FIELDS)
    ops = data.get("collectives") or {}
    _check_mapping(f"{field}.collectives", ops)
    fits = {op: _link_from_dict(f"{field}.collectives[{op!r}]", fit, nested=True) for op, fit in ops.items()}
    try:
        return Link(*(_number(data[f]) for f in LINK_FIELDS), collectives=fits,
                    background=data.get("background", False))
    except ConfigError as e:
        raise ConfigError(str(e).replace("machine field ", f"machine field {field}.", 1)) from None


def from_dict(data, source="machine description", folder="."):
    """A Machine from the file's layout; any missing, unknown or bad field raises one ConfigError that
    names `source`, the field, the value and what is expected. folder: where a relative layer_profile path
    starts (the machine file's folder)."""
    from pydtnn.perfmodel import layer_profile

    try:
        _check_mapping("", data, what=f"{source} is {type(data).__name__}; expected a mapping of fields")
        _check_keys("", data, FIELDS, optional=OPTIONAL_FIELDS)
        _check_mapping("links", data["links"])
        links = {level: _link_from_dict(f"links[{level!r}]", link) for level, link in data["links"].items()}
        _check_mapping("rates", data["rates"])
        _check_mapping("thread_scaling", data["thread_scaling"])
        by_class = data.get("thread_scaling_by_class") or {}
        _check_mapping("thread_scaling_by_class", by_class)
        for kernel, scaling in by_class.items():
            _check_mapping(f"thread_scaling_by_class[{kernel!r}]", scaling)
        serial = data.get("thread_serial_s") or {}
        _check_mapping("thread_serial_s", serial)
        overheads = data.get("overheads") or {}
        _check_mapping("overheads", overheads)
        _check_keys("overheads", overheads, (), optional=OVERHEAD_FIELDS + ("layer_calls",))
        calls = overheads.get("layer_calls") or {}
        _check_mapping("overheads.layer_calls", calls)
        for kind, call in calls.items():
            _check_mapping(f"overheads.layer_calls[{kind!r}]", call)
            _check_keys(f"overheads.layer_calls[{kind!r}]", call, CALL_FIELDS)
        return Machine(
            name=data["name"], cores=data["cores"], processes_per_node=data["processes_per_node"],
            rates={k: _number(v) for k, v in data["rates"].items()},
            thread_scaling={_threads(k): _number(v) for k, v in data["thread_scaling"].items()},
            memory_bandwidth=_number(data["memory_bandwidth"]), reduce_rate=_number(data["reduce_rate"]),
            links=links,
            thread_scaling_by_class={k: {_threads(t): _number(s) for t, s in v.items()} for k, v in by_class.items()},
            thread_serial_s={_threads(t): _number(s) for t, s in serial.items()},
            overheads=Overheads(**{k: _number(v) for k, v in overheads.items() if k != "layer_calls"},
                                layer_calls={k: tuple(_number(c[f]) for f in CALL_FIELDS) for k, c in calls.items()}),
            layer_profile=_profile(data.get("layer_profile"), folder, layer_profile),
            node_aware_collectives=data.get("node_aware_collectives", False))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _profile(path, folder, layer_profile):
    """The LayerProfile a file's layer_profile names (relative to `folder`), or None."""
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"machine field layer_profile = {path!r} is invalid; expected the path of a layer "
                          "profile (pydtnn-perfmodel profile --out FILE)")
    return layer_profile.load(os.path.abspath(os.path.join(folder, path)))


def load(path):
    """The Machine described by YAML or JSON file `path` (JSON when it ends in .json)."""
    from pydtnn.files import read_bytes

    path = os.fspath(path)
    try:
        text = read_bytes(path, "machine file", limit=1 << 20).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"machine file {path} does not exist; `pydtnn-perfmodel calibrate --out {path}` "
                          "writes one") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"machine file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    too_deep = (f"machine file {path} nests mappings and lists deeper than {MAX_NESTING} levels; expected the "
                "machine layout (pydtnn/perfmodel/machine.py), which nests 5")
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"machine file {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
        except RecursionError:
            raise ConfigError(too_deep) from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"machine file {path} is not valid YAML{where}: "
                              f"{getattr(e, 'problem', None) or e}") from None
        except RecursionError:
            raise ConfigError(too_deep) from None
    _check_size(data, path, too_deep)
    return from_dict(data, source=f"machine file {path}", folder=os.path.dirname(os.path.abspath(path)))


def _check_size(data, path, too_deep):
    """ConfigError unless the parsed file nests at most MAX_NESTING levels and holds at most MAX_VALUES values
    counted as written out: YAML aliases let a small file stand for a cycle or for billions of values, which
    the checks (and their error messages) would otherwise walk. Iterative, so that no depth can overflow it."""
    stack, count = [(data, 1)], 0
    while stack:
        value, level = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(f"machine file {path} holds more than {MAX_VALUES:,} values (YAML aliases count each "
                              "time they are used); expected the machine layout (pydtnn/perfmodel/machine.py)")
        if isinstance(value, (dict, list)):
            if level > MAX_NESTING:
                raise ConfigError(too_deep)
            stack.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))


def save(machine, path):
    """Write `machine` to `path` atomically: JSON when it ends in .json, YAML otherwise. Returns path."""
    from pydtnn.files import write_atomic

    path = os.fspath(path)
    data = to_dict(machine)
    if path.lower().endswith(".json"):
        text = json.dumps(data, indent=2) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    write_atomic(path, text.encode("utf-8"))
    return path


def _check_level(level):
    if level not in LEVELS:
        raise ConfigError(f"unknown link level {level!r}; expected one of {', '.join(LEVELS)}")


def _check_count(field, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"machine field {field} = {value!r} is invalid; expected an integer >= 1")


def _check_number(field, value, unit=None, allow_zero=False):
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0))
    if not ok:
        unit = f" ({unit})" if unit else ""
        raise ConfigError(f"machine field {field} = {value!r} is invalid; expected a finite number "
                          f"{'>= 0' if allow_zero else '> 0'}{unit}")


def _check_mapping(field, value, what=None):
    if not isinstance(value, (dict, types.MappingProxyType)):
        raise ConfigError(what or f"machine field {field} = {value!r} is invalid; expected a mapping")


def _check_keys(field, data, expected, optional=()):
    where = f" of {field}" if field else ""
    missing = [k for k in expected if k not in data]
    if missing:
        raise ConfigError(f"machine field{'s' if len(missing) > 1 else ''} {', '.join(missing)}{where} "
                          f"missing; expected all of {', '.join(expected)}")
    unknown = [k for k in data if k not in expected and k not in optional]
    if unknown:
        raise ConfigError(f"unknown machine field {unknown[0]!r}{where}; expected only "
                          f"{', '.join((*expected, *optional))}")


def _check_scaling(field, scaling):
    """{threads: speed-up}, with 1: 1.0 among its entries."""
    _check_mapping(field, scaling)
    for threads, factor in scaling.items():
        _check_count(f"{field} key {threads!r}", threads)
        _check_number(f"{field}[{threads}]", factor, "a speed-up factor")
    if scaling.get(1) != 1.0:
        raise ConfigError(f"machine field {field} = {dict(scaling)} is invalid; expected "
                          "1: 1.0 among its entries (the speed-up of one thread over itself)")


def _number(value):
    """A number as written: YAML 1.1 reads 3.0e10 (no sign in the exponent) as text, so such text is taken."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # left for the field's check, which names it
    return value


def _threads(key):
    """A thread count from a key: JSON keys are always text ("2")."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key


# Plausible values for a 2-core x86 VM with 1 Gbit/s Ethernet between nodes; `pydtnn-perfmodel calibrate`
# measures the real ones on the machine at hand.
DEFAULT = Machine(
    name="2-core x86 VM (defaults, not measured)",
    cores=2,
    processes_per_node=2,
    rates={"gemm": 4.0e10, "direct3x3": 1.5e10, "depthwise": 2.0e9, "elementwise": 1.0e9},
    thread_scaling={1: 1.0, 2: 1.8},
    memory_bandwidth=1.0e10,
    reduce_rate=3.0e9,
    links={"intra": Link(latency_s=2.0e-6, bandwidth_bytes_per_s=5.0e9),
           "inter": Link(latency_s=5.0e-5, bandwidth_bytes_per_s=1.25e8)},
)
