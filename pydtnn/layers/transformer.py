"""Transformer layers: token and learned position embeddings, multi-head self-attention, a pre-norm block,
patch embedding, a class token and sequence pooling.

A sample is a sequence of T tokens of D features: tensors are (N, T, D) for a batch, and a layer's input
shape (without the batch) is (T, D); token ids are (N, T). Parameter names are PyTorch's where it has the
layer (nn.Embedding's weight, nn.MultiheadAttention's in_proj_weight / in_proj_bias, its out_proj's
weight and bias as out_proj_weight / out_proj_bias).

    Sequential([Embedding(256, 64), PositionalEmbedding(), TransformerBlock(64, 4, causal=True),
                LayerNorm(), Dense(256)])                        # a character-level GPT, (T,) ids in
    Sequential([PatchEmbedding(64, 4), ClassToken(), PositionalEmbedding(), TransformerBlock(64, 4),
                LayerNorm(), SequencePool("cls"), Dense(10)])    # a ViT, (C, H, W) images in
"""

import math

import numpy as np

from pydtnn.errors import ShapeError
from pydtnn.layers.activation import GELU
from pydtnn.layers.base import Layer
from pydtnn.layers.blocks import AdditionBlock, Sequential
from pydtnn.layers.conv import Conv2D
from pydtnn.layers.dense import Dense
from pydtnn.layers.dropout import Dropout
from pydtnn.layers.norm import LayerNorm
from pydtnn.randomness import layer_stream


