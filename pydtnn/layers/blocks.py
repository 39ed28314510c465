"""Containers: a chain of layers, and blocks whose parallel paths are summed or concatenated.

    Sequential([Conv2D(16, 3), ReLU()])              children named "0", "1"
    Sequential({"conv1": Conv2D(16, 3), ...})        children named by the dict's keys
    AdditionBlock([Conv2D(16, 3, padding=1), BatchNorm()], [])    residual: path + identity
    ConcatenationBlock([Conv2D(8, 1)], [Conv2D(8, 3, padding=1)]) channel concat (Inception)

A path is a Sequential (a list or dict of layers becomes one); an empty path is the identity.
Paths are named "0", "1", ... unless `names` says otherwise; an empty name puts the path's children
directly in the block's namespace, which is how torchvision's names are reproduced:

    AdditionBlock({"conv1": ..., "bn1": ..., "relu": ..., "conv2": ..., "bn2": ...},
                  [Conv2D(128, 1, stride=2, use_bias=False), BatchNorm()], names=("", "downsample"))
    # -> conv1.weight, bn1.weight, ..., downsample.0.weight, downsample.1.running_mean
Every container calls `grad_hook(child)` right after a child with parameters has written its
gradients, which is how a data-parallel reducer starts communication during backward.

An unbuilt tree can be changed by the dotted paths its state dict uses (Model.replace/insert do the
same on a built model and rebuild it):

    tree = Sequential({"conv": Conv2D(8, 3), "relu": ReLU(), "flat": Flatten(), "fc": Dense(10)})
    tree.replace("relu", LeakyReLU())                   # returns the ReLU; the new layer is "relu"
    tree.insert("fc", Dropout(0.2), name="drop")        # before "fc", in the Sequential holding it
"""

import numpy as np

from pydtnn.errors import ConfigError, ShapeError
from pydtnn.layers.base import Layer, _join


