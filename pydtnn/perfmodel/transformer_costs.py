"""What the transformer layers (layers/transformer.py, LayerNorm, GELU) cost on the CPU backend: costs.py's
formulas for them, under its units and counting rules. Notation: N batch, T tokens, D features, H heads,
s bytes per element, E = N*T*D the elements of a (N, T, D) tensor, V the vocabulary.
"""

import math

from pydtnn.layers import (
    GELU,
    ClassToken,
    Embedding,
    LayerNorm,
    MultiHeadAttention,
    PositionalEmbedding,
    SequencePool,
    Tokens,
)
from pydtnn.perfmodel.phase_cost import ZERO, PhaseCost

ID_BYTES = 8  # a token id as int64


def _elements(layer, n):
    return n * math.prod(layer.input_shape)


def layernorm(layer, n, need_dx):
    """LayerNorm (backend.layernorm_forward / _backward over the last axis): forward 8*E flops, backward 10*E.
    Compiled (a row's passes while it is in cache): forward x read, xhat and y written (3*E*s); backward dbias
    and dweight summed by NumPy (1 + 3 + 1) and dx's pass (dy and xhat read, dx written: 3): 8*E*s. NumPy: forward
    the mean read (X), x - mean (2), its square (3) and mean (1), xhat scaled (2), weight and bias applied (4):
    13*E*s; backward the sums (5), g = dy*weight (2), its mean (1) and subtraction (3), g*xhat (3), its mean (1)
    and product with xhat (3), subtracted (3) and scaled (2): 23*E*s. The (D,) parameters and the per-row
    statistics are left out."""
    e, s = _elements(layer, n), layer.dtype.itemsize
    f_bytes, b_bytes = (3, 8) if layer.backend.kernels == "numba" else (13, 23)
    return None, "elementwise", PhaseCost(8 * e, f_bytes * e * s), PhaseCost(10 * e, b_bytes * e * s), ZERO


def gelu(layer, n, need_dx):
    """GELU: the compiled kernels' one pass each way, forward x read and y written (2*E*s), backward dy and x
    read and dx written (3*E*s); Layer.flops forward (8 an element: erf or tanh counted as 4), 12*E backward.
    (Without Numba, erf runs through Python's math.erf per element: far slower than this, the reference
    path only.)"""
    e, s = n * math.prod(layer.input_shape), layer.dtype.itemsize
    return None, "elementwise", PhaseCost(8 * e, 2 * e * s), PhaseCost(12 * e, 3 * e * s), ZERO


def embedding(layer, n, need_dx):
    """Embedding: forward the ids converted and checked (N*T ids read 4 times, written once as int64), the
    rows gathered (E*s read, E*s written); backward the gradient cleared (V*D*s) and the rows added into it
    (np.add.at: dy read, the gradient's rows read and written, 3*E*s), E flops. No dx."""
    t, d, s = layer.input_shape[0], layer.dim, layer.dtype.itemsize
    e = n * t * d
    ids = n * t * (4 * s + ID_BYTES)
    return None, "elementwise", PhaseCost(0, ids + 2 * e * s), ZERO, PhaseCost(e, (3 * e + layer.vocab_size * d) * s)


def positional(layer, n, need_dx):
    """PositionalEmbedding: forward x + weight, E flops (x read and y written, the (T, D) weight read);
    backward dweight summed over the batch (dy read, E flops); dx is dy itself."""
    e, w, s = _elements(layer, n), _elements(layer, 1), layer.dtype.itemsize
    return None, "elementwise", PhaseCost(e, (2 * e + w) * s), ZERO, PhaseCost(e, (e + w) * s)


def class_token(layer, n, need_dx):
    """ClassToken: forward the token broadcast and cast (N*D written) and the concatenation (x read, y
    written); backward the token's gradient summed (N*D read), dx a view of dy."""
    t, d = layer.input_shape
    s = layer.dtype.itemsize
    return (None, "elementwise", PhaseCost(0, (2 * n * t * d + 3 * n * d) * s), ZERO,
            PhaseCost(n * d, (n * d + d) * s))


