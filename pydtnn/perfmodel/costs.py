"""What one training step of every layer costs on the CPU backend: FLOPs and bytes moved, per phase.

    costs = layer_costs(model, batch_size=64)      # one LayerCost per leaf layer and per block, forward order
    totals(costs).forward.flops                    # == 64 * model.flops() where no layer runs a stride-2 twin
    gradient_ready_order(model)                    # ['3.weight', '3.bias', '0.weight', '0.bias']

Each cost is read from the built layer and from what the backend chose for it when it was built
(a convolution's plan in use, `backend.plan_in_use(layer.plan)`: the one built with the layer, or the
one measured when the backend autotunes; the compiled 2x2 path for pooling, compiled or NumPy
BatchNorm and ReLU), and follows the code of that algorithm in `pydtnn/backends/cpu/`. A training step
has three phases per layer: forward, backward_data (dL/dx) and backward_weights (dL/dW and dL/db).

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

from dataclasses import dataclass

import numpy as np

from pydtnn.backends.cpu import CPUBackend
from pydtnn.backends.cpu import pooling as cpu_pooling
from pydtnn.backends.cpu.conv_depthwise import wide_layout
from pydtnn.backends.cpu.conv_direct import dense_layout
from pydtnn.backends.cpu.conv_gemm import SCATTER_AREA_RATIO
from pydtnn.backends.geometry import positions, transposed, window_layout
from pydtnn.distributed.model_parallel import Gather, SumGrad
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

KERNEL_CLASSES = ("gemm", "direct3x3", "depthwise", "elementwise")


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs (a multiply-add is 2) and bytes moved by one phase of one layer, for the whole batch."""

    flops: int = 0
    bytes: int = 0

    def __add__(self, other):
        return PhaseCost(self.flops + other.flops, self.bytes + other.bytes)


ZERO = PhaseCost()


