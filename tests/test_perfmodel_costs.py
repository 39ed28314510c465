"""Per-layer costs of a training step: hand-computed FLOPs and bytes for each kind of layer, the backend's
own algorithm choice, every zoo model's forward FLOPs against Layer.flops(), blocks present, the first
layer's backward, and the order gradients become ready."""

import numpy as np
import pytest

from pydtnn import models
from pydtnn.backends import CPUBackend
from pydtnn.layers import (
    AdditionBlock,
    BatchNorm,
    ConcatenationBlock,
    Container,
    Conv2D,
    Dense,
    Flatten,
    Layer,
    MaxPool2D,
    ReLU,
    ReLU6,
)
from pydtnn.model import Model
from pydtnn.perfmodel.costs import LayerCost, PhaseCost, gradient_ready_order, layer_costs, parameter_bytes, totals

F32 = 4  # bytes per float32


def only(layers, input_shape, kernels="numba", need_dx_first=False, batch=2):
    """The LayerCost of the first layer of a model built from `layers`, and the layer."""
    model = Model(layers, input_shape, backend=CPUBackend(kernels=kernels))
    _, layer = model.layers()[0]
    return layer_costs(model, batch, need_dx_first)[0], layer


# -- hand-computed layers -------------------------------------------------------------------------


def test_dense():
    # batch 2, 5 -> 3, bias: x 10, y 6 elements, W 15
    c, _ = only([Dense(3)], (5,))
    assert (c.kind, c.algorithm, c.kernel_class) == ("Dense", None, "gemm")
    assert c.forward == PhaseCost(2 * 2 * 5 * 3 + 6, (10 + 15 + 6) * F32 + 2 * 6 * F32)
    assert c.backward_weights == PhaseCost(2 * 2 * 5 * 3 + 6, (6 + 10 + 15) * F32 + 6 * F32)
    assert c.backward_data == PhaseCost(0, 0) and not c.need_dx  # the model's input wants no gradient
    assert (c.params, c.param_bytes, c.activation_bytes) == (18, 18 * F32, 6 * F32)
    c, _ = only([Dense(3)], (5,), need_dx_first=True)
    assert c.need_dx and c.backward_data == PhaseCost(2 * 2 * 5 * 3, (6 + 15 + 10) * F32)


def test_second_dense_computes_dx():
    model = Model([Dense(4), Dense(3)], (5,))
    first, second = layer_costs(model, 2)
    assert (first.need_dx, second.need_dx) == (False, True)
    assert second.backward_data == PhaseCost(2 * 2 * 4 * 3, (6 + 12 + 8) * F32)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_gemm_conv_3x3_stride2_padding1(kernels):
    # (3, 8, 8) -> 4 x (4, 4), batch 2: K = 27, P = 16; x 384, y 128, cols 3*9*2*16 = 864 elements.
    # Rows (and columns) each kernel offset covers: 3, 4, 4 (offset 0 reads the top padding at row 0),
    # so fill_cols writes 3 * 2 * 11 * 11 entries. P < 128: each block of samples is reordered (2 * y).
    c, layer = only([Conv2D(4, 3, stride=2, padding=1)], (3, 8, 8), kernels, need_dx_first=True)
    assert c.algorithm == layer.plan.algorithm == "gemm" and c.kernel_class == "gemm"
    x, y, cols, cols_w, w = 384, 128, 864, 3 * 2 * 11 * 11, 4 * 27 * F32
    macs = 2 * 4 * 16 * 27
    assert c.forward == PhaseCost(2 * macs + y, (x + cols_w + cols + y + 2 * y) * F32 + w + 2 * y * F32)
    assert c.forward.flops == 2 * layer.flops()
    # dy regrouped (read, written), dyk and cols read by the dW GEMM, dW written, copied to grads, db
    assert c.backward_weights == PhaseCost(2 * macs + y, (3 * y + cols) * F32 + w + 2 * w + y * F32)
    # dcols = W^T dy (written whole; 2 P < 128: per block of samples, so written and read once more in
    # the reorder), then col2im into dx: compiled reads dcols and writes dx; NumPy zeroes dx, then per
    # kernel offset reads and writes dx's view and reads dcols'
    dcols = 2 * 3 * 9 * 16
    scatter = dcols + x if kernels == "numba" else x + 3 * cols_w
    assert c.backward_data == PhaseCost(2 * macs + cols_w, (y + 3 * dcols + scatter) * F32 + w)