def sequence_pool(layer, n, need_dx):
    """SequencePool: "cls" copies the first token (2*N*D*s) and backward writes a zero dx with dy in its first
    row (E*s + 2*N*D*s); "mean" reads the tokens (E*s, E flops) and backward scales dy (2*N*D*s) and broadcasts
    it into dx (N*D*s read, E*s written)."""
    e, s = _elements(layer, n), layer.dtype.itemsize
    d = layer.input_shape[1]
    if layer.mode == "cls":
        return None, "elementwise", PhaseCost(0, 2 * n * d * s), PhaseCost(0, (e + 2 * n * d) * s), ZERO
    return None, "elementwise", PhaseCost(e, (e + n * d) * s), PhaseCost(n * d, (e + 3 * n * d) * s), ZERO


def tokens(layer, n, need_dx):
    """Tokens: (C, H, W) -> (H*W, C), a transposed copy each way (2*X*s)."""
    x = n * math.prod(layer.input_shape) * layer.dtype.itemsize
    return None, "elementwise", PhaseCost(0, 2 * x), PhaseCost(0, 2 * x), ZERO


def attention(layer, n, need_dx):
    """MultiHeadAttention, GEMMs (through backend.matmul and backend.batched_matmul over (N, H)) and the softmax
    of the (N, H, T, T) scores, A = N*H*T*T of them:
    forward          2*NT*D*3D (q, k, v) + 2*N*T*T*D twice (scores, weights x values) + 2*NT*D*D (out); the
                     bias adds; the softmax of the scaled scores, masked when causal (compiled: one pass with the
                     scale and the mask inside, 2*A; NumPy: the scaling 2*A, the mask 2*A, then max, x - max,
                     exp, sum, divide 8*A) and with dropout its mask (4*A as float32 and 2*A*s) and product
                     (3*A*s); x, q|k|v (3E), o (written by the GEMM in place) and y read and written once each
    backward_data    the same GEMMs twice over but the input projection's dx once (2*NT*3D*D); the softmax's
                     backward (compiled, scaled inside: 3*A; NumPy 9*A and the scaling 2*A), its dropout (3*A);
                     dq, dk, dv written in place by their GEMMs
    backward_weights 2*NT*D*3D + 2*NT*D*D and the biases' sums (4E read)
    Split by heads (Megatron's), the GEMMs' inner D is this rank's heads' share and H its heads.
    """
    t, d = layer.input_shape
    s = layer.dtype.itemsize
    i = layer.local_heads * layer.head_dim  # D, or this rank's heads' share of it (Megatron's split)
    e, a = n * t * d, n * layer.local_heads * t * t
    gemm_f = 2 * n * t * d * 3 * i + 2 * 2 * n * t * t * i + 2 * n * t * i * d
    compiled = layer.backend.kernels == "numba"
    soft_f = 2 if compiled else 2 + (2 if layer.causal else 0) + 8
    soft_b = 3 if compiled else 9 + 2
    f_bytes = soft_f * a * s + 12 * e * s
    b_bytes = soft_b * a * s + 12 * e * s
    if layer.dropout:
        f_bytes += 4 * a + 5 * a * s
        b_bytes += 3 * a * s
    bwd_gemm = 2 * (2 * 2 * n * t * t * i) + 2 * n * t * d * i + (2 * n * t * 3 * i * d if need_dx else 0)
    fwd = PhaseCost(gemm_f + 5 * a + 4 * e, f_bytes)
    bwd_d = PhaseCost(bwd_gemm + 6 * a, b_bytes)
    bwd_w = PhaseCost(2 * n * t * d * 3 * i + 2 * n * t * i * d + 4 * e, 4 * e * s + 4 * d * i * s)
    return None, "gemm", fwd, bwd_d, bwd_w


FORMULAS = (
    (LayerNorm, layernorm),
    (GELU, gelu),
    (Embedding, embedding),
    (PositionalEmbedding, positional),
    (ClassToken, class_token),
    (SequencePool, sequence_pool),
    (Tokens, tokens),
    (MultiHeadAttention, attention),
)
