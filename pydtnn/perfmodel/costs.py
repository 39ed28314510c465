"""What one training step of every layer costs on the CPU backend: FLOPs and bytes moved, per phase.

    costs = layer_costs(model, batch_size=64)      # one LayerCost per leaf layer and per block, forward order
    totals(costs).forward.flops                    # == 64 * model.flops() where no layer runs a stride-2 twin
    gradient_ready_order(model)                    # ['3.weight', '3.bias', '0.weight', '0.bias']

Each cost is read from the built layer and from what the backend chose for it when it was built
(a convolution's plan in use, `backend.plan_in_use(layer.plan)`: the one built with the layer, or the
one measured when the backend autotunes; the compiled 2x2 path for pooling, compiled or NumPy
BatchNorm and ReLU), and follows the code of that algorithm in `pydtnn/backends/cpu/`. A training step
has three phases per layer: forward, backward_data (dL/dx) and backward_weights (dL/dW and dL/db).
Every layer's formulas are below except Conv2D's and the transformer layers': each convolution algorithm's
are next to its code (its entry in backends/cpu/conv_algorithms.py names them), conv_costs.py adds what every
algorithm shares, and transformer_costs.py holds LayerNorm's, GELU's and layers/transformer.py's; each phase's cost is a PhaseCost (phase_cost.py).

Units: FLOPs count a multiply-add as 2; bytes are memory traffic. Notation in the formulas below:
N batch, s bytes per element of the model's dtype, X and Y the elements of a layer's input and output
for the whole batch (X = N*C*H*W), |W| the weight's elements, kk = kh*kw.

Counting rules, the same for every layer:
- flops are the arithmetic of the geometry the algorithm computes: the layer's own, except that
  `direct_stride2` computes the stride-1 twin (4x the multiply-adds) and a stride-1 convolution's dx
  is the convolution of dy with the flipped kernel over x's whole H x W. Columns a kernel computes
  and throws away (the wide grids, channel blocks rounded up) are not counted: they are the kernel's
  efficiency, which its calibrated rate holds.
- bytes count each array a pass reads or writes once per pass (a pass: one NumPy call over the
  batch, or one compiled kernel); a strided view counts the elements it touches. Re-reads that an
  algorithm's blocking keeps in cache (per-sample scratch, batch chunks sized for L2) are not
  counted; scratch buffers taken zeroed from the pool are counted where a pass writes them.
- backward_data is zero only where the backend skips it: a Conv2D, a Dense or a block whose input
  needs no gradient (`need_dx`). The other layers compute dx anyway, so their dx is counted.
- Blocks: an AdditionBlock adds its paths' outputs and a ConcatenationBlock copies them into one
  tensor; each has one LayerCost of its own (kind "AdditionBlock" / "ConcatenationBlock", its path
  as name), placed after the layers of its paths. A Sequential costs nothing of its own.
"""

import math
from dataclasses import dataclass

import numpy as np

from pydtnn.backends.cpu import CPUBackend
from pydtnn.backends.cpu import pooling as cpu_pooling
from pydtnn.backends.geometry import positions, touched, window_layout
from pydtnn.distributed.model_parallel import Gather, SumGrad, SumOutput
from pydtnn.errors import ConfigError
from pydtnn.layers import (
    AdaptiveAvgPool2D,
    AdditionBlock,
    AvgPool2D,
    BatchNorm,
    ConcatenationBlock,
    Container,
    Conv2D,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool2D,
    LeakyReLU,
    MaxPool2D,
    ReLU,
    ReLU6,
    Sequential,
    Sigmoid,
    Softmax,
    Tanh,
)
from pydtnn.perfmodel.conv_costs import conv2d
from pydtnn.perfmodel.phase_cost import ZERO, PhaseCost
from pydtnn.perfmodel.transformer_costs import FORMULAS as TRANSFORMER_FORMULAS