def test_gemm_conv_output_much_smaller_than_input_takes_dx_by_col2im(kernels):
    """A 4x4 kernel on a 4x4 input (1x1 output, as LeNet-5's C5 with its 5x5): dx is W^T dy and col2im,
    not a convolution of dy padded by 3, which would cost 16x the forward's multiplications."""
    c, layer = only([Conv2D(12, 4, use_bias=False)], (4, 4, 4), kernels, need_dx_first=True)
    assert c.algorithm == layer.plan.algorithm == "gemm"
    x, y, w, macs = 2 * 64, 2 * 12, 12 * 64 * F32, 2 * 12 * 64
    cols_w = dcols = 2 * 64  # C*kh*kw*N*P, no padding
    scatter = dcols + x if kernels == "numba" else x + 3 * cols_w
    assert c.backward_data == PhaseCost(2 * macs + cols_w, (y + 3 * dcols + scatter) * F32 + w)


def test_pointwise_conv():
    # 4 -> 8 channels 1x1 on 16x16, batch 2, no bias: P = 256, x 2048, y 4096 elements, W 32 (128 bytes)
    c, layer = only([Conv2D(8, 1, use_bias=False)], (4, 16, 16), need_dx_first=True)
    assert c.algorithm == layer.plan.algorithm == "pointwise" and c.kernel_class == "gemm"
    gemm, w = 2 * 2 * 8 * 4 * 256, 32 * F32
    assert c.forward == PhaseCost(gemm, (2048 + 4096) * F32 + w)
    # per-sample products written and added into one partial sum (one block of 8 samples)
    assert c.backward_weights == PhaseCost(gemm + 2 * 32, (2048 + 4096) * F32 + (4 * 2 + 2 * 1 + 1) * w + 2 * w)
    assert c.backward_data == PhaseCost(gemm, (4096 + 2048) * F32 + w)


def test_depthwise_3x3_direct():
    # 4 channels, groups 4, 8x8, padding 1, batch 2, no bias: x = y = 512 elements, W 36 (144 bytes)
    c, layer = only([Conv2D(4, 3, padding=1, groups=4, use_bias=False)], (4, 8, 8), need_dx_first=True)
    assert c.algorithm == layer.plan.algorithm == "direct" and c.kernel_class == "depthwise"
    flops, w = 2 * 2 * 4 * 64 * 9, 36 * F32
    assert c.forward == PhaseCost(flops, (512 + 512) * F32 + w)
    assert c.backward_weights == PhaseCost(flops, (512 + 512) * F32 + w + 2 * w)
    assert c.backward_data == PhaseCost(flops, (512 + 512) * F32 + 3 * w)  # W flipped: read, written, read


def test_depthwise_3x3_numpy():
    # The wide grid: padded 10 x 10, L = Ho * Wp = 80 columns per channel, the flat padded input 102
    # per channel (the last offset 22 plus 80); xf 2*4*102, yw 2*4*80, wk 9*4*80 elements
    c, layer = only([Conv2D(4, 3, padding=1, groups=4, use_bias=False)], (4, 8, 8), "numpy", need_dx_first=True)
    assert c.algorithm == layer.plan.algorithm == "depthwise" and c.kernel_class == "depthwise"
    flops, w, x = 2 * 2 * 4 * 64 * 9, 36 * F32, 512
    xf, yw, wk = 816, 640, 2880
    assert c.forward == PhaseCost(flops, (2 * x + 2 * wk + xf + yw + 2 * x) * F32 + w)
    assert c.backward_weights == PhaseCost(flops, (2 * x + 9 * (yw + 640)) * F32 + 2 * w)
    assert c.backward_data == PhaseCost(flops, (xf + 2 * wk + yw + 2 * xf + 2 * x) * F32 + w)


