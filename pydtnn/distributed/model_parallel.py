"""Model parallelism: every Conv2D and Dense split by output channels over the ranks of a group.

    model = models.create("vgg11bn_cifar10", backend=backend)    # built whole, as on one process
    model_parallel.partition(model, group)                       # group: a communicator (MPIComm.split)

partition() rewrites the built model in place. Each rank keeps the slice [lo, hi) of the output
channels (neurons) of every Conv2D and Dense, and of every layer that acts on channels one by one
after it. A tensor is then either whole (every rank holds the same copy) or split (each rank holds its
channels). The rules, per layer, in the order the forward pass meets them (docs/parallelism.md):

- Conv2D (one group) and Dense: whole input, split output, no communication forward; backward,
  each rank's dx is its channels' share of the sum, so the shares are summed over the group
  (allreduce, or reduce-scatter when the input was split just before: see Gather).
- BatchNorm, activations (but Softmax), max/average/global pooling, Dropout and depthwise Conv2D:
  channel by channel, so they act on the split tensor with their parameters sliced the same way.
  Dropout draws the whole tensor's mask and keeps its slice, so masks equal one process's.
- anything else (Flatten, Softmax, grouped Conv2D, blocks, layers this module does not know): a
  whole input. A split tensor is gathered before it (allgather over the channel axis); backward,
  each rank keeps its channels of dy. When the layer after the gather is split by channels, the
  gather's backward sums the dx shares and scatters them in one reduce-scatter.
- A TransformerBlock is split Megatron's way (Shoeybi et al. 2019): its attention by heads (q, k, v and
  out_proj's columns of this rank's heads), its MLP's fc by columns and proj by rows; LayerNorms and the
  residuals stay whole. Each branch's split part starts with SumGrad (dx summed in backward) and ends with
  SumOutput (the ranks' shares of the output summed forward, one allreduce; out_proj's and proj's bias
  added by rank 0 alone): one allreduce per sub-block forward and one backward.
- Residual and concatenation blocks take a whole input; each path ends whole (gathered).
- The model's output is whole: the loss and the metrics see what one process sees.

Every rank of a group sees the same batch, so the ranks of a group draw the same dropout masks
(the trainer seeds them by the data-parallel rank). Parameters, gradients and optimizer state exist
only as slices; Sharding gathers them whole for checkpoints and hashes, and cuts whole arrays.
"""

import time
from dataclasses import dataclass

import numpy as np

from pydtnn.backends import array_module, is_device_array
from pydtnn.distributed.sampler import shard_bounds
from pydtnn.errors import ConfigError
from pydtnn.layers.activation import LeakyReLU, ReLU, ReLU6, Sigmoid, Tanh
from pydtnn.layers.base import Layer, _join
from pydtnn.layers.blocks import Container, Sequential
from pydtnn.layers.conv import Conv2D
from pydtnn.layers.dense import Dense
from pydtnn.layers.dropout import Dropout
from pydtnn.layers.norm import BatchNorm
from pydtnn.layers.pool import AdaptiveAvgPool2D, AvgPool2D, GlobalAvgPool2D, MaxPool2D
from pydtnn.layers.transformer import TransformerBlock

CHANNELWISE = (BatchNorm, ReLU, ReLU6, LeakyReLU, Sigmoid, Tanh, MaxPool2D, AvgPool2D, GlobalAvgPool2D,
               AdaptiveAvgPool2D, Dropout)


def kind_of(layer):
    """'split' (Conv2D with one group, Dense), 'channelwise', 'block' or 'whole' (needs the whole input: so
    is a Dense over tokens, whose features are the last axis, not the channel axis this module splits)."""
    if isinstance(layer, TransformerBlock):
        return "megatron"
    if isinstance(layer, Dense) and len(layer.input_shape) == 2:
        return "whole"
    if isinstance(layer, Dense) or (isinstance(layer, Conv2D) and layer.groups == 1):
        return "split"
    if isinstance(layer, Conv2D) and layer.groups == layer.filters == layer.input_shape[0]:
        return "channelwise"  # depthwise, one filter per channel
    if isinstance(layer, CHANNELWISE):
        return "channelwise"
    if isinstance(layer, Sequential):
        return "sequential"
    if isinstance(layer, Container):
        return "block"
    return "whole"


