"""ZeRO stage 3's parameters: each replica keeps its shard only, and a layer's are gathered just before it runs.

    shards = ParamShards(model, comm, spans, parts)   # spans: a leaf layer's parameters each (zero.layer_spans)
    shards.attach()          # the shard taken from the whole parameters, which are let go
    model.forward(x)         # each layer's parameters allgathered before its forward, the next one's started early
    shards.changed()         # after the optimizer updated the shard: gathered copies are stale

The shard is the elements of the flat gradient buffer's layout (Model.grad_offsets) this replica owns, span by
span (zero.span_parts: replica r owns the r-th of P near-equal parts of each span, at `at` of its shard). A span
is one leaf layer's parameters, so replica r's part of it is one run of its shard, and an allgatherv of every
replica's part gives the layer's parameters whole, in buffer order, with no rearranging, into a new array of
which the layer's params become views. Two such arrays are held at a time (`held`, two slots: the layer that
runs and the next one); when one is let go, its layer's params become read-only views of no bytes, shaped as
before, and the array is freed: a replica holds its shard and two layers' parameters, never the whole model.

The gathers run non-blocking: when a layer asks for its parameters (Container calls the hook before a leaf's
forward and its backward), the gather of the layer that came next last time (after this layer's forward, or
its backward, counted since the last update: a recomputed forward, or a later micro-batch's, is a call of its
own) starts into the other slot, so it moves while this layer computes. The order is learned from the calls
themselves, so recomputation, gradient accumulation and evaluation passes need nothing of their own; every
replica calls in the same order, so a guess that turns out wrong is wrong on every replica alike, and costs one
gather. A gather still in flight when the shard is about to change (drain(), before the optimizer's update) is
completed first, its send buffer being the shard, and what the slots hold is stale after it (changed()).

Whole arrays are gathered span by span onto every replica: whole() (state dicts, checkpoints) holds the whole
model for a moment, as one process does; gathered() yields them one layer at a time, and runs() (digests) in
runs of a bounded length, each broadcast from the replica that holds it.
"""

import time

import numpy as np