def test_maxpool_other_windows_compiled():
    # 3x3 at stride 1, padded (Inception's): (3, 8, 8) -> (3, 8, 8), batch 2: x and y 384 elements each
    c, _ = only([MaxPool2D(3, stride=1, padding=1)], (3, 8, 8), "numba")
    assert c.algorithm == "compiled" and c.kernel_class == "elementwise" and c.forward.flops == 384 * 9
    assert c.forward.bytes == 384 * F32 + 384 * (F32 + 1)
    assert c.backward_data == PhaseCost(384, 384 * F32 + 384 * (F32 + 1))  # overlapping: one add per output
    c, _ = only([MaxPool2D(3, stride=3)], (3, 9, 9), "numba")  # disjoint windows: dy copied, no add
    assert c.algorithm == "compiled" and c.backward_data == PhaseCost(0, 486 * F32 + 54 * (F32 + 1))


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_maxpool_2x2(kernels):
    # (3, 8, 8) -> (3, 4, 4), batch 2: x 384, y 96 elements, uint8 indices
    c, _ = only([MaxPool2D(2)], (3, 8, 8), kernels)
    assert c.kernel_class == "elementwise" and c.forward.flops == 96 * 4
    if kernels == "numba":
        assert c.algorithm == "compiled_2x2"
        assert c.forward.bytes == 384 * F32 + 96 * F32 + 96
        assert c.backward_data == PhaseCost(0, 96 * F32 + 96 + 384 * F32)
    else:
        # y from the first window offset (read, written), the index zeroed, then per other offset
        # x's view read twice, y's read twice and written, a bool mask, the index updated: 96*(5*4 + 2 + 4)
        assert c.algorithm == "numpy"
        assert c.forward.bytes == 96 + 2 * 96 * F32 + 3 * 96 * (5 * F32 + 2 + 4)
        # dx zeroed, then per offset the index compared and dy copied where it won
        assert c.backward_data == PhaseCost(0, 384 * F32 + 4 * 96 * (1 + 1 + 2 * F32 + 1))
    assert c.backward_weights == PhaseCost(0, 0)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_batchnorm(kernels):
    # (4, 8, 8), batch 2: E = 512 elements
    c, _ = only([BatchNorm()], (4, 8, 8), kernels)
    passes = (4, 2) if kernels == "numba" else (6, 3)  # compiled: every pass per channel in one kernel
    assert c.forward == PhaseCost(4 * 512, passes[0] * 512 * F32)
    assert c.backward_weights == PhaseCost(4 * 512, passes[1] * 512 * F32)
    assert c.backward_data == PhaseCost(4 * 512, 3 * 512 * F32)  # computed even for the model's input
    assert (c.params, c.param_bytes) == (8, 8 * F32)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_relu(kernels):
    c, _ = only([ReLU()], (4, 8, 8), kernels)
    assert c.forward == PhaseCost(512, 2 * 512 * F32)
    assert c.backward_data == PhaseCost(512, 3 * 512 * F32 + (0 if kernels == "numba" else 2 * 512))
    assert c.backward_weights == PhaseCost(0, 0) and c.params == 0


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_relu6_is_a_capped_relu(kernels):
    """Compiled: one pass each way, as ReLU; NumPy: the cap's pass over y, and y < 6's mask and the &."""
    c, _ = only([ReLU6()], (4, 8, 8), kernels)
    e = 512
    numpy = kernels == "numpy"
    assert c.forward == PhaseCost(e, (4 if numpy else 2) * e * F32)
    assert c.backward_data == PhaseCost(e, (4 if numpy else 3) * e * F32 + (6 * e if numpy else 0))


def test_blocks_cost_their_additions_and_copies():
    model = Model(
        [
            Conv2D(4, 3, padding=1),
            AdditionBlock([Conv2D(4, 3, padding=1), ReLU()], []),
            ConcatenationBlock([Conv2D(2, 1)], [Conv2D(3, 1)]),
        ],
        (3, 8, 8),
    )
    costs = layer_costs(model, 2)
    assert [c.name for c in costs] == ["0", "1.0.0", "1.0.1", "1", "2.0.0", "2.1.0", "2"]
    add, cat = costs[3], costs[6]
    y = 2 * 4 * 64
    assert add.kind == "AdditionBlock" and add.forward == PhaseCost(y, 3 * y * F32)  # path + identity
    assert add.backward_data == PhaseCost(y, 3 * y * F32)  # the two paths' dx summed
    assert cat.kind == "ConcatenationBlock" and cat.forward == PhaseCost(0, 2 * 2 * 5 * 64 * F32)
    assert cat.backward_data == PhaseCost(2 * 4 * 64, 2 * 2 * 5 * 64 * F32 + 3 * 2 * 4 * 64 * F32)


# -- the backend's choices, blocks, the first layer -----------------------------------------------


def test_algorithm_is_the_backends_own_choice():
    model = models.create("mobilenetv1_cifar10")
    costs = {c.name: c for c in layer_costs(model, 1)}
    convs = [(p, l) for p, l in model.layers() if isinstance(l, Conv2D)]
    assert convs and all(costs[p].algorithm == l.plan.algorithm for p, l in convs)
    assert {costs[p].algorithm for p, _ in convs} >= {"direct", "direct_stride2", "pointwise"}