class Group:
    """The model-parallel communicator as the inserted layers use it: collectives over the channel
    axis (axis 1), each traced when a tracer is set."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.tracer = None
        self._wire = {}  # (xp, dtype) -> the flat buffer collectives send or receive through, reused

    def _buffer(self, xp, size, dtype):
        """A flat scratch buffer of `size` elements, reused by every call (its contents last one call)."""
        key = (xp.__name__, np.dtype(dtype).str)
        buf = self._wire.get(key)
        if buf is None or buf.size < size:
            buf = self._wire[key] = xp.empty(size, dtype)
        return buf[:size]

    def _traced(self, op, label, nbytes, fn):
        start = time.perf_counter_ns()
        out = fn()
        if self.tracer is not None:
            self.tracer.add(f"{op} {label}", op, start, time.perf_counter_ns(), tid=2, bytes=int(nbytes))
        return out

    def allgather(self, x, bounds, label):
        """(N, C, ...) from every rank's (N, c_r, ...) block, bounds[r]:bounds[r + 1] being rank r's channels."""
        xp, n, rest = _xp(x), x.shape[0], x.shape[2:]
        inner = int(np.prod(rest, dtype=np.int64))
        counts = [n * (b - a) * inner for a, b in zip(bounds[:-1], bounds[1:])]
        flat = self._buffer(xp, sum(counts), x.dtype)
        send = xp.ascontiguousarray(x).reshape(-1)
        self._traced("allgather", label, flat.nbytes, lambda: self.comm.allgatherv(send, flat, counts, label))
        out = xp.empty((n, bounds[-1]) + rest, x.dtype)
        off = 0
        for (a, b), c in zip(zip(bounds[:-1], bounds[1:]), counts):
            out[:, a:b] = flat[off : off + c].reshape((n, b - a) + rest)
            off += c
        return out

    def reduce_scatter(self, dy, bounds, label):
        """This rank's channels of the sum over ranks of dy (N, C, ...)."""
        xp, n, rest = _xp(dy), dy.shape[0], dy.shape[2:]
        inner = int(np.prod(rest, dtype=np.int64))
        counts = [n * (b - a) * inner for a, b in zip(bounds[:-1], bounds[1:])]
        send, off = self._buffer(xp, sum(counts), dy.dtype), 0
        for (a, b), c in zip(zip(bounds[:-1], bounds[1:]), counts):  # rank r's channels, one after another
            send[off : off + c].reshape((n, b - a) + rest)[...] = dy[:, a:b]
            off += c
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        out = xp.empty((n, hi - lo) + rest, dy.dtype)
        self._traced("reduce_scatter", label, send.nbytes,
                     lambda: self.comm.reduce_scatterv(send, out.reshape(-1), counts, label))
        return out

    def allreduce(self, a, label):
        a = _xp(a).ascontiguousarray(a)
        return self._traced("allreduce", label, a.nbytes, lambda: self.comm.allreduce(a, label))

    def gather_rows(self, a, bounds):
        """Whole array (axis 0 = bounds[-1]) from every rank's rows [bounds[r], bounds[r + 1]) (NumPy)."""
        a = np.ascontiguousarray(a)
        inner = int(np.prod(a.shape[1:], dtype=np.int64))
        counts = [(b - c) * inner for c, b in zip(bounds[:-1], bounds[1:])]
        out = np.empty((bounds[-1],) + a.shape[1:], a.dtype)
        self.comm.allgatherv(a.reshape(-1), out.reshape(-1), counts, "state")
        return out


def _xp(a):
    return array_module(a)


class Gather(Layer):
    """Split -> whole over the channel axis. Backward keeps this rank's channels of dy; with
    `reduce_grad` (the next layer is split by channels) it first sums dy over the group
    (reduce-scatter): dy then holds each rank's share of dL/dx, not dL/dx itself."""

    def __init__(self, group, bounds, reduce_grad):
        super().__init__()
        self.group, self.bounds, self.reduce_grad = group, list(bounds), reduce_grad

    def describe(self):
        return f"Gather({self.bounds[-1]} channels{', reduce-scatter dx' if self.reduce_grad else ''})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.output_shape = (self.bounds[-1],) + self.input_shape[1:]

    def forward(self, x, training=True):
        return self.group.allgather(x, self.bounds, self.path or "gather")

    def backward(self, dy):
        if self.reduce_grad:
            return self.group.reduce_scatter(dy, self.bounds, self.path or "gather")
        lo, hi = self.bounds[self.group.rank], self.bounds[self.group.rank + 1]
        return self.xp.ascontiguousarray(dy[:, lo:hi])


