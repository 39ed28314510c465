"""What a Conv2D costs by the CPU backend's algorithm: FLOPs and bytes moved per phase, one formula for
each algorithm of conv_plan.py, following its code in `pydtnn/backends/cpu/conv_*.py`.

    algorithm, kernel_class, fwd, bwd_data, bwd_weights = conv2d(layer, n=64, need_dx=True)
    sorted(ALGORITHMS)                  # ['depthwise', 'direct', 'direct_stride2', 'gemm', 'pointwise', 'winograd']

Units, notation and the counting rules are costs.py's; costs.layer_costs calls conv2d for every Conv2D.
"""

from pydtnn.backends.cpu.conv_depthwise import wide_layout
from pydtnn.backends.cpu.conv_direct import dense_layout
from pydtnn.backends.cpu.conv_gemm import SCATTER_AREA_RATIO
from pydtnn.backends.geometry import transposed
from pydtnn.perfmodel.phase_cost import ZERO, PhaseCost, touched


def conv2d(layer, n, need_dx):
    """Conv2D: the backend's algorithm (below), plus what every algorithm shares:
    bias    forward Y flops, 2*Y*s bytes (y += b in place); backward_weights Y flops, Y*s bytes (db = sum dy)
    dW      backward_weights 2*|W|*s bytes: the algorithm's dw copied into the layer's gradient buffer
    """
    plan, g, co = layer.backend.plan_in_use(layer.plan), layer.geometry, layer.filters  # a measured plan wins
    s = layer.dtype.itemsize
    y = n * co * g.ho * g.wo
    fwd, bwd_d, bwd_w = ALGORITHMS[plan.algorithm](layer, n, need_dx)
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
    cols_w = g.c * n * sum(touched(g))
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
        dcols_w = co * n * sum(touched(gt))
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


ALGORITHMS = {
    "gemm": _conv_gemm,
    "pointwise": _conv_pointwise,
    "direct": _conv_direct,
    "direct_stride2": _conv_direct_stride2,
    "depthwise": _conv_depthwise,
    "winograd": _conv_winograd,
}