def test_resnet20_counts_every_layer_inside_its_blocks():
    model = models.create("resnet20_cifar10")
    costs = layer_costs(model, 8)
    leaves = [p for p, l in model.layers() if not isinstance(l, Container)]
    assert [c.name for c in costs if c.kind != "AdditionBlock"] == leaves
    n_conv = sum(isinstance(l, Conv2D) for _, l in model.layers())
    assert sum(c.kind == "Conv2D" for c in costs) == n_conv > 19
    n_add = sum(isinstance(l, AdditionBlock) for _, l in model.layers())
    assert sum(c.kind == "AdditionBlock" for c in costs) == n_add == 9
    t = totals(costs)
    assert t.forward.flops == 8 * model.flops() + sum(c.forward.flops for c in costs if c.kind == "AdditionBlock")
    assert t.params == model.count_params()
    assert sum(parameter_bytes(model).values()) == t.param_bytes == 4 * model.count_params()
    layers = dict(model.layers())
    for c in costs:
        x, y = (8 * int(np.prod(shape)) for shape in (layers[c.name].input_shape, layers[c.name].output_shape))
        if c.kind == "AdditionBlock":  # one add per output element: reads the two paths' outputs, writes the sum
            assert c.forward == PhaseCost(y, 3 * y * F32), c
        elif c.kind in ("MaxPool2D", "AvgPool2D", "BatchNorm", "ReLU", "GlobalAvgPool2D"):
            # a pass reads at least its whole input (dy) and writes its whole output (dx)
            assert c.forward.bytes >= (x + y) * F32 and c.backward_data.bytes >= (x + y) * F32, c


def test_first_layer_backward():
    model = models.create("simplecnn")
    """simplecnn's first layer, Conv2D(16, 3, padding=1) on 1x28x28 at batch 4: 4 * 16 * 28 * 28 outputs of 9
    multiply-adds each. dW repeats the forward's multiply-adds and db sums dy (one add per output, as the bias
    add); dx, skipped for the first layer, is dy convolved with the flipped kernel over the 28x28 input."""
    first = layer_costs(model, 4)[0]
    y = 4 * 16 * 28 * 28
    assert first.kind == "Conv2D" and not first.need_dx
    assert first.forward.flops == first.backward_weights.flops == 2 * 9 * y + y
    assert first.backward_weights.bytes >= (4 * 28 * 28 + y) * F32  # reads x and dy at least once
    assert first.backward_data == PhaseCost(0, 0)
    first = layer_costs(model, 4, need_dx_first=True)[0]
    assert first.need_dx and first.backward_data.flops == 2 * 9 * y


def test_layercost_is_frozen():
    c, _ = only([ReLU()], (4,))
    assert isinstance(c, LayerCost)
    with pytest.raises(AttributeError):
        c.name = "other"


def test_a_layer_without_a_formula_is_named():
    """A user's own layer (--model_file, a changed zoo model) is a user error naming it, not a traceback."""
    from pydtnn.errors import ConfigError

    class Mystery(Layer):
        def forward(self, x, training=True):
            return x

    with pytest.raises(ConfigError, match="no cost formula for Mystery '0', a Mystery; it costs .*Conv2D"):
        layer_costs(Model([Mystery()], (3,)), 1)


# -- forward FLOPs of the zoo against Layer.flops() -----------------------------------------------


def check_forward_flops(name):
    model = models.create(name)
    costs = {c.name: c for c in layer_costs(model, 1)}
    checked = 0
    for path, layer in model.layers():
        if isinstance(layer, Container) or type(layer).flops is Layer.flops:
            continue
        expected = layer.flops()
        if isinstance(layer, Conv2D) and layer.plan.algorithm == "direct_stride2":
            g1 = layer.plan.run  # computed at stride 1, then every other row and column kept
            c_out, ho, wo = layer.output_shape
            expected = 2 * c_out * g1.ho * g1.wo * 9 + (c_out * ho * wo if layer.use_bias else 0)
        assert costs[path].forward.flops == expected, (name, path, layer)
        checked += 1
    assert checked > 0


SMALL = ["simplecnn", "simplemlp", "lenet5", "resnet20_cifar10", "mobilenetv1_cifar10", "vgg11bn_cifar10"]


@pytest.mark.parametrize("name", SMALL)
def test_forward_flops_match_layer_flops(name):
    check_forward_flops(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in models.names() if n not in SMALL])
def test_forward_flops_match_layer_flops_whole_zoo(name):
    check_forward_flops(name)


# -- gradient-ready order -------------------------------------------------------------------------