class Embedding(Layer):
    """Token ids (T,) -> vectors (T, D): row id of weight (vocab_size, D), as nn.Embedding.

    The ids may come in any numeric dtype (the data pipeline's float arrays included) but must be whole
    numbers in [0, vocab_size); anything else is refused with the bad value named. Ids have no gradient:
    backward returns None (an Embedding is a model's first layer)."""

    def __init__(self, vocab_size, dim, weight_init="gpt_normal"):
        super().__init__()
        self.vocab_size, self.dim, self.weight_init = int(vocab_size), int(dim), weight_init
        if self.vocab_size < 1 or self.dim < 1:
            raise ValueError(f"Embedding needs vocab_size and dim >= 1, got {vocab_size!r} and {dim!r}")
        self.need_dx = False  # ids have no gradient: a layer before it would wait for one (build refuses that)

    def describe(self):
        return f"Embedding({self.vocab_size}, {self.dim})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        if self.need_dx:
            raise ShapeError(f"{self.name}: token ids have no gradient, so an Embedding must come first in its model; "
                             f"expected it as the first layer")
        self.expect_rank(1, "(tokens,) of token ids")
        self.add_param("weight", self.init(self.weight_init, (self.vocab_size, self.dim), self.vocab_size, self.dim))
        self.output_shape = (self.input_shape[0], self.dim)

    def forward(self, x, training=True):
        xp = self.xp
        ids = x if x.dtype.kind in "iu" else x.astype(np.int64)
        if x.dtype.kind not in "iu" and bool((ids != x).any()):
            bad = x[ids != x].reshape(-1)[0]
            raise ValueError(f"{self.name}: token ids must be whole numbers, got {float(bad)!r}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"{self.name}: token id {bad} outside the vocabulary; expected 0 to {self.vocab_size - 1}")
        self.ids = ids if training else None
        return xp.take(self.params["weight"], ids, axis=0)

    def backward(self, dy):
        ids = self.take_saved("ids")
        g = self.grads["weight"]
        g[...] = 0
        self.xp.add.at(g, ids.reshape(-1), dy.reshape(-1, self.dim))  # no dL/dx: None

    def flops(self):
        return 0


class PositionalEmbedding(Layer):
    """y = x + weight, a learned vector per position: x (T, D), weight (T, D) (GPT-2's and ViT's
    position embeddings)."""

    def __init__(self, weight_init="gpt_normal"):
        super().__init__()
        self.weight_init = weight_init

    def describe(self):
        return "PositionalEmbedding()"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(2, "(tokens, features)")
        t, d = self.input_shape
        self.add_param("weight", self.init(self.weight_init, (t, d), d, d))

    def forward(self, x, training=True):
        return x + self.params["weight"]

    def backward(self, dy):
        dy.sum(axis=0, out=self.grads["weight"])
        return dy

    def flops(self):
        return int(np.prod(self.input_shape))


class ClassToken(Layer):
    """Prepends a learned token: (T, D) -> (T + 1, D), the token first (ViT's class token, torchvision's
    class_token of shape (1, D) here)."""

    def describe(self):
        return "ClassToken()"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(2, "(tokens, features)")
        self.add_param("class_token", self.xp.zeros((1, self.input_shape[1]), self.dtype))
        self.output_shape = (self.input_shape[0] + 1, self.input_shape[1])

    def forward(self, x, training=True):
        token = self.xp.broadcast_to(self.params["class_token"], (x.shape[0], 1, x.shape[2]))
        return self.xp.concatenate([token.astype(x.dtype), x], axis=1)

    def backward(self, dy):
        dy[:, 0].sum(axis=0, out=self.grads["class_token"][0])
        return dy[:, 1:]


class SequencePool(Layer):
    """(T, D) -> (D,): the first token ("cls", after a ClassToken) or the mean over the tokens ("mean")."""

    MODES = ("cls", "mean")

    def __init__(self, mode="cls"):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"SequencePool mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        self.mode = mode

    def describe(self):
        return f"SequencePool({self.mode})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(2, "(tokens, features)")
        self.output_shape = (self.input_shape[1],)

    def forward(self, x, training=True):
        return x[:, 0].copy() if self.mode == "cls" else x.mean(axis=1)

    def backward(self, dy):
        n, (t, d) = dy.shape[0], self.input_shape
        if self.mode == "mean":
            return self.xp.broadcast_to((dy / dy.dtype.type(t))[:, None, :], (n, t, d)).copy()
        dx = self.xp.zeros((n, t, d), dy.dtype)
        dx[:, 0] = dy
        return dx


class Tokens(Layer):
    """(C, H, W) -> (H * W, C): each pixel a token of its channels, row-major over (H, W) (torchvision ViT's
    flatten(2).transpose(1, 2))."""

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(3, "(C, H, W)")
        c, h, w = self.input_shape
        self.output_shape = (h * w, c)

    def forward(self, x, training=True):
        return self.xp.ascontiguousarray(x.reshape(x.shape[0], x.shape[1], -1).transpose(0, 2, 1))

    def backward(self, dy):
        return self.xp.ascontiguousarray(dy.transpose(0, 2, 1)).reshape((dy.shape[0],) + self.input_shape)


class PatchEmbedding(Sequential):
    """Images (C, H, W) -> patch tokens (H/p * W/p, dim): a convolution of kernel and stride p ("proj") and
    its pixels as tokens (ViT's conv_proj)."""

    def __init__(self, dim, patch):
        self.dim, self.patch = int(dim), int(patch)
        super().__init__({"proj": Conv2D(self.dim, self.patch, stride=self.patch), "tokens": Tokens()})

    def describe(self):
        return f"PatchEmbedding({self.dim}, patch {self.patch})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        if len(input_shape) != 3 or input_shape[1] % self.patch or input_shape[2] % self.patch:
            raise ShapeError(f"PatchEmbedding: expects images (C, H, W) with H and W multiples of the patch "
                             f"{self.patch}, got {tuple(input_shape)}")
        super().build(input_shape, dtype, backend)


class MultiHeadAttention(Layer):
    """Multi-head self-attention over (T, D) tokens, as nn.MultiheadAttention(D, heads, batch_first=True)
    called on (x, x, x), with an optional causal mask and dropout on the attention weights.

    q, k, v = x @ in_proj_weight.T + in_proj_bias, cut in three then in `heads` heads of D / heads;
    per head a = softmax(q k^T / sqrt(D / heads)) (a token sees only itself and earlier ones when causal),
    dropped out at rate `dropout` in training; y = concat(a v) @ out_proj_weight.T + out_proj_bias. The
    heads' scaled dot-product attention is the backend's (attention_forward / attention_backward), reading q, k
    and v where the input projection writes them and writing the heads' outputs side by side."""

    def __init__(self, heads, causal=False, dropout=0.0, weight_init="glorot_uniform"):
        super().__init__()
        self.heads, self.causal, self.dropout, self.weight_init = int(heads), bool(causal), float(dropout), weight_init
        # Megatron's split (pydtnn.distributed.model_parallel): this rank computes heads [lo, hi) of `heads`, its
        # output is its share of the sum over the ranks, and one rank of them adds out_proj_bias (bias_here)
        self.head_range, self.bias_here = None, True
        if self.heads < 1:
            raise ValueError(f"MultiHeadAttention needs heads >= 1, got {heads!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"MultiHeadAttention dropout must be in [0, 1), got {dropout!r}")

    def describe(self):
        extra = (", causal" if self.causal else "") + (f", dropout {self.dropout}" if self.dropout else "")
        lo, hi = self.head_range or (0, self.heads)
        heads = f"{self.heads} heads" if self.head_range is None else f"heads {lo}:{hi} of {self.heads}"
        return f"MultiHeadAttention({heads}{extra})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        super().build(input_shape, dtype, backend)
        self.expect_rank(2, "(tokens, features)")
        t, d = self.input_shape
        if d % self.heads:
            raise ShapeError(f"{self.name}: {d} features do not split into {self.heads} heads; expected a multiple "
                             f"of {self.heads}")
        lo, hi = self.head_range or (0, self.heads)
        self.head_dim, self.local_heads = d // self.heads, hi - lo
        inner = self.local_heads * self.head_dim  # d, unless split by heads
        self.add_param("in_proj_weight", self.init(self.weight_init, (3 * inner, d), d, 3 * d))
        self.add_param("in_proj_bias", self.xp.zeros(3 * inner, self.dtype))
        self.add_param("out_proj_weight", self.init(self.weight_init, (d, inner), d, d))
        self.add_param("out_proj_bias", self.xp.zeros(d, self.dtype))

    def forward(self, x, training=True):
        xp, b = self.xp, self.backend
        n, t, d = x.shape
        h, hd = self.local_heads, self.head_dim
        x2 = x.reshape(n * t, d)
        qkv = b.matmul(x2, self.params["in_proj_weight"].T)
        qkv += self.params["in_proj_bias"]
        keep = None
        if training and self.dropout:  # the whole layer's mask, these heads' part of it
            lo, hi = self.head_range or (0, self.heads)
            keep = b.dropout_mask((n, self.heads, t, t), self.dropout, x.dtype, layer_stream(self.path))
            keep = keep if self.head_range is None else xp.ascontiguousarray(keep[:, lo:hi])
        # each head's softmax(q k^T / sqrt(hd)) (a query seeing itself and earlier keys when causal), dropped
        # out, times v: the heads' outputs side by side, (N, T, heads, hd)
        o, a = b.attention_forward(qkv.reshape(n, t, 3, h, hd), 1 / math.sqrt(hd), self.causal, keep)
        o = o.reshape(n * t, h * hd)
        y = b.matmul(o, self.params["out_proj_weight"].T)
        if self.bias_here:
            y += self.params["out_proj_bias"]
        self.saved = (x2, qkv, a, keep, o) if training else None
        return y.reshape(n, t, d)

    def backward(self, dy):
        b = self.backend
        x2, qkv, a, keep, o = self.take_saved("saved")
        n, t, d = dy.shape
        h, hd = self.local_heads, self.head_dim
        dy2 = dy.reshape(n * t, d)
        b.matmul(dy2.T, o, out=self.grads["out_proj_weight"])
        dy2.sum(axis=0, out=self.grads["out_proj_bias"])
        do = b.matmul(dy2, self.params["out_proj_weight"]).reshape(n, t, h, hd)
        dqkv = b.attention_backward(do, qkv.reshape(n, t, 3, h, hd), a, 1 / math.sqrt(hd), self.causal, keep)
        dqkv = dqkv.reshape(n * t, 3 * h * hd)
        b.matmul(dqkv.T, x2, out=self.grads["in_proj_weight"])
        dqkv.sum(axis=0, out=self.grads["in_proj_bias"])
        if not self.need_dx:
            return None
        return b.matmul(dqkv, self.params["in_proj_weight"]).reshape(n, t, d)

    def flops(self):
        t, d = self.input_shape
        h = self.local_heads
        inner = h * self.head_dim
        return 2 * t * d * 3 * inner + 2 * 2 * t * t * inner + 5 * h * t * t + 2 * t * inner * d + 4 * t * d  # + biases


class TransformerBlock(Sequential):
    """A pre-norm transformer block over (T, dim) tokens (GPT-2's and ViT's):

        x = x + drop(attn(ln_1(x)))                 child "attention": AdditionBlock of ln_1, attn(, drop)
        x = x + drop(proj(gelu(fc(ln_2(x)))))       child "mlp": AdditionBlock of ln_2, fc, gelu, proj(, drop)

    attn a MultiHeadAttention of `heads` (causal or not, attention_dropout on its weights), fc a Dense to
    mlp_dim (4 x dim by default) and proj back to dim, both over the tokens; dropout after each branch."""

    def __init__(self, dim, heads, mlp_dim=None, causal=False, dropout=0.0, attention_dropout=0.0,
                 approximate="none"):
        self.dim, self.heads = int(dim), int(heads)
        self.mlp_dim = int(mlp_dim) if mlp_dim is not None else 4 * self.dim
        attention = {"ln_1": LayerNorm(), "attn": MultiHeadAttention(heads, causal, attention_dropout)}
        mlp = {"ln_2": LayerNorm(), "fc": Dense(self.mlp_dim, weight_init="gpt_normal"), "gelu": GELU(approximate),
               "proj": Dense(self.dim, weight_init="gpt_normal")}
        if dropout:
            attention["drop"], mlp["drop"] = Dropout(dropout), Dropout(dropout)
        super().__init__({"attention": AdditionBlock(attention, [], names=("", "identity")),
                          "mlp": AdditionBlock(mlp, [], names=("", "identity"))})

    def describe(self):
        return f"TransformerBlock({self.dim}, {self.heads} heads, mlp {self.mlp_dim})"

    def build(self, input_shape, dtype=np.float32, backend=None):
        if len(input_shape) != 2 or int(input_shape[-1]) != self.dim:
            raise ShapeError(f"TransformerBlock({self.dim}): expects tokens (T, {self.dim}), got {tuple(input_shape)}")
        super().build(input_shape, dtype, backend)
