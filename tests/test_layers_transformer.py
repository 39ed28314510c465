"""Transformer layers: float64 finite differences, and forward/backward against PyTorch in float64 and float32
(LayerNorm, GELU in both forms, Dense over tokens, Embedding, positions, the class token, sequence pooling,
patch embedding, multi-head self-attention with and without the causal mask, the pre-norm block)."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_layers import DTYPES, both_checks

from pydtnn.backends import CPUBackend
from pydtnn.backends.cpu import tuning
from pydtnn.layers import (
    GELU,
    ClassToken,
    Dense,
    Embedding,
    LayerNorm,
    MultiHeadAttention,
    PatchEmbedding,
    PositionalEmbedding,
    SequencePool,
    TransformerBlock,
)
from pydtnn.testing import check_against_torch, check_gradients


# -- LayerNorm, GELU, Dense over tokens --------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("x_shape", [(3, 5, 8), (4, 7), (2, 1, 6)])
def test_layernorm(x_shape, kernels):
    def make():
        layer = LayerNorm()
        layer.build(x_shape[1:], np.float64, CPUBackend(np.float64, kernels=kernels))
        rng = np.random.default_rng(1)  # weight and bias away from 1 and 0, so their gradients are checked
        layer.params["weight"][...] = rng.uniform(0.5, 1.5, x_shape[-1])
        layer.params["bias"][...] = rng.standard_normal(x_shape[-1])
        return layer

    check_gradients(make(), x_shape)
    for dtype in DTYPES:
        layer = make()
        if dtype == np.float32:
            w, bias = layer.params["weight"].copy(), layer.params["bias"].copy()
            layer.build(x_shape[1:], np.float32, CPUBackend(np.float32, kernels=kernels))
            layer.params["weight"][...], layer.params["bias"][...] = w, bias
        check_against_torch(layer, x_shape, lambda x, p: F.layer_norm(x, x.shape[-1:], p["weight"], p["bias"]),
                            dtype=dtype)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate, kernels):
    def make():
        layer = GELU(approximate)
        layer.build((5, 6), np.float64, CPUBackend(np.float64, kernels=kernels))
        return layer

    check_gradients(make(), (3, 5, 6))
    for dtype in DTYPES:
        layer = GELU(approximate)
        layer.build((5, 6), dtype, CPUBackend(dtype, kernels=kernels))
        check_against_torch(layer, (3, 5, 6), lambda x, _: F.gelu(x, approximate=approximate), dtype=dtype)


def test_gelu_refuses_an_unknown_form():
    with pytest.raises(ValueError, match="GELU approximate must be one of none, tanh, got 'erf'"):
        GELU("erf")


@pytest.mark.parametrize("bias", [True, False])
def test_dense_over_tokens_is_nn_linear(bias):
    both_checks(lambda: Dense(5, use_bias=bias), (3, 4, 7), lambda x, p: F.linear(x, p["weight"], p.get("bias")))
    layer = Dense(5)
    layer.build((4, 7))
    assert layer.output_shape == (4, 5) and layer.flops() == 4 * (2 * 7 * 5 + 5)


# -- embeddings, class token, pooling, patches ------------------------------------------------------------
def test_embedding_against_torch_and_its_gradient_sums_repeated_ids():
    layer = Embedding(11, 6)
    layer.build((5,), np.float64)
    ids = np.array([[0, 3, 3, 10, 2], [3, 1, 0, 0, 9]])
    y = layer.forward(ids.astype(np.float64))
    t_w = torch.tensor(layer.params["weight"], requires_grad=True)
    t_y = F.embedding(torch.tensor(ids), t_w)
    np.testing.assert_array_equal(y, t_y.detach().numpy())
    r = np.random.default_rng(0).standard_normal(y.shape)
    assert layer.backward(r) is None
    (t_y * torch.tensor(r)).sum().backward()
    np.testing.assert_allclose(layer.grads["weight"], t_w.grad.numpy(), rtol=1e-12, atol=1e-14)
    assert layer.grads["weight"][3].any() and not layer.grads["weight"][4].any()


def test_an_embedding_after_another_layer_is_refused():
    from pydtnn.errors import ShapeError
    from pydtnn.model import Model

    with pytest.raises(ShapeError, match="token ids have no gradient, so an Embedding must come first in its model"):
        Model([Dense(4), Embedding(11, 4)], (3,))
    assert Model([Embedding(11, 4), Dense(2)], (3,)).output_shape == (3, 2)


@pytest.mark.parametrize("bad,message", [
    (np.array([[0, 11]]), "token id 11 outside the vocabulary; expected 0 to 10"),
    (np.array([[-1, 2]]), "token id -1 outside the vocabulary; expected 0 to 10"),
    (np.array([[0.5, 2]]), "token ids must be whole numbers, got 0.5"),
])
def test_embedding_refuses_ids_it_cannot_look_up(bad, message):
    layer = Embedding(11, 4)
    layer.build((2,))
    with pytest.raises(ValueError, match=message):
        layer.forward(bad)


def test_positional_embedding_class_token_and_pooling():
    both_checks(PositionalEmbedding, (3, 4, 5), lambda x, p: x + p["weight"])
    both_checks(ClassToken, (3, 4, 5), lambda x, p: torch.cat([p["class_token"].expand(x.shape[0], 1, -1), x], 1))
    both_checks(lambda: SequencePool("cls"), (3, 4, 5), lambda x, _: x[:, 0])
    both_checks(lambda: SequencePool("mean"), (3, 4, 5), lambda x, _: x.mean(1))


def test_patch_embedding_is_a_strided_convolution_then_tokens():
    def torch_fn(x, p):
        y = F.conv2d(x, p["proj.weight"], p["proj.bias"], stride=2)
        return y.flatten(2).transpose(1, 2)

    both_checks(lambda: PatchEmbedding(6, 2), (2, 3, 4, 6), torch_fn)
    layer = PatchEmbedding(6, 4)
    with pytest.raises(Exception, match=r"H and W multiples of the patch 4, got \(3, 4, 6\)"):
        layer.build((3, 4, 6))


# -- attention -------------------------------------------------------------------------------------------
def torch_attention(heads, causal):
    def fn(x, p):
        d = x.shape[-1]
        return F.multi_head_attention_forward(
            x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), d, heads, p["in_proj_weight"],
            p["in_proj_bias"], None, None, False, 0.0, p["out_proj_weight"], p["out_proj_bias"], training=False,
            need_weights=False, attn_mask=torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            if causal else None)[0].transpose(0, 1)

    return fn


def random_biases(layer):
    rng = np.random.default_rng(3)
    for k in ("in_proj_bias", "out_proj_bias"):
        layer.params[k][...] = rng.standard_normal(layer.params[k].shape)
    return layer


@pytest.mark.parametrize("x_shape,heads,causal", [
    ((2, 5, 8), 2, False), ((2, 5, 8), 2, True), ((3, 4, 6), 3, True),  # an odd head count
    ((2, 1, 4), 1, True), ((1, 6, 12), 4, False),  # T = 1
])
def test_multi_head_attention(x_shape, heads, causal):
    def make(dtype):
        layer = MultiHeadAttention(heads, causal=causal)
        layer.build(x_shape[1:], dtype)
        return random_biases(layer)

    check_gradients(make(np.float64), x_shape)
    for dtype in DTYPES:
        check_against_torch(make(dtype), x_shape, torch_attention(heads, causal), dtype=dtype)


def test_attention_against_scaled_dot_product_attention_and_the_causal_mask_hides_the_future():
    layer = MultiHeadAttention(2, causal=True)
    layer.build((5, 8), np.float64)
    random_biases(layer)
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    w, b = torch.tensor(layer.params["in_proj_weight"]), torch.tensor(layer.params["in_proj_bias"])
    q, k, v = F.linear(torch.tensor(x), w, b).reshape(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 8)
    want = F.linear(o, torch.tensor(layer.params["out_proj_weight"]), torch.tensor(layer.params["out_proj_bias"]))
    y = layer.forward(x, training=False)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-12, atol=1e-12)
    x2 = x.copy()
    x2[:, 3:] += 1.0  # later tokens changed: the first three outputs stay
    np.testing.assert_array_equal(layer.forward(x2, training=False)[:, :3], y[:, :3])


def test_attention_dropout_has_exact_gradients_and_drops_attention_weights():
    def make():
        layer = MultiHeadAttention(2, causal=True, dropout=0.3)
        layer.build((5, 8), np.float64)
        return random_biases(layer)

    check_gradients(make(), (2, 5, 8))  # the backend's Generator rewound before every forward: one mask
    layer = make()
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    assert not np.allclose(layer.forward(x, training=True), layer.forward(x, training=False))
    np.testing.assert_array_equal(layer.forward(x, training=False), layer.forward(x, training=False))


def test_attention_refuses_features_that_do_not_split_into_heads():
    with pytest.raises(Exception, match="10 features do not split into 4 heads; expected a multiple of 4"):
        MultiHeadAttention(4).build((3, 10))


# -- the block ---------------------------------------------------------------------------------------------
def torch_block(heads, causal, approximate):
    attention = torch_attention(heads, causal)

    def fn(x, p):
        sub = lambda prefix: {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}  # noqa: E731
        d = x.shape[-1]
        h = x + attention(F.layer_norm(x, (d,), p["attention.ln_1.weight"], p["attention.ln_1.bias"]),
                          sub("attention.attn."))
        m = sub("mlp.")
        z = F.layer_norm(h, (d,), m["ln_2.weight"], m["ln_2.bias"])
        z = F.linear(F.gelu(F.linear(z, m["fc.weight"], m["fc.bias"]), approximate=approximate), m["proj.weight"],
                     m["proj.bias"])
        return h + z

    return fn


@pytest.mark.parametrize("causal,approximate", [(True, "tanh"), (False, "none")])
def test_transformer_block(causal, approximate):
    def make():
        block = TransformerBlock(8, 2, mlp_dim=12, causal=causal, approximate=approximate)
        block.build((4, 8), np.float64)
        rng = np.random.default_rng(2)  # every parameter away from its initial constant
        for _, layer in block.named_layers():
            for p in layer.params.values():
                p[...] = rng.standard_normal(p.shape) * 0.5
        return block

    check_gradients(make(), (2, 4, 8))
    names = sorted(k for p, layer in make().named_layers() for k in (f"{p}.{n}" for n in layer.params))
    assert names == sorted(["attention.ln_1.weight", "attention.ln_1.bias", "attention.attn.in_proj_weight",
                            "attention.attn.in_proj_bias", "attention.attn.out_proj_weight",
                            "attention.attn.out_proj_bias", "mlp.ln_2.weight", "mlp.ln_2.bias", "mlp.fc.weight",
                            "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"])
    check_against_torch(make(), (2, 4, 8), torch_block(2, causal, approximate))


def test_transformer_block_refuses_another_width():
    with pytest.raises(Exception, match=r"TransformerBlock\(8\): expects tokens \(T, 8\), got \(4, 6\)"):
        TransformerBlock(8, 2).build((4, 6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_softmax_equals_numpy_and_torch_with_masked_rows(dtype):
    """The CPU backend's compiled softmax over the last axis against its NumPy form and torch, rows of -inf
    (zeros out) and partly masked rows (a causal mask) included; and its backward."""
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((2, 3, 5, 5))).astype(dtype)
    x += np.triu(np.full((5, 5), -np.inf, dtype), 1)
    x[1, 2, 4] = -np.inf
    dy = rng.standard_normal(x.shape).astype(dtype)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    compiled, plain = CPUBackend(dtype, kernels="numba"), CPUBackend(dtype, kernels="numpy")
    y = compiled.softmax_forward(x)
    np.testing.assert_allclose(y, plain.softmax_forward(x), rtol=tol, atol=tol)
    want = torch.softmax(torch.tensor(x[:1]), -1).numpy()
    np.testing.assert_allclose(y[:1], want, rtol=tol, atol=tol)
    assert not y[1, 2, 4].any() and y.dtype == dtype
    np.testing.assert_allclose(compiled.softmax_backward(dy, y), plain.softmax_backward(dy, y), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_softmax_scaled_and_causal_equals_numpy_and_torch(dtype):
    """softmax(scale * x) with the causal mask applied inside the softmax (what attention calls): the compiled
    kernel against the NumPy form and torch's masked softmax, forward and backward (torch autograd); the entries
    above the diagonal are never read (NaN there changes nothing)."""
    rng = np.random.default_rng(3)
    t, scale = 7, 0.35
    x = (3 * rng.standard_normal((2, 3, t, t))).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    tx = torch.tensor(x, requires_grad=True)
    want = torch.softmax((scale * tx).masked_fill(mask, -torch.inf), -1)
    want.backward(torch.tensor(dy))
    compiled, plain = CPUBackend(dtype, kernels="numba"), CPUBackend(dtype, kernels="numpy")
    junk = x.copy()
    junk[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] = np.nan
    for b in (compiled, plain):
        y = b.softmax_forward(junk, scale, causal=True)
        np.testing.assert_allclose(y, want.detach().numpy(), rtol=tol, atol=tol)
        assert not y[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]].any() and y.dtype == dtype
        np.testing.assert_allclose(b.softmax_backward(dy, y, scale), tx.grad.numpy(), rtol=tol, atol=tol)
    full = torch.softmax(torch.tensor(scale * x.astype(np.float64)), -1).numpy()
    np.testing.assert_allclose(compiled.softmax_forward(x, scale), full, rtol=tol, atol=tol)


def test_compiled_float32_exp_is_within_1e7_of_exp_and_keeps_its_special_values():
    """kernels.elementwise.exp32 (the float32 softmax's and GELU's exp) against float64 exp over float32's
    range, 0 below its subnormals, NaN and infinities as exp gives them."""
    from pydtnn.backends.cpu.kernels.elementwise import exp32

    v = np.concatenate([np.linspace(-87.3, 88.3, 20001), -np.logspace(-8, 1, 200), [0.0]]).astype(np.float32)
    got = np.array([exp32(e) for e in v])  # float32 results, boxed as Python floats
    assert np.array_equal(got, got.astype(np.float32))
    want = np.exp(v.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 1e-7
    special = np.array([exp32(np.float32(e)) for e in (-np.inf, -100.0, 100.0, np.inf, np.nan)])
    assert special[0] == 0 and special[1] == 0 and special[2] == np.inf and special[3] == np.inf
    assert np.isnan(special[4])


def test_batched_matmul_split_over_threads_equals_numpy_on_strided_views():
    """CPUBackend.batched_matmul over two threads (the attention's products on views of (N, T, 3, heads, hd),
    written into a transposed view) equals np.matmul bit for bit: each sample's products are the same calls."""
    from pydtnn.backends.cpu import threads

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((6, 5, 3, 2, 4)).astype(np.float32).transpose(2, 0, 3, 1, 4)  # (N, heads, T, hd)
    b = CPUBackend(np.float32, tuning=dataclasses.replace(tuning.DEFAULT, split_min_bytes=0))
    before = threads.threads()
    threads.set_threads(2)
    try:
        scores = b.batched_matmul(q, k.transpose(0, 1, 3, 2))
        out = np.empty((6, 5, 2, 4), np.float32)  # (N, T, heads, hd)
        b.batched_matmul(scores, v, out=out.transpose(0, 2, 1, 3))
    finally:
        threads.set_threads(before)
    np.testing.assert_array_equal(scores, np.matmul(q, k.transpose(0, 1, 3, 2)))
    np.testing.assert_array_equal(out, np.matmul(scores, v).transpose(0, 2, 1, 3))


def test_compiled_softmax_keeps_a_nan_among_masked_entries_and_refuses_non_square_causal_scores():
    """A row of -inf with a NaN in it is NaN, as NumPy's softmax gives it (not zeros); a causal softmax of scores
    that are not (..., T, T) is refused on both paths."""
    x = np.full((2, 3), -np.inf, np.float32)
    x[0, 2] = np.nan
    for kernels in ("numba", "numpy"):
        b = CPUBackend(np.float32, kernels=kernels)
        y = b.softmax_forward(x)
        assert np.isnan(y[0]).all() and not y[1].any()
        with pytest.raises(Exception, match=r"a causal softmax takes scores \(\.\.\., T, T\).*\(2, 3\)"):
            b.softmax_forward(x, causal=True)