def test_gradient_ready_order_of_a_chain_is_reverse_layer_order():
    model = Model([Conv2D(4, 3, padding=1), ReLU(), Flatten(), Dense(10)], (1, 8, 8))
    before = model.params_sha256()
    assert gradient_ready_order(model) == ["3.weight", "3.bias", "0.weight", "0.bias"]
    assert model.params_sha256() == before


def test_gradient_ready_order_of_resnet20_leaves_the_model_as_it_was():
    model = models.create("resnet20_cifar10")
    state = {k: v.copy() for k, v in model.state_dict().items()}
    rng = model.backend.rng.bit_generator.state
    order = gradient_ready_order(model)
    names = [n for n, _, _ in model.parameters()]
    assert sorted(order) == sorted(names)
    first = next(layer for _, layer in model.layers() if layer.params)
    assert order[-len(first.params):] == names[: len(first.params)]  # the first layer's gradients come last
    assert all(np.array_equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.backend.rng.bit_generator.state == rng


def test_a_measured_convolution_plan_is_the_one_costed(tmp_path):
    """With the backend's algorithm measured (CPUBackend(autotune=...)), costs follow the plan it runs."""
    from pydtnn.backends.cpu import autotune

    class AllGemm:
        def __call__(self, g, co, algorithms, dtype, kernels, tuning, batch):
            return {a: 1.0 if a == "gemm" else 2.0 for a in algorithms}

    tuner = autotune.Tuner(path=str(tmp_path / "tune.json"), measure=AllGemm())
    plain = models.create("resnet20_cifar10", backend=CPUBackend(kernels="numba"))
    tuned_backend = CPUBackend(kernels="numba", autotune=tuner)
    tuned = models.create("resnet20_cifar10", backend=tuned_backend)
    tuned_backend.tune_convolutions()
    before = {c.name: c.algorithm for c in layer_costs(plain, 8) if c.kind == "Conv2D"}
    after = {c.name: c.algorithm for c in layer_costs(tuned, 8) if c.kind == "Conv2D"}
    assert "direct" in before.values() and set(after.values()) == {"gemm"}


def test_every_convolution_algorithm_has_a_cost_and_winograd_counts_its_products(tmp_path):
    """Each algorithm the CPU backend may run is costed; a layer the autotuner gave to Winograd costs
    2 macs / 2.25 FLOPs in each of forward, backward_data and backward_weights (F(3x3, 2x2))."""
    from pydtnn.backends.cpu import autotune, conv_plan
    from pydtnn.backends.cpu.conv_algorithms import REGISTRY

    assert [a.name for a in REGISTRY if callable(a.cost)] == list(conv_plan.ALGORITHMS)

    class AllWinograd:
        def __call__(self, g, co, algorithms, dtype, kernels, tuning, batch):
            return {a: 1.0 if a == "winograd" else 2.0 for a in algorithms}

    layers = [Conv2D(16, 3, padding=1), Conv2D(16, 3, padding=1)]
    direct = Model(layers, (8, 16, 16), CPUBackend(kernels="numba"))
    backend = CPUBackend(kernels="numba", autotune=autotune.Tuner(path=str(tmp_path / "t.json"), measure=AllWinograd()))
    tuned = Model([Conv2D(16, 3, padding=1), Conv2D(16, 3, padding=1)], (8, 16, 16), backend)
    backend.tune_convolutions()
    plain, wino = (next(c for c in layer_costs(m, 4) if c.name == "1") for m in (direct, tuned))
    assert wino.algorithm == "winograd" and wino.kernel_class == "gemm"
    macs = 4 * 16 * 16 * 16 * 16 * 9
    assert wino.forward.flops == int(2 * macs / 2.25) + 4 * 16 * 16 * 16  # the products, and the bias
    assert wino.backward_data.flops == int(2 * macs / 2.25)
    assert wino.backward_weights.flops == int(2 * macs / 2.25) + 4 * 16 * 16 * 16  # the products, and db
    assert plain.backward_weights.flops == 2 * macs + 4 * 16 * 16 * 16


def test_a_5x5_direct_convolution_counts_its_25_taps():
    """The compiled direct path takes one-group 5x5 layers too: dx's FLOPs are 2 N H W C Co x 25."""
    model = Model([Conv2D(8, 3, padding=1), Conv2D(16, 5, padding=2)], (4, 16, 16), CPUBackend(kernels="numba"))
    five = next(c for c in layer_costs(model, 2) if c.name == "1")
    assert five.algorithm == "direct"
    assert five.backward_data.flops == 2 * 2 * 16 * 16 * 8 * 16 * 25
    assert five.forward.flops == 2 * 2 * 16 * 16 * 16 * 8 * 25 + 2 * 16 * 16 * 16  # macs and the bias


# -- transformer layers (perfmodel/transformer_costs.py) ------------------------------------------------------
def transformer_models():
    from pydtnn.layers import (
        Embedding,
        LayerNorm,
        PatchEmbedding,
        PositionalEmbedding,
        SequencePool,
        TransformerBlock,
    )
    from pydtnn.layers.transformer import ClassToken

    gpt = Model([Embedding(17, 8), PositionalEmbedding(), TransformerBlock(8, 2, causal=True, dropout=0.1,
                                                                            attention_dropout=0.1),
                 LayerNorm(), Dense(17)], (6,))
    vit = Model([PatchEmbedding(8, 2), ClassToken(), PositionalEmbedding(), TransformerBlock(8, 4, approximate="tanh"),
                 LayerNorm(), SequencePool("mean"), Dense(3)], (1, 4, 4))
    return gpt, vit


def test_transformer_layers_have_costs_and_their_forward_flops_are_layer_flops():
    for model in transformer_models():
        costs = {c.name: c for c in layer_costs(model, 3)}
        checked = 0
        for path, layer in model.layers():
            if not isinstance(layer, Container) and type(layer).flops is not Layer.flops:
                assert costs[path].forward.flops == 3 * layer.flops(), (path, layer)
                checked += 1
        assert checked >= 6


def test_attention_by_hand():
    """N 2, T 3, D 4, 2 heads, not causal, no dropout: A = 2*2*3*3 = 36 scores, E = 24 elements."""
    from pydtnn.layers import MultiHeadAttention

    c, layer = only([MultiHeadAttention(2)], (3, 4), need_dx_first=True)
    n, t, d, a, e = 2, 3, 4, 36, 24
    gemm = 2 * n * t * d * 3 * d + 2 * 2 * n * t * t * d + 2 * n * t * d * d
    assert (c.kind, c.kernel_class) == ("MultiHeadAttention", "gemm")
    assert c.forward == PhaseCost(gemm + 5 * a + 4 * e, 2 * a * F32 + 12 * e * F32)  # compiled softmax, scaled inside
    assert c.forward.flops == n * layer.flops()
    assert c.backward_data == PhaseCost(2 * (2 * 2 * n * t * t * d) + 2 * n * t * d * d + 2 * n * t * 3 * d * d + 6 * a,
                                        3 * a * F32 + 12 * e * F32)
    c, _ = only([MultiHeadAttention(2, causal=True)], (3, 4), kernels="numpy")  # NumPy's softmax passes; the mask
    assert c.forward.bytes == (2 + 2 + 8) * a * F32 + 12 * e * F32 and c.backward_data.bytes == 11 * a * F32 + 12 * e * F32
    assert c.backward_weights == PhaseCost(2 * n * t * d * 3 * d + 2 * n * t * d * d + 4 * e, 4 * e * F32 + 4 * d * d * F32)


def test_layernorm_by_hand():
    """N 2, T 3, D 4: E = 24; the compiled kernels' passes (3*E*s and 8*E*s) or NumPy's (13 and 23)."""
    from pydtnn.layers import LayerNorm

    e = 24
    for kernels, f_bytes, b_bytes in (("numba", 3, 8), ("numpy", 13, 23)):
        c, _ = only([LayerNorm()], (3, 4), kernels=kernels)
        assert c.forward == PhaseCost(8 * e, f_bytes * e * F32) and c.backward_data == PhaseCost(10 * e, b_bytes * e * F32)


def test_measurements_feed_a_token_model_ids_it_takes():
    """Model.random_input: ids inside the vocabulary for an Embedding first (random normal values would be
    refused), so the memory model and the gradient order run on token models too."""
    from pydtnn.perfmodel.memory import predict_memory

    gpt, vit = transformer_models()
    ids = gpt.random_input(5, np.random.default_rng(0))
    assert ids.shape == (5, 6) and ids.min() >= 0 and ids.max() <= 16 and (ids == np.round(ids)).all()
    assert len(np.unique(ids)) > 5 and vit.random_input(2, np.random.default_rng(0)).shape == (2, 1, 4, 4)
    assert predict_memory(gpt, 4).parts["activations"] > 0
    assert gradient_ready_order(gpt)[:2] == ["4.weight", "4.bias"]
