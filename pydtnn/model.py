"""Model: a built tree of layers on one backend, with named state and a gradients-ready hook.

    model = Model([Conv2D(16, 3, padding=1), ReLU(), Flatten(), Dense(10)], input_shape=(1, 28, 28))
    logits = model.forward(x)                 # x: (N, 1, 28, 28) -> (N, 10)
    model.backward(dlogits)                   # fills every layer's grads
    model.state_dict()                        # {"0.weight": ..., "0.bias": ..., "3.weight": ...}

State-dict names are dotted paths of container children, then the parameter or buffer name, in
depth-first order with each layer's parameters before its buffers (PyTorch's order), so they are
identical on every rank and can be matched against a PyTorch model with the same structure.

The architecture can be changed by those paths before training (before the optimizer is made):

    model.replace("layer1.0.relu", PReLU())     # the new layer takes the old one's name
    model.insert("fc", Dropout(0.2), name="drop")   # a new step before "fc"
"""

import hashlib

import numpy as np

from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError, ShapeError
from pydtnn.layers.base import _join
from pydtnn.layers.blocks import Container, Sequential
from pydtnn.layers.transformer import Embedding


class Model:
    """Layers + backend. `layers` is a list/dict of layers or a Sequential; input_shape has no batch."""

    def __init__(self, layers, input_shape, backend=None, name="model"):
        self.backend = backend if backend is not None else CPUBackend()
        self.name = name
        self.root = layers if isinstance(layers, Sequential) else Sequential(layers)
        self.root.need_dx = False  # nothing upstream of the input wants a gradient
        self.input_shape = tuple(int(s) for s in input_shape)
        self.training = True
        self._hooks = []
        self.sharding = None  # set by distributed.model_parallel.partition: which state arrays are slices
        self.pipeline = None  # set by a pipeline's step (distributed.pipeline.StageOf): the whole model of a stage
        self.param_shards = None  # set by zero_params.ParamShards.attach: the parameters sharded over the replicas
        self._build()

    @classmethod
    def of_built(cls, root, backend, name="model", need_dx=False):
        """A Model of layers built already (a Sequential `root` whose input_shape is set), their arrays kept:
        a pipeline stage (pydtnn.distributed.pipeline). need_dx: the stage before wants dL/dinput."""
        model = cls.__new__(cls)
        model.backend, model.name, model.root = backend, name, root
        root.need_dx = need_dx
        model.input_shape = tuple(int(s) for s in root.input_shape)
        model.output_shape = root.output_shape
        model.training, model._hooks, model.sharding, model.pipeline = True, [], None, None
        model.param_shards = None
        model.reindex()
        return model

    def _build(self):
        """Build every layer for the input shape (fresh parameters) and index the tree."""
        for path, layer in self.root.named_layers():
            layer.path = path or None  # before build, so shape errors name the layer
        self.root.build(self.input_shape, self.backend.dtype, self.backend)
        self.output_shape = self.root.output_shape
        self.reindex()

    def reindex(self):
        """Index the layer tree again: paths, gradient hooks, parameter names, the gradient buffer.
        Run after the tree is rewritten (model parallelism inserts layers and rebuilds slices)."""
        self._param_names = {}  # id(layer) -> full names of its parameters
        for path, layer in self.root.named_layers():
            layer.path = path or None
            if isinstance(layer, Container):
                layer.grad_hook = self._grads_ready
            if layer.params:
                self._param_names[id(layer)] = [_join(path, k) for k in layer.params]
        names = [n for n, _ in self.named_state()]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ShapeError(f"{self.name}: state names are not unique: {dup}; give children distinct names")
        self._flatten_grads()

    def _flatten_grads(self):
        """Make every gradient a view into one buffer, `grad_buffer`, laid out in reverse parameter order.

        Backward produces gradients roughly in that order, so a data-parallel reducer can scale and
        reduce contiguous runs of the buffer in place, with no copy in or out. `grad_offsets` maps
        each parameter's name to its (start, stop) in the buffer.
        """
        entries = [(_join(path, k), layer, k) for path, layer in self.root.named_layers() for k in layer.params]
        self.grad_buffer, self.grad_offsets = None, {}
        if not entries or len({layer.grads[k].dtype for _, layer, k in entries}) != 1:
            return
        _, first, key = entries[0]
        buf = self.backend.xp.zeros(sum(layer.grads[k].size for _, layer, k in entries), first.grads[key].dtype)
        off = 0
        for name, layer, k in reversed(entries):
            g = layer.grads[k]
            layer.grads[k] = buf[off : off + g.size].reshape(g.shape)
            self.grad_offsets[name] = (off, off + g.size)
            off += g.size
        self.grad_buffer = buf

    # -- changing the architecture -----------------------------------------------------
    def replace(self, path, layer):
        """Put `layer` where the layer at dotted `path` is, under its name, and rebuild; returns the old layer.

        Paths are the state dict's (Model.layers() lists them). After the rebuild, every parameter and
        buffer outside `path` whose name and shape are unchanged keeps its value; the rest start afresh.
        Change the model before an optimizer or trainer takes its parameters. A wrong path, or a layer that
        does not fit there, raises with the model as it was.
        """
        return self._edit(lambda: self.root.replace(path, layer), path)

    def insert(self, path, layer, name=None, after=False):
        """Put `layer` just before (after=True: after) the layer at dotted `path`, in the Sequential that
        holds it, as `name` (default: its class name in lower case), and rebuild as replace() does."""
        self._edit(lambda: self.root.insert(path, layer, name, after))

    def _edit(self, change, replaced=None):
        if self.sharding is not None:
            raise ConfigError(f"{self.name}: the model is split over processes; change it before "
                              "model_parallel.partition")
        trees = [(c, list(c.children)) for _, c in self.root.named_layers() if isinstance(c, Container)]
        before = dict(self.named_state())
        try:
            result = change()  # validates the path and the layer before it changes the tree
        except ConfigError as e:
            raise ConfigError(f"{self.name}: {e}") from None
        try:
            self._build()
        except BaseException:
            for container, children in trees:
                container.children = children
            self._build()
            self.load_state_dict(before)
            raise
        own = self.state_layout()
        kept = {k: v for k, v in before.items() if k in own and own[k][0] == tuple(v.shape)
                and not (replaced is not None and k.startswith(f"{replaced}."))}
        self.load_state_dict(kept, strict=False)
        return result

    # -- running -------------------------------------------------------------------------
    def forward(self, x, training=None):
        """Output for a batch x of shape (N, *input_shape); training defaults to the model's mode. x is
        taken in the model's dtype (float64 data does not turn a float32 model's work into float64)."""
        x = x.astype(self.backend.dtype, copy=False)
        return self.root.forward(x, self.training if training is None else training)

    __call__ = forward

    def backward(self, dy):
        """Backpropagate dL/doutput (taken in the model's dtype); every layer's grads are overwritten. Hooks
        fire as grads appear. Returns what the first layer returns: dL/dinput, or None where that layer
        skips it (a Conv2D or Dense first in a model; a pipeline stage after the first always gives it)."""
        return self.root.backward(dy.astype(self.backend.dtype, copy=False))

    def train(self):
        self.training = True
        return self

    def eval(self):
        self.training = False
        return self

    def add_grad_ready_hook(self, fn):
        """Call fn(names) during backward as soon as the gradients of those parameters are final.

        Layers finish in reverse order, so a data-parallel reducer can start communicating the last
        layers' gradients while earlier layers still compute.
        """
        self._hooks.append(fn)

    def set_tracer(self, tracer):
        """Time every layer's forward and backward into `tracer` (a profiling.Tracer), or stop (None)."""
        for _, layer in self.root.named_layers():
            if isinstance(layer, Container):
                layer.tracer = tracer

    def set_params_hook(self, fn):
        """Call fn(layer, phase) just before every leaf layer with parameters runs its forward or backward (ZeRO
        stage 3 gathers its parameters there), or stop (None)."""
        for _, layer in self.root.named_layers():
            if isinstance(layer, Container):
                layer.params_hook = fn

    def _grads_ready(self, layer):
        names = self._param_names[id(layer)]
        for fn in self._hooks:
            fn(names)

    # -- state ---------------------------------------------------------------------------
    def layers(self):
        """Depth-first (path, layer) pairs of every layer, containers included."""
        return [(p, l) for p, l in self.root.named_layers() if p]

    def units(self):
        """[(path, layer, the Sequential holding it)]: the layers in order with every Sequential opened up,
        blocks (additions, concatenations) and leaves whole: where a pipeline may cut, and the pieces
        activation recomputation groups into segments. A child with an empty name puts its own children in
        its parent's namespace (torchvision's names), so several units may share a path."""
        out = []

        def walk(seq, prefix):
            for name, child in seq.children:
                path = _join(prefix, name)
                if isinstance(child, Sequential):
                    walk(child, path)
                else:
                    out.append((path, child, seq))

        walk(self.root, "")
        return out

    def named_state(self):
        """(name, array) of every parameter and buffer, in state-dict order (each layer: parameters, then buffers)."""
        out = []
        for path, layer in self.root.named_layers():
            out += [(_join(path, k), v) for k, v in layer.params.items()]
            out += [(_join(path, k), v) for k, v in layer.buffers.items()]
        return out

    def parameters(self):
        """[(name, param, grad)] in state-dict order: what an optimizer updates."""
        return [
            (_join(path, k), v, layer.grads[k]) for path, layer in self.root.named_layers() for k, v in layer.params.items()
        ]

    def gradients(self):
        """[(name, grad)] in state-dict order: the gradients alone (what holds them does not hold the parameters,
        which ZeRO stage 3 lets go)."""
        return [(_join(path, k), layer.grads[k]) for path, layer in self.root.named_layers() for k in layer.params]

    def state_dict(self):
        """{name: array} of parameters and buffers (live arrays, not copies; the parameters gathered whole where
        ZeRO stage 3 shards them: copies then, and a collective of the replicas)."""
        return dict(self._own_state())

    def _own_state(self):
        """named_state() with the parameters whole over the replicas where ZeRO stage 3 shards them (gathered, a
        collective); the live arrays otherwise."""
        if self.param_shards is None:
            return self.named_state()
        whole = self.param_shards.whole()
        return [(k, whole.get(k, v)) for k, v in self.named_state()]

    def whole_state_dict(self):
        """{name: NumPy array} of parameters and buffers, whole: gathered from every rank of a model-parallel
        group (a collective there: every rank of the group calls it), from every stage of a pipeline onto its
        first (every stage calls it; None on the others), copies of the own arrays otherwise; the parameters
        gathered over the replicas where ZeRO stage 3 shards them (a collective of the replicas too)."""
        own = self._own_state()
        if self.pipeline is not None:  # each array whole within the stage's group first, where it is split
            cut = self.sharding
            return self.pipeline.gather({k: self.backend.to_numpy(v) if cut is None else cut.gather(k, v)
                                         for k, v in own})
        if self.sharding is None:
            return {k: np.array(self.backend.to_numpy(v)) for k, v in own}
        return {k: self.sharding.gather(k, v) for k, v in own}

    def state_layout(self):
        """{name: (shape, dtype)} of the whole state dict (what a one-process model holds; no communication)."""
        if self.pipeline is not None:
            return dict(self.pipeline.layout)
        cut = self.sharding
        return {k: (tuple(v.shape) if cut is None else cut.whole_shape(k, v.shape), np.dtype(v.dtype))
                for k, v in self.named_state()}

    @property
    def whole_input_shape(self):
        """The input shape of the whole model (of a pipeline stage: the first stage's)."""
        return self.pipeline.input_shape if self.pipeline is not None else self.input_shape

    @property
    def whole_name(self):
        """The name of the whole model (of a pipeline stage: the model it was cut from)."""
        return self.pipeline.name if self.pipeline is not None else self.name

    def load_state_dict(self, state, strict=True):
        """Copy arrays into the model's own (memory stays where it is). Names and shapes must match.

        With strict=False, names missing from `state` keep their values; extra names are an error
        either way, since they mean a different architecture.
        """
        own = dict(self.named_state())  # where ZeRO stage 3 shards the parameters, views shaped like them
        if self.pipeline is not None:  # whole arrays: a stage takes its own, and leaves the other stages' alone
            state = {k: v for k, v in state.items() if k in own or k not in self.pipeline.layout}
        if self.sharding is not None:  # whole arrays (a checkpoint, another layout) are cut to this rank's slices
            state = {k: self.sharding.cut(k, v) for k, v in state.items()}
        extra = sorted(set(state) - set(own))
        missing = sorted(set(own) - set(state))
        if extra or (strict and missing):
            raise ShapeError(
                f"{self.name}: state dict does not fit this model: "
                + "; ".join(s for s in (f"unexpected {extra[:5]}" if extra else "", f"missing {missing[:5]}" if strict and missing else "") if s)
            )
        for k, v in state.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ShapeError(f"{self.name}: {k} has shape {tuple(v.shape)} in the state dict, expected {tuple(own[k].shape)}")
        shards = self.param_shards
        if shards is not None:  # the parameters into this replica's shard
            shards.load({k: v for k, v in state.items() if k in shards.names})
            state = {k: v for k, v in state.items() if k not in shards.names}
        for k, v in state.items():
            own[k][...] = self.backend.asarray(v, dtype=own[k].dtype)

    def count_params(self):
        """Number of trainable scalars (of the whole model, when it is split over ranks or cut into stages)."""
        layout = self.state_layout()
        names = self.pipeline.param_names if self.pipeline is not None else [n for n, _, _ in self.parameters()]
        return sum(int(np.prod(layout[name][0])) for name in names)

    def flops(self):
        """Forward FLOPs per sample."""
        return self.root.flops()

    def random_input(self, n, rng, dtype=None):
        """A NumPy batch of n random inputs this model takes, drawn from Generator `rng`: token ids in the
        vocabulary of a model whose first layer is an Embedding, else standard normal values; in `dtype`
        (default: the backend's). What timing and memory measurements feed a model."""
        dtype = self.backend.dtype if dtype is None else dtype
        first = next((layer for _, layer in self.root.named_layers() if not layer.named_children()), None)
        if isinstance(first, Embedding):
            return rng.integers(0, first.vocab_size, (n, *self.input_shape)).astype(dtype)
        return rng.standard_normal((n, *self.input_shape)).astype(dtype)

    def params_sha256(self, whole=None):
        """SHA-256 over all parameters in state-dict order, as little-endian bytes of their dtype; of the
        whole model when it is split over ranks or sharded over replicas (ZeRO stage 3: a collective then), or of
        `whole` (whole_state_dict())."""
        def whole_params():
            if whole is not None and self.pipeline is not None:
                yield from (whole[name] for name in self.pipeline.param_names)
                return
            if whole is None and self.param_shards is not None:  # gathered a run, or a layer, at a time
                names = [name for name, _, _ in self.parameters()]
                if self.sharding is None:  # the digest is of the bytes in order, whatever runs they come in
                    yield from self.param_shards.runs(names)
                    return
                for name, p in zip(names, self.param_shards.gathered(names, reuse=True)):
                    yield self.sharding.gather(name, p)
                return
            for name, p, _ in self.parameters():
                if whole is not None:
                    yield whole[name]
                elif self.sharding is not None:
                    yield self.sharding.gather(name, p)
                else:
                    yield self.backend.to_numpy(p)

        return params_digest(whole_params())

    # -- reporting -----------------------------------------------------------------------
    def summary(self, file=None):
        """Print one row per layer: path, layer, output shape, parameters, forward FLOPs per sample."""
        rows = [("layer", "type", "output shape", "params", "MFLOPs")]
        for path, layer in self.layers():
            own = sum(int(np.prod(p.shape)) for p in layer.params.values())
            flops = "" if isinstance(layer, Container) else f"{layer.flops() / 1e6:.3f}"
            rows.append((path, layer.describe(), str(layer.output_shape), f"{own:,}" if own else "", flops))
        rows.append(("total", "", str(self.output_shape), f"{self.count_params():,}", f"{self.flops() / 1e6:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        text = f"{self.name}: input {self.input_shape}, {self.backend!r}\n" + "\n".join(lines)
        print(text, file=file)
        return text


def params_digest(arrays):
    """SHA-256 (hex) over NumPy arrays in order, as little-endian bytes of their dtype: Model.params_sha256's
    digest, which a pipeline's stages compute over the arrays they gather."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8))  # no copy of the bytes
    return h.hexdigest()