@dataclass(frozen=True)
class LayerCost:
    """The cost of one layer (or one block's combining step) in a training step of batch_size samples.

    name: dotted path as in Model.layers(); kind: class name; algorithm: the backend's choice
    (Conv2D: plan.algorithm; pooling: "compiled_2x2", "compiled" (max pooling's other windows) or "numpy";
    else None); kernel_class: whose FLOP rate applies, one of machine.KERNEL_CLASSES; params,
    param_bytes: trainable parameters; activation_bytes: the output for the whole batch; need_dx:
    whether dL/dinput is wanted; batch: the samples costed; signature: what the layer computes whatever its
    place (its description, input and output shapes, algorithm, need_dx and dtype), which names its measured
    times in a layer profile (layer_profile.py).
    """

    name: str
    kind: str
    algorithm: str | None
    kernel_class: str
    forward: PhaseCost
    backward_data: PhaseCost
    backward_weights: PhaseCost
    params: int
    param_bytes: int
    activation_bytes: int
    need_dx: bool
    batch: int = 0
    signature: str = ""

    @property
    def backward(self):
        return self.backward_data + self.backward_weights


@dataclass(frozen=True)
class Totals:
    """Sums over a list of LayerCost."""

    forward: PhaseCost
    backward_data: PhaseCost
    backward_weights: PhaseCost
    params: int
    param_bytes: int
    activation_bytes: int

    @property
    def step(self):
        """Forward plus backward: one training step's FLOPs and bytes (the optimizer update excluded)."""
        return self.forward + self.backward_data + self.backward_weights


def totals(costs):
    """Totals of a list of LayerCost: every phase and size summed."""
    return Totals(
        forward=sum((c.forward for c in costs), ZERO),
        backward_data=sum((c.backward_data for c in costs), ZERO),
        backward_weights=sum((c.backward_weights for c in costs), ZERO),
        params=sum(c.params for c in costs),
        param_bytes=sum(c.param_bytes for c in costs),
        activation_bytes=sum(c.activation_bytes for c in costs),
    )


# -- the model ---------------------------------------------------------------------------------------


def layer_costs(model, batch_size, need_dx_first=False):
    """[LayerCost] of every leaf layer of `model` (a pydtnn Model on a CPUBackend), blocks included,
    in forward order, for a training step of `batch_size` samples. need_dx_first: the model's input
    wants a gradient too (a pipeline stage), so no layer skips its dx."""
    if not isinstance(model.backend, CPUBackend):
        raise TypeError(
            f"layer_costs: {model.name} runs on {model.backend!r}; the cost formulas follow the CPU backend's "
            "algorithms, build the model on a CPUBackend"
        )
    n = int(batch_size)
    if n < 1 or n != batch_size:
        raise ValueError(f"layer_costs: batch_size must be a positive integer, got {batch_size!r}")
    return [_cost(layer, n, bool(layer.need_dx or need_dx_first)) for layer in _leaves_and_blocks(model.root)]


def parameter_bytes(model):
    """{layer path: bytes of its trainable parameters} for every layer that has any, in forward order
    (the size of the gradients each grad-ready hook call makes final)."""
    return {
        path: sum(int(p.nbytes) for p in layer.params.values()) for path, layer in model.layers() if layer.params
    }


def gradient_ready_order(model):
    """Parameter names in the order their gradients become final during backward, recorded from the
    model's own grad-ready hook over one training forward and backward of a batch of one sample.

    The model is left as it was: its BatchNorm running statistics, its gradients and its backend's
    random generator are restored, and the hook is removed."""
    order = []

    def record(names):
        order.extend(names)

    backend = model.backend
    saved = [(a, a.copy()) for _, layer in model.root.named_layers() for a in layer.buffers.values()]
    saved += [(g, g.copy()) for _, _, g in model.parameters()]
    saved_rng = backend.rng.bit_generator.state
    model.add_grad_ready_hook(record)
    try:
        x = model.random_input(1, np.random.default_rng(0))
        y = model.forward(backend.asarray(x), training=True)
        model.backward(backend.xp.ones_like(y))
    finally:
        model._hooks.remove(record)  # Model has no public way to remove a hook
        for a, copy in saved:
            a[...] = copy
        backend.rng.bit_generator.state = saved_rng
    return order


def _leaves_and_blocks(container):
    """Leaf layers depth-first, each AdditionBlock / ConcatenationBlock after the layers of its paths."""
    for _, child in container.named_children():
        if isinstance(child, Container):
            yield from _leaves_and_blocks(child)
            if not isinstance(child, Sequential):
                yield child
        else:
            yield child