class Container(Layer):
    """A layer made of named children; shared plumbing for Sequential and the blocks."""

    def __init__(self):
        super().__init__()
        self.children = []  # [(name, layer)]
        self.grad_hook = None  # set by Model: called as grad_hook(layer) when a child's grads are ready
        self.tracer = None  # set by Model.set_tracer: times each leaf child's forward and backward
        self.params_hook = None  # set by Model.set_params_hook: called as params_hook(leaf, phase) before it runs

    def named_children(self):
        return list(self.children)

    def flops(self):
        return sum(child.flops() for _, child in self.children)

    def _forward_child(self, child, x, training):
        if self.params_hook is not None and child.params:  # a leaf's parameters gathered (ZeRO stage 3)
            self.params_hook(child, "forward")
        if self.tracer is None or isinstance(child, Container):
            return child.forward(x, training)
        with self.tracer.span(child.path or child.name, "forward"):
            return child.forward(x, training)

    def _backward_child(self, child, dy):
        if self.params_hook is not None and child.params:
            self.params_hook(child, "backward")
        if self.tracer is None or isinstance(child, Container):
            dx = child.backward(dy)
        else:
            with self.tracer.span(child.path or child.name, "backward"):
                dx = child.backward(dy)
        if child.params and self.grad_hook is not None:
            self.grad_hook(child)
        return dx

    # -- changing the tree (before it is built; Model.replace and Model.insert rebuild) ---------
    def replace(self, path, layer):
        """Put `layer` in place of the layer at dotted `path` below this container, under the same name;
        returns the layer taken out. Paths are the state dict's ("layer1.0.relu"; Model.layers() lists them)."""
        self._check_new(layer)
        parent, i = self._locate(path)
        name, old = parent.children[i]
        parent.children[i] = (name, layer)
        return old

    def insert(self, path, layer, name=None, after=False):
        """Put `layer` just before (after=True: after) the layer at dotted `path`, in the Sequential that
        holds it, as `name` (default: its class name in lower case). Other layers keep their names."""
        self._check_new(layer)
        parent, i = self._locate(path)
        if not isinstance(parent, Sequential):
            raise ConfigError(f"cannot insert next to {path!r}: it is a path of {parent.describe()}, not a step of a "
                              f"Sequential; replace {path!r} with a Sequential of the layers it should hold")
        name = type(layer).__name__.lower() if name is None else name
        if not isinstance(name, str) or not name or "." in name:
            raise ConfigError(f"cannot insert {layer.describe()} as {name!r}: expected a non-empty name without dots")
        taken = _join(path.rpartition(".")[0], name)
        if any(p == taken for p, _ in self.named_layers()):
            raise ConfigError(f"cannot insert {layer.describe()} as {name!r}: {taken!r} is already a layer; "
                              f"pass another name=")
        parent.children.insert(i + 1 if after else i, (name, layer))

    def _check_new(self, layer):
        if not isinstance(layer, Layer):
            raise TypeError(f"expected a Layer to put in the tree, got {layer!r:.80}")
        for path, own in self.named_layers():
            if own is layer:
                raise ConfigError(f"{layer.describe()} is already in the tree at {path or '(the top)'!r}; a layer "
                                  f"has one place: put a new instance")

    def _locate(self, path):
        """(container, index in its children) of the layer at dotted `path` below this container."""
        if isinstance(path, str) and path:
            for where, layer in self.named_layers():  # depth-first: of layers sharing a path, the outermost
                if isinstance(layer, Container):
                    for i, (name, _) in enumerate(layer.children):
                        if name and _join(where, name) == path:
                            return layer, i
        raise ConfigError(self._no_layer(path))

    def _no_layer(self, path):
        """The error for a `path` that names no layer: the deepest part of it that exists, and what it holds."""
        if not isinstance(path, str) or not path:
            top = self._below("")
            example = f"such as {top[0]!r}" if top else "it is empty"
            return f"expected the dotted path of a layer in the tree ({example}), got {path!r}"
        first = {}
        for p, layer in self.named_layers():
            first.setdefault(p, layer)
        parts = path.split(".")
        known = next((".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1) if ".".join(parts[:k]) in first), "")
        holder = f"{known!r}" if known else "the top level"
        below = self._below(known)
        if not below:
            return f"no layer {path!r}: {holder} is {first[known].describe()}, which holds no layers"
        shown = ", ".join(below[:40]) + (f", ... ({len(below)} in all)" if len(below) > 40 else "")
        return f"no layer {path!r}: {holder} holds {shown}"

    def _below(self, prefix):
        """Names of the layers one step below dotted path `prefix` ('' for the top), in order."""
        start = f"{prefix}." if prefix else ""
        return list(dict.fromkeys(p[len(start):].split(".")[0] for p, _ in self.named_layers()
                                  if p and p.startswith(start) and p != prefix))


def _named(layers):
    if isinstance(layers, dict):
        items = list(layers.items())
    else:
        items = [(c if isinstance(c, tuple) else (str(i), c)) for i, c in enumerate(layers)]
    for name, layer in items:
        if not isinstance(layer, Layer):
            raise TypeError(f"child {name!r} is {layer!r}, not a Layer")
    return items


class Sequential(Container):
    """Layers applied one after the other; shapes are inferred from the first layer on."""

    def __init__(self, layers=()):
        super().__init__()
        self.children = _named(layers)

    def describe(self):
        return f"Sequential({len(self.children)})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        shape, first = self.input_shape, True
        for _, child in self.children:
            child.need_dx = self.need_dx or not first
            child.build(shape, dtype, self.backend)
            shape, first = child.output_shape, False
        self.output_shape = shape

    def forward(self, x, training=True):
        for _, child in self.children:
            x = self._forward_child(child, x, training)
        return x

    def backward(self, dy):
        for _, child in reversed(self.children):
            dy = self._backward_child(child, dy)
        return dy


class _Paths(Container):
    """Parallel paths over the same input; subclasses say how outputs combine."""

    def __init__(self, *paths, names=None):
        super().__init__()
        if not paths:
            raise ValueError(f"{type(self).__name__} needs at least one path")
        names = [str(i) for i in range(len(paths))] if names is None else list(names)
        if len(names) != len(paths):
            raise ValueError(f"{type(self).__name__}: {len(paths)} paths but {len(names)} names")
        self.children = [(n, p if isinstance(p, Layer) else Sequential(p)) for n, p in zip(names, paths)]

    def describe(self):
        return f"{type(self).__name__}({len(self.children)} paths)"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        for _, path in self.children:
            path.need_dx = self.need_dx
            path.build(self.input_shape, dtype, self.backend)
        self.output_shape = self._combine_shapes([p.output_shape for _, p in self.children])

    def _sum_dx(self, dxs):
        if not self.need_dx:
            return None
        return _sum_new(self.xp, dxs)


def _sum_new(xp, arrays):
    """Sum of the arrays into a new array (none of them is modified): the first addition allocates
    the result, so no pass copies an input first."""
    if len(arrays) == 1:
        return arrays[0].copy()
    total = xp.add(arrays[0], arrays[1])
    for a in arrays[2:]:
        total += a
    return total


class AdditionBlock(_Paths):
    """y = path_0(x) + path_1(x) + ...; all paths must give the same shape (residual blocks)."""

    def _combine_shapes(self, shapes):
        if any(s != shapes[0] for s in shapes):
            raise ShapeError(f"{self.name}: paths give different shapes {shapes}; an addition needs equal shapes")
        return shapes[0]

    def forward(self, x, training=True):
        y, first = None, None
        for _, path in self.children:
            out = self._forward_child(path, x, training)
            if first is None:
                first = out
            elif y is None:
                y = self.xp.add(first, out)
            else:
                y += out
        return first.copy() if y is None else y

    def backward(self, dy):
        return self._sum_dx([self._backward_child(path, dy) for _, path in self.children])


class ConcatenationBlock(_Paths):
    """y = concat([path_0(x), path_1(x), ...], channel axis); paths must agree on H and W."""

    def _combine_shapes(self, shapes):
        if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
            raise ShapeError(
                f"{self.name}: paths give shapes {shapes}; a channel concatenation needs equal (H, W)"
            )
        self.splits = np.cumsum([s[0] for s in shapes])[:-1].tolist()
        return (sum(s[0] for s in shapes),) + shapes[0][1:]

    def forward(self, x, training=True):
        return self.xp.concatenate([self._forward_child(path, x, training) for _, path in self.children], axis=1)

    def backward(self, dy):
        parts = self.xp.split(dy, self.splits, axis=1)
        return self._sum_dx(
            [self._backward_child(path, self.xp.ascontiguousarray(d)) for (_, path), d in zip(self.children, parts)]
        )