@dataclass(frozen=True)
class LayerCost:
    """The cost of one layer (or one block's combining step) in a training step of batch_size samples.

    name: dotted path as in Model.layers(); kind: class name; algorithm: the backend's choice
    (Conv2D: plan.algorithm; pooling: "compiled_2x2", "compiled" (max pooling's other windows) or "numpy";
    else None); kernel_class: whose FLOP rate applies, one of KERNEL_CLASSES; params, param_bytes: trainable
    parameters; activation_bytes: the output for the whole batch; need_dx: whether dL/dinput is wanted.
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
        x = np.random.default_rng(0).standard_normal((1,) + model.input_shape).astype(backend.dtype)
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
    )


def _size(shape):
    return int(np.prod(shape, dtype=np.int64))


def _len(sl):
    return len(range(sl.start, sl.stop, sl.step or 1))


def _touched(g):
    """Outputs each kernel position of g covers, per sample and channel (its output view and its strided
    input view have that many elements each; positions that read only padding are left out)."""
    return [_len(orows) * _len(ocols) for _, _, _, orows, ocols, _, _ in positions(g)]


# -- dense -------------------------------------------------------------------------------------------


def _dense(layer, n, need_dx):
    """Dense, GEMMs through backend.matmul; I = in_features, O = units:
    forward         2*N*I*O (+ N*O bias) flops; reads x and W, writes y (+ y read and written for bias)
    backward_data   2*N*I*O flops; reads dy and W, writes dx
    backward_weights 2*N*I*O (+ N*O) flops; reads dy and x, writes dW (+ reads dy for db)
    """
    s = layer.dtype.itemsize
    i, o = layer.input_shape[0], layer.units
    x, y, w = n * i * s, n * o * s, i * o * s
    gemm = 2 * n * i * o
    bias_f = PhaseCost(n * o, 2 * y) if layer.use_bias else ZERO
    bias_b = PhaseCost(n * o, y) if layer.use_bias else ZERO
    fwd = PhaseCost(gemm, x + w + y) + bias_f
    bwd_w = PhaseCost(gemm, y + x + w) + bias_b
    bwd_d = PhaseCost(gemm, y + w + x) if need_dx else ZERO
    return None, "gemm", fwd, bwd_d, bwd_w


# -- convolution -------------------------------------------------------------------------------------


def _conv(layer, n, need_dx):
    """Conv2D: the backend's algorithm (below), plus what every algorithm shares:
    bias    forward Y flops, 2*Y*s bytes (y += b in place); backward_weights Y flops, Y*s bytes (db = sum dy)
    dW      backward_weights 2*|W|*s bytes: the algorithm's dw copied into the layer's gradient buffer
    """
    plan, g, co = layer.backend.plan_in_use(layer.plan), layer.geometry, layer.filters  # a measured plan wins
    s = layer.dtype.itemsize
    y = n * co * g.ho * g.wo
    fwd, bwd_d, bwd_w = _CONV_ALGORITHMS[plan.algorithm](layer, n, need_dx)
    w_bytes = int(layer.params["weight"].nbytes)
    bwd_w = bwd_w + PhaseCost(0, 2 * w_bytes)
    if layer.use_bias:
        fwd = fwd + PhaseCost(y, 2 * y * s)
        bwd_w = bwd_w + PhaseCost(y, y * s)
    if plan.algorithm in ("gemm", "pointwise", "winograd"):  # Winograd's time is mostly its 16 GEMMs
        kernel_class = "gemm"
    elif plan.algorithm == "direct" and g.groups == 1:
        kernel_class = "direct3x3"
    else:
        kernel_class = "depthwise"
    return plan.algorithm, kernel_class, fwd, bwd_d if need_dx else ZERO, bwd_w


def _macs(g, n, co):
    """Multiply-adds of convolution geometry g with co output channels over n samples."""
    return n * co * g.ho * g.wo * (g.c // g.groups) * g.kh * g.kw


def _conv_gemm(layer, n, need_dx):
    """im2col + GEMM (conv_gemm.py). K = C/G*kk, P = Ho*Wo, cols = C*kk*N*P elements (the column
    matrix), cols_w = the entries fill_cols writes (cols less those that read padding):
    forward         2*macs flops; bytes: x read, cols_w written, cols read by the GEMM, W read, y written,
                    and y written and read once more where P < gemm_min_columns (a block of samples
                    per GEMM, reordered into NCHW)
    backward_weights 2*macs flops; bytes: dy read and written regrouped (dyk), dyk and cols read, dW written
    backward_data   stride 1: the convolution of dy with the flipped, transposed W over x's H x W
                    (transposed geometry gt): 2*N*H*W*C*(Co/G)*kk flops; bytes: the flipped copy of W
                    (2*|W|*s, none for 1x1), dy's column matrix written and read like forward's (none
                    for an unpadded 1x1: dyk is its columns), W read, dx written (and reordered where
                    H*W < gemm_min_columns);
                    larger strides, and stride-1 layers whose input has SCATTER_AREA_RATIO times their
                    output's pixels: dcols = W^T dy (2*macs flops; dyk and W read, dcols written, and
                    written and read once more where 2*P < gemm_min_columns: blocks of samples), then
                    col2im adds each kernel position's share into dx (cols_w flops); compiled: dcols
                    read, dx written; NumPy: dx zeroed, then per position dx read and written, dcols read
    """
    g, co, s, tuning = layer.geometry, layer.filters, layer.dtype.itemsize, layer.backend.tuning
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = int(layer.params["weight"].nbytes)
    macs = _macs(g, n, co)
    p = g.ho * g.wo
    cols = g.c * g.kh * g.kw * n * p
    cols_w = g.c * n * sum(_touched(g))
    reorder = 2 * y if p < tuning.gemm_min_columns else 0
    fwd = PhaseCost(2 * macs, (x + cols_w + cols + y + reorder) * s + w)
    bwd_w = PhaseCost(2 * macs, (2 * y + y + cols) * s + w)
    if not need_dx:
        return fwd, ZERO, bwd_w
    if (g.sh, g.sw) == (1, 1) and g.h * g.w < SCATTER_AREA_RATIO * p:
        gt = transposed(g, co)
        pt = gt.ho * gt.wo
        flops = 2 * n * pt * g.c * (co // g.groups) * g.kh * g.kw
        reorder = 2 * x if pt < tuning.gemm_min_columns else 0
        if g.kh == g.kw == 1 and not gt.padded:
            if 2 * p >= tuning.gemm_min_columns:
                reorder = 0  # one GEMM per sample, straight into NCHW
            return fwd, PhaseCost(flops, (y + x + reorder) * s + w), bwd_w
        dcols = co * g.kh * g.kw * n * pt
        dcols_w = co * n * sum(_touched(gt))
        flip = 0 if g.kh * g.kw == 1 else 2 * w  # a 1x1 kernel's flipped weights are a view
        return fwd, PhaseCost(flops, (y + dcols_w + dcols + x + reorder) * s + w + flip), bwd_w
    dcols = n * g.c * g.kh * g.kw * p
    if layer.backend.kernels == "numba":
        scatter = dcols + x
    else:
        scatter = x + 3 * cols_w
    blocks = 2 * dcols if 2 * p < tuning.gemm_min_columns else 0
    return fwd, PhaseCost(2 * macs + cols_w, (y + dcols + blocks + scatter) * s + w), bwd_w


def _conv_pointwise(layer, n, need_dx):
    """One-group 1x1 stride 1 (conv_pointwise.py): GEMMs per sample on x and dy as they lie; P = H*W:
    forward         2*macs flops; x and W read, y written
    backward_weights 2*macs + N*|W| flops (the per-sample products added up); bytes: x and dy read,
                    each sample's product written (N*|W|*s), added into its block's partial sum
                    (3*N*|W|*s), the B = ceil(N / pointwise_block) partial sums zeroed and summed
                    ((2*B + 1)*|W|*s)
    backward_data   2*macs flops; dy and W read, dx written
    """
    g, co, s = layer.geometry, layer.filters, layer.dtype.itemsize
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = int(layer.params["weight"].nbytes)
    macs = _macs(g, n, co)
    blocks = -(-n // layer.backend.tuning.pointwise_block)
    fwd = PhaseCost(2 * macs, (x + y) * s + w)
    bwd_w = PhaseCost(2 * macs + n * co * g.c, (x + y) * s + (4 * n + 2 * blocks + 1) * w)
    bwd_d = PhaseCost(2 * macs, (y + x) * s + w)
    return fwd, bwd_d, bwd_w


def _conv_direct(layer, n, need_dx):
    """Compiled direct k x k stride 1 (conv_direct.py: 3x3, and 5x5 or 7x7 with one group; T = k*k taps,
    9 in the formulas below for 3x3). One group: lx = a sample's columns in the padded input xs
    (dense_layout), B = Co rounded up to blocks of BLOCK_CHANNELS, Bt = C rounded likewise:
    forward         2*macs flops; bytes: x read, xs written (x's elements) and read (C*N*lx), W blocked
                    (W read, 4*B*C*9*s: zeroed, filled, transposed), y written
    backward_weights 2*macs flops; bytes: dy read and laid on xs's grid (dyw: Y written, B*N*lx read),
                    xs read, dW written
    backward_data   2*N*H*W*C*Co*9 flops; bytes: W flipped and blocked (W read, 4*Bt*Co*9*s), dy read,
                    dx written (each sample padded into scratch that stays in cache)
    Depthwise: forward 2*macs, x and W read, y written; backward_weights 2*macs, x and dy read, dW
    written; backward_data 2*N*H*W*C*9 flops, W flipped (2*|W|*s), dy read, dx written.
    """
    return _direct(layer, layer.geometry, n, need_dx, n * layer.filters * layer.geometry.ho * layer.geometry.wo)


def _direct(layer, g, n, need_dx, y):
    co, s = layer.filters, layer.dtype.itemsize
    x = n * g.c * g.h * g.w
    w = int(layer.params["weight"].nbytes)
    macs = _macs(g, n, co)
    taps = g.kh * g.kw
    dx_flops = 2 * n * g.h * g.w * g.c * (co // g.groups) * taps
    if g.groups > 1:
        fwd = PhaseCost(2 * macs, (x + y) * s + w)
        bwd_w = PhaseCost(2 * macs, (x + y) * s + w)
        bwd_d = PhaseCost(dx_flops, (y + x) * s + 3 * w)
        return fwd, bwd_d, bwd_w
    from pydtnn.backends.cpu.kernels.conv3x3 import BLOCK_CHANNELS  # Numba: the direct plan needs it anyway

    _, _, lx, tail = dense_layout(g.ho, g.wo, g.dh, g.dw, s, g.kh)
    xs = g.c * (n * lx + tail)
    blocks = -(-co // BLOCK_CHANNELS) * BLOCK_CHANNELS
    blocks_t = -(-g.c // BLOCK_CHANNELS) * BLOCK_CHANNELS
    fwd = PhaseCost(2 * macs, (x + x + xs + y) * s + w + 4 * blocks * g.c * taps * s)
    bwd_w = PhaseCost(2 * macs, (y + y + blocks * n * lx + xs) * s + w)
    bwd_d = PhaseCost(dx_flops, (y + x) * s + w + 4 * blocks_t * co * taps * s)
    return fwd, bwd_d, bwd_w


def _conv_direct_stride2(layer, n, need_dx):
    """Stride-2 depthwise 3x3 through its stride-1 twin g1 (conv_direct.py forward_stride2), Y1 = g1's
    output: the depthwise direct costs of g1 (forward y1 written, backward reading Y1 elements of the
    spread dy), plus forward: y1's even rows and columns read and written into y (2*Y*s); backward_weights:
    dy read and spread onto the even rows and columns of a zeroed Y1 (2*Y*s)."""
    g, g1, s = layer.geometry, layer.backend.plan_in_use(layer.plan).run, layer.dtype.itemsize
    y = n * layer.filters * g.ho * g.wo
    y1 = n * layer.filters * g1.ho * g1.wo
    fwd, bwd_d, bwd_w = _direct(layer, g1, n, need_dx, y1)
    return fwd + PhaseCost(0, 2 * y * s), bwd_d, bwd_w + PhaseCost(0, 2 * y * s)


def _conv_depthwise(layer, n, need_dx):
    """NumPy depthwise (conv_depthwise.py) on the wide grid: L = Ho*Wp per channel, xf = N*C*flat (the
    padded input, flat per channel), yw = N*Co*L, wk = kk*Co*L (each kernel position's weights along the
    grid):
    forward         2*macs flops; bytes: x read and written into xf, wk written and read, xf read, yw
                    written, then cropped into y (Y read, Y written)
    backward_weights 2*macs flops; bytes: dy read and written onto the grid (dyw), then one whole-batch
                    pass per kernel position reading dyw and xf's strided run (kk*(yw + N*C*L)*s)
    backward_data   2*macs flops; bytes: dxf zeroed (xf), wk written and read, dyw read, dxf read and
                    written, cropped into dx (X read, X written)
    """
    g, co, s = layer.geometry, layer.filters, layer.dtype.itemsize
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    w = int(layer.params["weight"].nbytes)
    macs = _macs(g, n, co)
    _, _, length, _, offsets, flat = wide_layout(g)
    xf, yw, wk = n * g.c * flat, n * co * length, len(offsets) * co * length
    fwd = PhaseCost(2 * macs, (x + x + 2 * wk + xf + yw + 2 * y) * s + w)
    bwd_w = PhaseCost(2 * macs, (2 * y + len(offsets) * (yw + n * g.c * length)) * s)
    bwd_d = PhaseCost(2 * macs, (xf + 2 * wk + yw + 2 * xf + 2 * x) * s + w)
    return fwd, bwd_d, bwd_w


def _conv_winograd(layer, n, need_dx):
    """Winograd F(2x2, 3x3) (conv_winograd.py), T = N*ceil(Ho/2)*ceil(Wo/2) tiles, V = 16*C*T and
    M = 16*Co*T (the transformed input and products):
    forward         2*macs/2.25 flops (the 16 GEMMs); bytes: x read, V written and read, U (16*Co*C) read,
                    M written and read, y written
    backward_data   the same on dy and the flipped weights, over dx's tiles
    backward_weights F(3x3, 2x2): 2*macs/2.25 flops (the 16 GEMMs (Co x T) @ (T x C)); bytes: x read, V
                    written and read, dy read, Z = 16*Co*T written and read, P (16*Co*C) written and read
    """
    g, co, s = layer.geometry, layer.filters, layer.dtype.itemsize
    x, y = n * g.c * g.h * g.w, n * co * g.ho * g.wo
    macs = _macs(g, n, co)
    t_fwd = n * -(-g.ho // 2) * -(-g.wo // 2)
    t_bwd = n * -(-g.h // 2) * -(-g.w // 2)
    u = 16 * co * g.c
    fwd = PhaseCost(int(2 * macs / 2.25), (x + 2 * 16 * g.c * t_fwd + u + 2 * 16 * co * t_fwd + y) * s)
    bwd_d = PhaseCost(int(2 * macs / 2.25), (y + 2 * 16 * co * t_bwd + u + 2 * 16 * g.c * t_bwd + x) * s)
    bwd_w = PhaseCost(int(2 * macs / 2.25), (x + 2 * 16 * g.c * t_fwd + y + 2 * 16 * co * t_fwd + 2 * u) * s)
    return fwd, bwd_d, bwd_w


_CONV_ALGORITHMS = {
    "gemm": _conv_gemm,
    "pointwise": _conv_pointwise,
    "direct": _conv_direct,
    "direct_stride2": _conv_direct_stride2,
    "depthwise": _conv_depthwise,
    "winograd": _conv_winograd,
}


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
    yk = [n * g.c * t for t in _touched(g)]
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
    yk = [n * g.c * t for t in _touched(g)]
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
    """model_parallel.SumGrad: the identity forward; backward an allreduce of dy in place (communication)."""
    return None, "elementwise", ZERO, ZERO, ZERO


def _sum_dx(p, x, s):
    return PhaseCost((p - 1) * x, ((p - 1) * 3 if p > 1 else 2) * x * s)


_FORMULAS = (  # (layer class, formula(layer, n, need_dx) -> (algorithm, kernel_class, fwd, bwd_data, bwd_weights))
    (Conv2D, _conv),
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
    (SumGrad, _sum_grad),
)