class SumGrad(Layer):
    """Whole -> whole: the identity forward; backward sums dy over the group (allreduce). Placed before a
    layer split by channels whose input is whole: each rank's dx is only its channels' share."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def describe(self):
        return "SumGrad()"

    def forward(self, x, training=True):
        return x

    def backward(self, dy):
        return self.group.allreduce(dy, self.path or "sum dx")


class SumOutput(Layer):
    """Whole -> whole: forward, the sum over the group of each rank's share of the output (allreduce);
    backward, the identity (every rank's share has the same gradient). Megatron's "g" after a row split."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def describe(self):
        return "SumOutput()"

    def forward(self, x, training=True):
        return self.group.allreduce(x, self.path or "sum output")

    def backward(self, dy):
        return dy


@dataclass(frozen=True)
class Cut:
    """How an array is cut over the ranks: along `axis`, which holds `blocks` equal blocks (q, k and v: 3), rank r
    holding rows bounds[r]:bounds[r + 1] of each block."""

    bounds: tuple
    axis: int = 0
    blocks: int = 1

    @property
    def whole(self):
        return self.bounds[-1]


class Sharding:
    """Which state arrays are sliced, and how to make them whole or cut them again.

    slices: {state name: Cut}, for parameters and buffers. Every rank of the group must call gather() and
    full_state() together: they are collectives.
    """

    def __init__(self, group, slices):
        self.group, self.slices = group, slices

    def bounds(self, name):
        return list(self.slices[name].bounds)

    def whole_shape(self, name, shape):
        if name not in self.slices:
            return tuple(shape)
        c = self.slices[name]
        return tuple(c.blocks * c.whole if i == c.axis else s for i, s in enumerate(shape))

    def gather(self, name, a):
        """The whole array of state `name` (NumPy); `a` is this rank's slice (returned as is if unsliced)."""
        a = a.get() if is_device_array(a) else np.asarray(a)
        if name not in self.slices:
            return a
        c = self.slices[name]
        if c.axis == 0 and c.blocks == 1:
            return self.group.gather_rows(a, list(c.bounds))
        piece = np.ascontiguousarray(np.moveaxis(a, c.axis, 0))  # (blocks x own rows, rest)
        rest = piece.shape[1:]
        rows = np.diff(c.bounds)
        pieces = self.group.gather_rows(piece, [0, *np.cumsum(rows * c.blocks).tolist()])
        whole = np.empty((c.blocks, c.whole) + rest, a.dtype)
        for r, (lo, hi) in enumerate(zip(c.bounds[:-1], c.bounds[1:])):
            first = c.blocks * lo
            whole[:, lo:hi] = pieces[first : first + c.blocks * (hi - lo)].reshape((c.blocks, hi - lo) + rest)
        return np.ascontiguousarray(np.moveaxis(whole.reshape((c.blocks * c.whole,) + rest), 0, c.axis))

    def cut(self, name, a):
        """This rank's slice of the whole array `a` of state `name` (a itself if unsliced or already cut)."""
        if name not in self.slices:
            return a
        c = self.slices[name]
        lo, hi = c.bounds[self.group.rank], c.bounds[self.group.rank + 1]
        if a.shape[c.axis] != c.blocks * c.whole or hi - lo == c.whole:
            return a
        if c.axis == 0 and c.blocks == 1:
            return a[lo:hi]
        rows = np.concatenate([np.arange(k * c.whole + lo, k * c.whole + hi) for k in range(c.blocks)])
        return array_module(a).take(a, rows, axis=c.axis)

    def param_of_slot(self, slot_name):
        """'features.0.weight' of an optimizer array named 'features.0.weight.momentum_buffer'."""
        return slot_name.rsplit(".", 1)[0]


def partition(model, comm):
    """Split `model` (built whole, on every rank alike) over the ranks of `comm`; returns its Sharding.

    The slices are cut from the whole parameters, so the result starts exactly where one process does;
    the backend's Generator (which checkpoints save) is left as it was, also when the split is refused.
    """
    if comm.size == 1:
        return None
    if model.backend.name != "cpu":
        raise ConfigError(f"--parallel model runs on the CPU backend; got {model.backend.name}")
    rewrite = _Rewrite(Group(comm), apply=True)
    rng = model.backend.rng
    state = rng.bit_generator.state  # rebuilding slices draws initial values: leave the Generator as it was
    try:
        rewrite.run(model)
    finally:
        rng.bit_generator.state = state
    slices = {}
    for path, layer in model.root.named_layers():
        cuts = rewrite.owners.get(id(layer), {})
        for k in list(layer.params) + list(layer.buffers):
            if k in cuts:
                slices[_join(path, k)] = cuts[k]
    model.reindex()
    model.sharding = Sharding(rewrite.group, slices)
    return model.sharding


def plan(model, size):
    """What partition() would do to `model` over `size` ranks, without doing it (the performance model's
    input): one dict per step of the forward pass, in order.

    {"layer": path, "kind": "split" | "channelwise" | "whole", "fraction": f} for each leaf layer, f being
    the share of its channels that rank 0 (which holds the most) computes (1.0: the whole layer);
    {"layer": path, "op": "allgather", "elements": E, "backward": "slice" | "reduce_scatter"} for a gather
    before layer `path` ("output" at a path's or the model's end) of E whole elements per sample;
    {"layer": path, "op": "sum_dx", "elements": E} for an allreduce of dx in backward;
    {"layer": path, "op": "sum_output", "elements": E} for an allreduce of the output forward (Megatron's).
    """
    rewrite = _Rewrite(_Ranks(0, size), apply=False)
    rewrite.run(model)
    return rewrite.steps


class _Ranks:
    """Rank `rank` of `size`, for a rewrite that is planned, not applied."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


class _Rewrite:
    """The walk over a model's layers that partition() applies and plan() records."""

    def __init__(self, group, apply):
        self.group, self.apply = group, apply
        self.owners = {}  # id(layer) -> (lo, hi, whole)
        self.steps = []

    def run(self, model):
        form = self.walk(model.root, None)
        if form is not None:
            self.append(model.root, form, model.root.output_shape)

    def walk(self, seq, form):
        """Rewrite the children of Sequential `seq`, entered with `form` (None: whole; else the channel
        bounds of a split tensor); returns the form it leaves with."""
        out, size = [], self.group.size
        for name, child in seq.children:
            kind = kind_of(child)
            if kind == "sequential":
                form = self.walk(child, form)
            elif kind == "megatron":
                if form is not None:
                    out.append(self.gather(name, child, form, reduce_grad=False))
                    form = None
                self.megatron(child)
            elif kind == "split":
                if _channels(child) < size:
                    raise ConfigError(f"{child.name} has {_channels(child)} output channels, fewer than the {size} "
                                      f"processes it would be split over; expected a model-parallel size of at most "
                                      f"{_channels(child)}")
                if form is not None:
                    out.append(self.gather(name, child, form, reduce_grad=child.need_dx))
                elif child.need_dx:
                    self.steps.append({"layer": child.path, "op": "sum_dx", "elements": _count(child.input_shape)})
                    if self.apply:
                        out.append((f"{name}:sum_dx", _built(SumGrad(self.group), child.input_shape, child)))
                form = shard_bounds(_channels(child), size)
                self.slice(child, form, split_input=False)
            elif kind == "channelwise":
                if form is not None:
                    self.slice(child, form, split_input=True)
                else:
                    self.steps.append({"layer": child.path, "kind": kind, "fraction": 1.0})
            else:
                if form is not None:
                    out.append(self.gather(name, child, form, reduce_grad=False))
                    form = None
                if kind == "block":
                    if self.apply:
                        child.children = [(n, _as_sequential(p)) for n, p in child.children]
                    for _, path in child.children:
                        end = self.walk(path, None) if isinstance(path, Sequential) else self.leaf(path)
                        if end is not None:
                            self.append(path, end, path.output_shape)
                else:
                    self.steps.append({"layer": child.path, "kind": "whole", "fraction": 1.0})
            out.append((name, child))
        if self.apply:
            seq.children = out
        return form

    def megatron(self, block):
        """Split TransformerBlock `block` Megatron's way (the module's docstring); its input and output are whole."""
        size, rank = self.group.size, self.group.rank
        branches = dict(block.children)
        attention, mlp = (dict(branches[k].children)[""] for k in ("attention", "mlp"))
        attn = dict(attention.children)["attn"]
        fc, gelu, proj = (dict(mlp.children)[k] for k in ("fc", "gelu", "proj"))
        for what, count in (("heads", attn.heads), ("MLP columns", fc.units)):
            if count < size:
                raise ConfigError(f"{block.name} has {count} {what}, fewer than the {size} processes it would be split "
                                  f"over; expected a model-parallel size of at most {count}")
        heads, columns = shard_bounds(attn.heads, size), shard_bounds(fc.units, size)
        hd = attn.head_dim
        for path, first, last, parts in ((attention, attn, attn, {attn: heads}),
                                         (mlp, fc, proj, {fc: columns, gelu: columns, proj: columns})):
            children = []
            for name, layer in path.children:
                if layer is first:
                    self.steps.append({"layer": layer.path, "op": "sum_dx", "elements": _count(layer.input_shape)})
                    if self.apply:
                        children.append((f"{name}:sum_dx", _built(SumGrad(self.group), layer.input_shape, layer)))
                if layer in parts:
                    b = parts[layer]
                    kind = "channelwise" if layer is gelu else "split"
                    self.steps.append({"layer": layer.path, "kind": kind,
                                       "fraction": (b[rank + 1] - b[rank]) / b[-1]})
                else:
                    self.steps.append({"layer": layer.path, "kind": "whole", "fraction": 1.0})
                children.append((name, layer))
                if layer is last:
                    self.steps.append({"layer": layer.path, "op": "sum_output",
                                       "elements": _count(layer.output_shape)})
                    if self.apply:
                        children.append((f"{name}:sum", _built(SumOutput(self.group), layer.output_shape, layer)))
            if self.apply:
                path.children = children
        if self.apply:
            _split_attention(attn, heads, hd, rank, self.owners)
            _split_mlp(fc, gelu, proj, columns, rank, self.owners)

    def leaf(self, layer):
        """A block path that is one layer (plan() only: partition() makes every path a Sequential)."""
        seq = Sequential({"": layer})
        seq.input_shape, seq.output_shape, seq.need_dx = layer.input_shape, layer.output_shape, layer.need_dx
        return self.walk(seq, None)

    def gather(self, name, child, form, reduce_grad):
        self.steps.append({"layer": child.path, "op": "allgather", "elements": _count(child.input_shape),
                           "backward": "reduce_scatter" if reduce_grad else "slice"})
        if not self.apply:
            return None
        return (f"{name}:allgather", _built(Gather(self.group, form, reduce_grad=reduce_grad),
                                            _split_shape(child.input_shape, form, self.group), child))

    def append(self, seq, form, whole_shape):
        """A gather at the end of Sequential `seq` (a block's path, or the model)."""
        where = f"{seq.path}.output" if seq.path else "output"
        self.steps.append({"layer": where, "op": "allgather", "elements": _count(whole_shape), "backward": "slice"})
        if self.apply:
            _append(seq, "output:allgather", Gather(self.group, form, reduce_grad=False), whole_shape)

    def slice(self, layer, bounds, split_input):
        lo, hi = bounds[self.group.rank], bounds[self.group.rank + 1]
        self.steps.append({"layer": layer.path, "kind": "split" if not split_input else "channelwise",
                           "fraction": (hi - lo) / bounds[-1]})
        if self.apply:
            _slice(layer, bounds, self.group, self.owners, split_input)


def _count(shape):
    return int(np.prod(shape, dtype=np.int64))


def _as_sequential(layer):
    """A block's path as a Sequential (a built single layer is wrapped without a name: its state keeps
    its names), so that a gather can follow it."""
    if isinstance(layer, Sequential):
        return layer
    seq = Sequential({"": layer})
    seq.input_shape, seq.output_shape, seq.need_dx = layer.input_shape, layer.output_shape, layer.need_dx
    seq.backend, seq.dtype = layer.backend, layer.dtype
    return seq


def _channels(layer):
    return layer.units if isinstance(layer, Dense) else layer.filters


def _split_shape(shape, bounds, group):
    return (bounds[group.rank + 1] - bounds[group.rank],) + tuple(shape[1:])


def _built(layer, input_shape, like):
    layer.need_dx = True
    layer.build(input_shape, like.dtype, like.backend)
    return layer


def _append(seq, name, layer, whole_shape):
    layer.need_dx = True
    bounds = layer.bounds
    layer.build((bounds[layer.group.rank + 1] - bounds[layer.group.rank],) + tuple(whole_shape[1:]),
                seq.dtype, seq.backend)
    seq.children.append((name, layer))


def _slice(layer, bounds, group, owners, split_input):
    """Rebuild `layer` for this rank's channels [lo, hi) and copy the slices of its whole state."""
    lo, hi = bounds[group.rank], bounds[group.rank + 1]
    to_numpy = layer.backend.to_numpy
    whole = {k: to_numpy(v).copy() for k, v in list(layer.params.items()) + list(layer.buffers.items())}
    shape = layer.input_shape
    if isinstance(layer, Conv2D) and split_input:  # depthwise
        layer.filters = layer.groups = hi - lo
    elif isinstance(layer, Conv2D):
        layer.filters = hi - lo
    elif isinstance(layer, Dense):
        layer.units = hi - lo
    if isinstance(layer, Dropout):
        layer.channels = (bounds[-1], lo, hi)
    if split_input:
        shape = (hi - lo,) + tuple(shape[1:])
    layer.build(shape, layer.dtype, layer.backend)
    for k, v in whole.items():
        own = layer.params.get(k, layer.buffers.get(k))
        own[...] = layer.backend.asarray(v[lo:hi], dtype=own.dtype)
    owners[id(layer)] = dict.fromkeys(whole, Cut(tuple(bounds)))


def _whole_state(layer):
    return {k: layer.backend.to_numpy(v).copy() for k, v in layer.params.items()}


def _split_attention(attn, heads, hd, rank, owners):
    """Rebuild MultiHeadAttention `attn` for this rank's heads: rows of q, k and v, columns of out_proj."""
    lo, hi = heads[rank], heads[rank + 1]
    whole, d = _whole_state(attn), attn.input_shape[1]
    attn.head_range, attn.bias_here = (lo, hi), rank == 0
    attn.build(attn.input_shape, attn.dtype, attn.backend)
    rows = np.concatenate([np.arange(k * d + lo * hd, k * d + hi * hd) for k in range(3)])
    own = {"in_proj_weight": whole["in_proj_weight"][rows], "in_proj_bias": whole["in_proj_bias"][rows],
           "out_proj_weight": whole["out_proj_weight"][:, lo * hd : hi * hd], "out_proj_bias": whole["out_proj_bias"]}
    for k, v in own.items():
        attn.params[k][...] = attn.backend.asarray(v, dtype=attn.params[k].dtype)
    cut = tuple(b * hd for b in heads)
    owners[id(attn)] = {"in_proj_weight": Cut(cut, 0, 3), "in_proj_bias": Cut(cut, 0, 3),
                        "out_proj_weight": Cut(cut, 1)}


def _split_mlp(fc, gelu, proj, columns, rank, owners):
    """Rebuild the MLP for this rank's columns: fc's rows (its output features), proj's columns (its inputs)."""
    lo, hi = columns[rank], columns[rank + 1]
    fc_whole, proj_whole = _whole_state(fc), _whole_state(proj)
    t = fc.input_shape[0]
    fc.units = hi - lo
    fc.build(fc.input_shape, fc.dtype, fc.backend)
    gelu.build((t, hi - lo), gelu.dtype, gelu.backend)
    proj.bias_here = rank == 0
    proj.build((t, hi - lo), proj.dtype, proj.backend)
    for layer, k, v in ((fc, "weight", fc_whole["weight"][lo:hi]), (proj, "weight", proj_whole["weight"][:, lo:hi]),
                        *((fc, "bias", fc_whole["bias"][lo:hi]),) * fc.use_bias,
                        *((proj, "bias", proj_whole["bias"]),) * proj.use_bias):
        layer.params[k][...] = layer.backend.asarray(v, dtype=layer.params[k].dtype)
    owners[id(fc)] = dict.fromkeys(fc_whole, Cut(tuple(columns)))
    owners[id(proj)] = {"weight": Cut(tuple(columns), 1)}


def layout(comm, parallel, model_parallel_size):
    """(group, replicas, M): the model-parallel group of this rank, the data-parallel communicator of the
    replicas (ranks with the same place in their groups) and the group size M, from the flags, checked by the
    run plan's one rule (pydtnn.plan.layout).

    Groups are consecutive ranks (0..M-1, M..2M-1, ...), which launchers place on one node, so the
    model-parallel collectives, the most frequent, stay on the fastest links. With M = 1 (data
    parallelism) there is no group and the replicas are every rank.
    """
    from pydtnn.distributed.comm import SingleProcess
    from pydtnn.plan import layout as plan_layout

    world = comm.size
    m = plan_layout(parallel, world, model_parallel_size, flags=True).model_parallel_size
    if m == 1:
        return None, comm, 1
    group = comm.split(comm.rank // m, comm.rank)
    replicas = comm.split(comm.rank % m, comm.rank) if world > m else SingleProcess()
    return group, replicas, m