def _cost(layer, n, need_dx):
    for kind, formula in _FORMULAS:
        if isinstance(layer, kind):
            algorithm, kernel_class, fwd, bwd_data, bwd_weights = formula(layer, n, need_dx)
            break
    else:
        known = sorted(c.__name__ for k, _ in _FORMULAS for c in (k if isinstance(k, tuple) else (k,)))
        raise ConfigError(  # a user's own layer (--model_file, a changed zoo model): the model cannot cost it
            f"the performance model has no cost formula for {layer.name}, a {type(layer).__name__}; it costs "
            f"{', '.join(known)}: add one to pydtnn/perfmodel/costs.py")
    s = layer.dtype.itemsize
    return LayerCost(
        name=layer.path,
        kind=type(layer).__name__,
        algorithm=algorithm,
        kernel_class=kernel_class,
        forward=fwd,
        backward_data=bwd_data,
        backward_weights=bwd_weights,
        params=sum(int(p.size) for p in layer.params.values()),
        param_bytes=sum(int(p.nbytes) for p in layer.params.values()),
        activation_bytes=n * _size(layer.output_shape) * s,
        need_dx=need_dx,
        batch=n,
        signature=signature(layer, algorithm, need_dx),
    )


def signature(layer, algorithm, need_dx):
    """What a built layer computes, whatever its path: its description (Layer.describe: kind and
    hyperparameters), input and output shapes, parameters (a bias or not), algorithm, whether it computes dx,
    and dtype."""
    shape = "x".join(map(str, layer.input_shape or ()))
    out = "x".join(map(str, layer.output_shape or ()))
    params = sum(int(p.size) for p in layer.params.values())
    return (f"{layer.describe()} {shape}->{out} p{params} {algorithm or '-'} dx{int(need_dx)} "
            f"{np.dtype(layer.dtype).name}")


def _size(shape):
    return int(np.prod(shape, dtype=np.int64))



# -- dense -------------------------------------------------------------------------------------------


def _dense(layer, n, need_dx):
    """Dense, GEMMs through backend.matmul; I = in_features, O = units, N the rows (samples x tokens):
    forward         2*N*I*O (+ N*O bias) flops; reads x and W, writes y (+ y read and written for bias)
    backward_data   2*N*I*O flops; reads dy and W, writes dx
    backward_weights 2*N*I*O (+ N*O) flops; reads dy and x, writes dW (+ reads dy for db)
    """
    s = layer.dtype.itemsize
    i, o = layer.input_shape[-1], layer.units
    n *= math.prod(layer.input_shape[:-1])
    x, y, w = n * i * s, n * o * s, i * o * s
    gemm = 2 * n * i * o
    bias_f = PhaseCost(n * o, 2 * y) if layer.use_bias else ZERO
    bias_b = PhaseCost(n * o, y) if layer.use_bias else ZERO
    fwd = PhaseCost(gemm, x + w + y) + bias_f
    bwd_w = PhaseCost(gemm, y + x + w) + bias_b
    bwd_d = PhaseCost(gemm, y + w + x) if need_dx else ZERO
    return None, "gemm", fwd, bwd_d, bwd_w


# -- pooling -----------------------------------------------------------------------------------------