class ParamShards:
    """This replica's shard of `model`'s parameters over `comm` (the replicas), and the gathers that give a layer
    its parameters whole. spans: [(names, lo, hi)] in buffer order, one leaf layer's parameters each; parts: each
    span's parts (zero.span_parts of the spans). `flat` is the shard, which the optimizer updates in place."""

    def __init__(self, model, comm, spans, parts):
        self.model, self.comm, self.tracer = model, comm, None
        xp, dtype, rank = model.backend.xp, model.grad_buffer.dtype, comm.rank
        layer_of = {n: layer for _, layer in model.root.named_layers() for n in model._param_names.get(id(layer), ())}
        self.spans, self.index = [], {}
        for i, ((names, lo, hi), cut) in enumerate(zip(spans, parts)):
            layer = layer_of[names[0]]
            if any(layer_of[n] is not layer for n in names):
                raise ValueError(f"ParamShards: span {i} holds parameters of several layers ({names[:4]}); expected "
                                 f"one layer's")
            keys = {n: k for k, n in zip(layer.params, model._param_names[id(layer)])}  # full name -> key
            entries = [(keys[n], n, *(x - lo for x in model.grad_offsets[n]), layer.params[keys[n]].shape)
                       for n in names]
            a, b, at = cut[rank]
            self.spans.append((layer, entries, lo, hi, [q1 - q0 for q0, q1, _ in cut], (at, at + b - a)))
            self.index[id(layer)] = i
        self.names = {n: i for i, (names, _, _) in enumerate(spans) for n in names}
        self.flat = xp.empty(sum(m1 - m0 for *_, (m0, m1) in self.spans), dtype)
        self.none = xp.zeros((), dtype)  # what a layer's parameters are views of while not gathered: no bytes
        self.held = [None, None]  # per slot: [span, version, request or None, label, start ns, gathered array]
        self.binding = {}  # span -> the slot its layer's parameters are views of
        self.version, self.bound, self.prev, self.next_of, self.attached = 0, None, None, {}, False
        self.calls = {}  # (layer, phase) -> its calls since the last update
        self.fill()

    # -- the shard -----------------------------------------------------------------------------------------
    def fill(self):
        """Take this replica's shard from the layers' own (whole) parameters."""
        for layer, keys, *_ in self.spans:
            for k, name, *_ in keys:
                lo, hi, view = self.piece(name)
                view[...] = layer.params[k].reshape(-1)[lo:hi]

    def _mine(self, lo, counts):
        """(start, stop) of this replica's part of a span, relative to the span's start `lo`."""
        start = sum(counts[: self.comm.rank])
        return start, start + counts[self.comm.rank]

    def piece(self, name):
        """(lo, hi, view): this replica's flat elements [lo, hi) of parameter `name`, a view of the shard (an empty
        range where it owns none)."""
        _, keys, lo, _, counts, (m0, _) = self.spans[self.names[name]]
        part = self._mine(lo, counts)
        s, e = next((s, e) for _, n, s, e, _ in keys if n == name)
        x0 = min(max(s, part[0]), e)
        x1 = max(x0, min(e, part[1]))
        return x0 - s, x1 - s, self.flat[m0 + x0 - part[0] : m0 + x1 - part[0]]

    def attach(self):
        """Take the shard from the whole parameters (as broadcast, or resumed), then let the whole parameters go:
        each layer's params become views of a scratch slot, bound to its values by the hook before it runs."""
        self.drain()
        self.fill()
        self.version += 1
        for s in (0, 1):
            self._release(s)
        for i in range(len(self.spans)):
            self._let_go(i)
        self.bound = None
        self.model.param_shards = self
        self.model.set_params_hook(self)
        self.attached = True
        return self

    def changed(self):
        """The shard was updated (an optimizer step, a load): what the slots hold is stale."""
        self.drain()
        self.version += 1
        self.prev, self.calls = None, {}  # no guess across an update

    # -- gathering -------------------------------------------------------------------------------------------
    def __call__(self, layer, phase):
        """Before `layer` runs `phase` ("forward", "backward"): its parameters gathered and bound, and the gather
        of the layer that came next last time started."""
        i = self.index[id(layer)]
        key = (id(layer), phase, self.calls.get((id(layer), phase), 0))  # its how-many-th `phase` since the update
        self.calls[key[:2]] = key[2] + 1
        if self.prev is not None:
            self.next_of[self.prev] = i
        self.prev = key
        s = self._ready(i)
        self._bind(i, s)
        following = self.next_of.get(key)
        if following is not None and following != i and self._holding(following) is None:
            self._start(following, 1 - s)

    def _holding(self, i):
        """The slot that holds (or is receiving) span i at this version, or None."""
        return next((s for s, h in enumerate(self.held) if h is not None and h[0] == i and h[1] == self.version),
                    None)

    def _ready(self, i):
        """The slot holding span i, its gather complete: prefetched, or started and waited for now."""
        s = self._holding(i)
        if s is None:
            s = 0 if self.bound is None else 1 - self.bound
            self._start(i, s)
        self._complete(s)
        return s

    def _start(self, i, s):
        self._complete(s)  # a gather still in flight into that slot (a wrong guess) completes first
        self._release(s)
        _, _, lo, hi, counts, (m0, m1) = self.spans[i]
        label = f"zero gather {i}"
        whole = self.model.backend.xp.empty(hi - lo, self.flat.dtype)
        req = self.comm.iallgatherv(self.flat[m0:m1], whole, counts, label)
        self.held[s] = [i, self.version, req, label, time.perf_counter_ns(), whole]

    def _release(self, s):
        """Let go of what slot s holds: its layer's parameters (where they are views of it) become views of no
        bytes again, so the array is freed."""
        h, self.held[s] = self.held[s], None
        if h is None or self.binding.get(h[0]) != s:
            return
        del self.binding[h[0]]
        self._let_go(h[0])

    def _let_go(self, i):
        """Span i's layer's parameters become read-only views of no bytes, shaped as before."""
        layer, keys, *_ = self.spans[i]
        for k, _, _, _, shape in keys:
            layer.params[k] = self.model.backend.xp.broadcast_to(self.none, shape)

    def _complete(self, s):
        h = self.held[s]
        if h is None or h[2] is None:
            return
        t_wait = time.perf_counter_ns()
        h[2].wait()
        if self.tracer is not None:
            _, _, lo, hi, _, _ = self.spans[h[0]]
            end = time.perf_counter_ns()
            self.tracer.add(f"iallgather {h[3]}", "iallgather", h[4], end, tid=2,
                            bytes=int((hi - lo) * self.flat.itemsize))
            self.tracer.add(f"wait {h[3]}", "wait", t_wait, end, tid=1)
        h[2] = None

    def drain(self):
        """Complete every gather in flight (before the shard changes, or a blocking collective)."""
        for s in (0, 1):
            self._complete(s)

    def _bind(self, i, s):
        layer, keys, *_ = self.spans[i]
        whole = self.held[s][5]
        for k, _, a, b, shape in keys:
            layer.params[k] = whole[a:b].reshape(shape)
        self.binding[i], self.bound = s, s

    # -- whole arrays ----------------------------------------------------------------------------------------
    def whole(self):
        """{name: NumPy array} of every parameter, whole (a collective: every replica calls it)."""
        names = [n for _, keys, *_ in self.spans for _, n, *_ in keys]
        return dict(zip(names, self.gathered(names)))

    def gathered(self, names, reuse=False):
        """Each parameter of `names`, whole, as a NumPy array, in that order (a collective: every replica calls it
        with the same names). One layer's parameters are gathered at a time, when the first of them is asked for:
        a digest that takes each array as it comes holds one layer beyond the shard, not the whole model. reuse:
        every layer gathered into one array, as large as the largest layer (an array yielded holds its values
        until the next is asked for), so a digest allocates once."""
        self.drain()
        xp, to_numpy, current, recv = self.model.backend.xp, self.model.backend.to_numpy, None, None
        spans = [self.spans[i] for i in dict.fromkeys(self.names[n] for n in names)]
        buffer = xp.empty(max((hi - lo for _, _, lo, hi, *_ in spans), default=0), self.flat.dtype) if reuse else None
        for name in names:
            i = self.names[name]
            _, keys, lo, hi, counts, (m0, m1) = self.spans[i]
            if i != current:
                recv = buffer[: hi - lo] if reuse else xp.empty(hi - lo, self.flat.dtype)
                self.comm.allgatherv(self.flat[m0:m1], recv, counts, "zero parameters")
                recv, current = to_numpy(recv), i
            a, b, shape = next((a, b, shape) for _, n, a, b, shape in keys if n == name)
            yield recv[a:b].reshape(shape)

    def runs(self, names, limit=1 << 20):
        """The elements of each parameter of `names`, whole, in that order, as flat runs of at most `limit` (NumPy
        arrays, each holding its values until the next is asked for; a collective: every replica calls it with
        the same names): a digest streams the model through one array of `limit` elements. Each run lies in one
        replica's part and is broadcast from it (an allgatherv would have every other replica send nothing,
        which MPICH's non-blocking one, polled by the stall watch, makes hundreds of times slower)."""
        self.drain()
        rank, to_numpy = self.comm.rank, self.model.backend.to_numpy
        ranges = {n: b - a for _, keys, *_ in self.spans for _, n, a, b, _ in keys}
        buffer = self.model.backend.xp.empty(min(limit, max((ranges[n] for n in names), default=0)), self.flat.dtype)
        for name in names:
            _, keys, _, _, counts, (m0, _) = self.spans[self.names[name]]
            s, e = next((a, b) for _, n, a, b, _ in keys if n == name)
            for r, q0 in enumerate(np.cumsum([0, *counts[:-1]])):
                for c0 in range(max(s, q0), min(e, q0 + counts[r]), limit):  # replica r's elements of [s, e)
                    c1 = min(e, q0 + counts[r], c0 + limit)
                    out = buffer[: c1 - c0]
                    if r == rank:
                        out[...] = self.flat[m0 + c0 - q0 : m0 + c1 - q0]
                    self.comm.bcast(out, root=r)
                    yield to_numpy(out)

    def load(self, arrays):
        """Take this replica's shard of whole parameters {name: array} (names it does not hold are an error)."""
        self.drain()
        for name, v in arrays.items():
            lo, hi, view = self.piece(name)
            view[...] = self.model.backend.asarray(np.asarray(self.model.backend.to_numpy(v)).reshape(-1)[lo:hi],
                                                   dtype=self.flat.dtype)
        self.changed()