def _maxpool(layer, n, need_dx):
    """MaxPool2D, forward flops N*Ho*Wo*C*kk (Layer.flops), backward none (a scatter; adds N*Ho*Wo*C*kk
    where windows overlap). i = bytes of an index (1 up to 256 window positions, else 4).
    compiled 2x2: forward x read, y and its uint8 index written; backward dy and index read, dx written.
    compiled, other windows: forward x read, y and its index written (a window's rows come from cache);
    backward dx zeroed and written (X*s), dy and the index read, one add per output where windows overlap.
    NumPy, per kernel position k touching Yk outputs: forward y set from the first position (Yk read and
    written) or to -inf (Y written), the index zeroed (Y*i), then per other position the window's view
    read twice, y's read twice and written, a bool mask written and read, the index updated
    (Yk*(5s + 2 + 4i)); backward dx zeroed (X*s), then per position the index compared (Yk*(i + 1)) and
    dy copied where it won (Yk*(2s + 1), one more Yk*s where windows overlap and it adds).
    """
    g, s = layer.geometry, layer.dtype.itemsize
    x, y = n * g.c * g.h * g.w, n * g.c * g.ho * g.wo
    fwd_flops = n * layer.flops()
    if cpu_pooling.compiled_2x2(layer.backend, g):
        return "compiled_2x2", "elementwise", PhaseCost(fwd_flops, x * s + y * s + y), PhaseCost(0, y * s + y + x * s), ZERO
    i = 1 if g.kh * g.kw <= 256 else 4
    disjoint, _ = window_layout(g)
    if layer.backend.kernels == "numba":
        bwd = PhaseCost(0 if disjoint else y, x * s + y * (s + i))
        return "compiled", "elementwise", PhaseCost(fwd_flops, x * s + y * (s + i)), bwd, ZERO
    pos = positions(g)
    yk = [n * g.c * t for t in touched(g)]
    full = pos[0][0] == 0 and pos[0][3] == slice(0, g.ho) and pos[0][4] == slice(0, g.wo)
    fwd = y * i + (2 * yk[0] * s if full else y * s)
    fwd += sum(t * (5 * s + 2 + 4 * i) for t in (yk[1:] if full else yk))
    per = (2 * s + 1) if disjoint else (3 * s + 1)
    bwd = x * s + sum(t * (i + 1 + per) for t in yk)
    bwd_flops = 0 if disjoint else sum(yk)
    return "numpy", "elementwise", PhaseCost(fwd_flops, fwd), PhaseCost(bwd_flops, bwd), ZERO


def _avgpool(layer, n, need_dx):
    """AvgPool2D, forward flops N*Ho*Wo*C*kk (Layer.flops), backward Y (the divisions).
    compiled 2x2: forward x read, y written; backward dy read, dx written.
    NumPy, per kernel position k touching Yk outputs: forward y set from the first position (2*Yk*s) or
    zeroed (Y*s), then per other position y's view read and written and the window's read (3*Yk*s),
    then divided in place (2*Y*s); backward dy divided into a new array (2*Y*s), dx zeroed unless the
    windows tile it exactly (X*s), per position the share written into dx (2*Yk*s) or added where windows
    overlap (3*Yk*s, Yk flops).
    """
    g, s = layer.geometry, layer.dtype.itemsize
    x, y = n * g.c * g.h * g.w, n * g.c * g.ho * g.wo
    fwd_flops = n * layer.flops()
    if cpu_pooling.compiled_2x2(layer.backend, g):
        return "compiled_2x2", "elementwise", PhaseCost(fwd_flops, (x + y) * s), PhaseCost(y, (y + x) * s), ZERO
    pos = positions(g)
    yk = [n * g.c * t for t in touched(g)]
    full = pos[0][0] == 0 and pos[0][3] == slice(0, g.ho) and pos[0][4] == slice(0, g.wo)
    fwd = (2 * yk[0] if full else y) + 3 * sum(yk[1:] if full else yk) + 2 * y
    disjoint, covering = window_layout(g)
    bwd = 2 * y + (0 if covering else x) + (2 if disjoint else 3) * sum(yk)
    bwd_flops = y + (0 if disjoint else sum(yk))
    return "numpy", "elementwise", PhaseCost(fwd_flops, fwd * s), PhaseCost(bwd_flops, bwd * s), ZERO


def _global_avgpool(layer, n, need_dx):
    """GlobalAvgPool2D: forward X flops, x read and y (N*C) written; backward N*C flops, dy divided into a
    new array (2*N*C*s) and broadcast into dx (X*s)."""
    s = layer.dtype.itemsize
    x, y = n * _size(layer.input_shape), n * layer.input_shape[0]
    return None, "elementwise", PhaseCost(x, (x + y) * s), PhaseCost(y, (2 * y + x) * s), ZERO


def _adaptive_avgpool(layer, n, need_dx):
    """AdaptiveAvgPool2D: nothing where the input already has the output's size; else with B = the
    elements its bins cover (N*C*sum of bin areas): forward B flops, B read and Y written (per bin);
    backward Y + B flops, dx zeroed (X*s), dy's per-bin shares (2*Y*s), B read and written into dx."""
    if layer.identity:
        return None, "elementwise", ZERO, ZERO, ZERO
    s = layer.dtype.itemsize
    c = layer.input_shape[0]
    x, y = n * _size(layer.input_shape), n * _size(layer.output_shape)
    bins = n * c * sum((r1 - r0) * (c1 - c0) for r0, r1 in layer.rows for c0, c1 in layer.cols)
    return None, "elementwise", PhaseCost(bins, (bins + y) * s), PhaseCost(y + bins, (x + 2 * y + 2 * bins) * s), ZERO


# -- normalization, activations, dropout, shape ------------------------------------------------------


def _batchnorm(layer, n, need_dx):
    """BatchNorm in training on the batch's own statistics, E = X elements:
    forward         4*E flops (Layer.flops); compiled: three passes reading x (sum, centered variance,
                    affine) and y written (4*X*s); NumPy, or synchronized statistics: x read for the sums
                    and for the centered dot products, then the affine map's two passes (y = a*x, y += b:
                    x read, y written, read and written): 6*X*s
    backward_weights 4*E flops; compiled: dy and x read (2*X*s); NumPy: dy read for db, dy and x for dW
                    (3*X*s)
    backward_data   4*E flops; dy and x read, dx written (3*X*s), both ways
    """
    s = layer.dtype.itemsize
    e = n * _size(layer.input_shape)
    compiled = layer.backend.kernels == "numba" and layer.sync is None
    fwd = PhaseCost(4 * e, (4 if compiled else 6) * e * s)
    bwd_w = PhaseCost(4 * e, (2 if compiled else 3) * e * s)
    return None, "elementwise", fwd, PhaseCost(4 * e, 3 * e * s), bwd_w


def _relu(layer, n, need_dx):
    """ReLU and ReLU6 (capped): E flops each way; forward x read, y written (2*X*s);
    backward dy and y read, dx written (3*X*s). With the NumPy kernels the mask y > 0 written and read
    (2*E bytes); capped, the cap's pass over y (2*X*s) and y < cap's mask and their & (X*s + 4*E)."""
    s = layer.dtype.itemsize
    e = n * _size(layer.input_shape)
    capped = isinstance(layer, ReLU6)
    if layer.backend.kernels == "numba":
        fwd_extra = bwd_extra = 0
    else:
        fwd_extra, bwd_extra = (2 * e * s, e * s + 6 * e) if capped else (0, 2 * e)
    return None, "elementwise", PhaseCost(e, 2 * e * s + fwd_extra), PhaseCost(e, 3 * e * s + bwd_extra), ZERO


# (forward, backward) bytes of NumPy activations as (a, b): a*X*s + b*E, one term per array each
# expression of activation.py reads or writes (bool masks 1 byte); and backward FLOPs per element.
_ACTIVATIONS = {
    LeakyReLU: ((7, 3), (5, 1), 2),  # x>0, x>0, x*a, where / dy*a, where
    Sigmoid: ((19, 2), (8, 0), 3),  # abs, neg, exp, x>=0, 1+e (twice), 1/., e/., where / dy*y, 1-y, *
    Tanh: ((2, 0), (7, 0), 3),  # tanh / y*y, 1-., dy*.
    Softmax: ((8, 0), (9, 0), 4),  # max, x-m, exp, sum, e/s / dy*y, sum, dy-s, y*.
}


def _activation(layer, n, need_dx):
    """LeakyReLU, Sigmoid, Tanh, Softmax: NumPy expressions; forward flops Layer.flops, bytes
    a*X*s + b*E from the table above (one term per array each expression reads or writes)."""
    s = layer.dtype.itemsize
    e = n * _size(layer.input_shape)
    (fa, fb), (ba, bb), bflops = next(v for kind, v in _ACTIVATIONS.items() if isinstance(layer, kind))
    return None, "elementwise", PhaseCost(n * layer.flops(), fa * e * s + fb * e), PhaseCost(bflops * e, ba * e * s + bb * e), ZERO


def _dropout(layer, n, need_dx):
    """Dropout in training (rate > 0; rate 0 is the identity and costs nothing): forward 2*E flops; the
    mask drawn as float32 (4*E written), compared (4*E read, E written), converted (E read, X*s written)
    and scaled (2*X*s), then x*mask (3*X*s); backward E flops, dy*mask (3*X*s)."""
    if layer.rate == 0:
        return None, "elementwise", ZERO, ZERO, ZERO
    s = layer.dtype.itemsize
    e = n * _size(layer.input_shape)
    return None, "elementwise", PhaseCost(2 * e, 10 * e + 6 * e * s), PhaseCost(e, 3 * e * s), ZERO


def _flatten(layer, n, need_dx):
    """Flatten: a reshape of a contiguous array, a view each way: nothing moves."""
    return None, "elementwise", ZERO, ZERO, ZERO


# -- blocks ------------------------------------------------------------------------------------------


def _addition(block, n, need_dx):
    """AdditionBlock of p paths, E = output elements: forward (p-1)*E flops, the first sum into a new
    array and the others in place ((p-1)*3*Y*s; one path: its output copied, 2*Y*s); backward_data, where
    the input wants a gradient, the paths' dx summed the same way over the input's elements."""
    s = block.dtype.itemsize
    p = len(block.children)
    y, x = n * _size(block.output_shape), n * _size(block.input_shape)
    fwd = PhaseCost((p - 1) * y, ((p - 1) * 3 if p > 1 else 2) * y * s)
    return None, "elementwise", fwd, _sum_dx(p, x, s) if need_dx else ZERO, ZERO


def _concatenation(block, n, need_dx):
    """ConcatenationBlock of p paths: forward the paths' outputs copied into one tensor (2*Y*s); backward
    dy's channel slices copied contiguous (2*Y*s where N > 1: a slice of one sample is contiguous
    already), then, where the input wants a gradient, the paths' dx summed as in AdditionBlock."""
    s = block.dtype.itemsize
    p = len(block.children)
    y, x = n * _size(block.output_shape), n * _size(block.input_shape)
    split = 2 * y * s if n > 1 else 0
    bwd = PhaseCost(0, split) + (_sum_dx(p, x, s) if need_dx else ZERO)
    return None, "elementwise", PhaseCost(0, 2 * y * s), bwd, ZERO


def _gather(layer, n, need_dx):
    """model_parallel.Gather of a split tensor into a whole one of Y elements (the allgather itself is
    communication, predict.py): forward the gathered blocks copied into place (2*Y*s); backward, this
    rank's channels of dy copied contiguous (2*X*s, X its input's elements), or, before a split layer, dy's
    blocks copied rank after rank into the reduce-scatter's buffer (2*Y*s)."""
    s = layer.dtype.itemsize
    y, x = n * _size(layer.output_shape), n * _size(layer.input_shape)
    return None, "elementwise", PhaseCost(0, 2 * y * s), PhaseCost(0, 2 * (y if layer.reduce_grad else x) * s), ZERO


def _sum_grad(layer, n, need_dx):
    """model_parallel.SumGrad: the identity forward; backward an allreduce of dy in place (communication).
    SumOutput: forward an allreduce of y in place (communication); backward the identity."""
    return None, "elementwise", ZERO, ZERO, ZERO


def _sum_dx(p, x, s):
    return PhaseCost((p - 1) * x, ((p - 1) * 3 if p > 1 else 2) * x * s)


_FORMULAS = (  # (layer class, formula(layer, n, need_dx) -> (algorithm, kernel_class, fwd, bwd_data, bwd_weights))
    (Conv2D, conv2d),  # conv_costs.py: the cost of the layer's algorithm (conv_algorithms.py)
    (Dense, _dense),
    (MaxPool2D, _maxpool),
    (AvgPool2D, _avgpool),
    (GlobalAvgPool2D, _global_avgpool),
    (AdaptiveAvgPool2D, _adaptive_avgpool),
    (BatchNorm, _batchnorm),
    ((ReLU, ReLU6), _relu),
    (tuple(_ACTIVATIONS), _activation),
    (Dropout, _dropout),
    (Flatten, _flatten),
    (AdditionBlock, _addition),
    (ConcatenationBlock, _concatenation),
    (Gather, _gather),
    ((SumGrad, SumOutput), _sum_grad),
    *TRANSFORMER_FORMULAS,  # transformer_costs.py
)
