"""The Backend contract: every operation a layer, loss, optimizer or trainer may ask of a backend.

A backend owns one device's array module (`xp`), the default dtype, a seeded Generator, and the
operations whose best implementation differs per device. This class writes each operation once
against `xp` (NumPy or CuPy), so a new backend overrides only what it accelerates; the operations
without a generic form (convolution, pooling) raise NotImplementedError here. Layers call these
methods and nothing else of a backend: no layer asks whether a method exists or which backend it has.

    backend.xp, backend.dtype, backend.rng, backend.reseed(key), backend.sample_streams_for(streams)
    asarray / to_numpy / batch_to_device / upload / synchronize    moving data
    matmul                                                         Dense
    batched_matmul                                                 products per (sample, head)
    attention_forward / attention_backward                         scaled dot-product attention of the heads
    conv2d_plan / conv2d_forward / conv2d_backward                 Conv2D (a plan chosen once per layer)
    bias_forward / bias_backward                                   a convolution's bias
    maxpool2d_* / avgpool2d_*                                      MaxPool2D, AvgPool2D
    relu_forward / relu_backward                                   ReLU, ReLU6 (cap=6)
    batchnorm_forward / batchnorm_backward                         BatchNorm, training on its own batch
    batchnorm_update_running                                       BatchNorm's running statistics
    channel_moments / channel_affine / channel_sums / channel_centered_dot / channel_affine_dx
                                                                   BatchNorm otherwise (running or
                                                                   synchronized statistics)
    layernorm_forward / layernorm_backward                         LayerNorm (over the last axis)
    gelu_forward / gelu_backward / erf                             GELU, exact or tanh form
    softmax_forward / softmax_backward                             attention weights (the last axis; scaled, causal)
    dropout_mask                                                   Dropout, attention dropout
    sgd_update / adam_update / adam_moments                        SGD, Adam, AdamW, Nadam

Arrays are NCHW; per-channel statistics and coefficients are float64 (C,); tensors keep their dtype.
The update methods are the one definition of their math: the compiled CPU kernels and the CUDA
kernels do the same operations in the same order and are tested against these.
"""

import math

import numpy as np

from pydtnn.errors import ShapeError

GELU_C = math.sqrt(2 / math.pi)


class _SampleStreamsScope:
    """The context manager Backend.sample_streams_for returns: one per backend, reused batch after batch."""

    def __init__(self, backend):
        self.backend, self.streams = backend, None

    def __enter__(self):
        self.backend.sample_streams = self.streams
        return self.streams

    def __exit__(self, *exc):
        self.backend.sample_streams = self.streams = None


class Backend:
    """Generic backend over an array module. Subclasses: CPUBackend (backends/cpu), GPUBackend (backends/gpu/)."""

    name = "generic"

    def __init__(self, xp=np, dtype=np.float32, seed=0):
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.seed = seed
        self.rng = np.random.default_rng(seed)  # host Generator: the same draws on every device
        self.sample_streams = None  # the batch in flight's randomness.SampleStreams: see sample_streams_for
        self._streams_scope = _SampleStreamsScope(self)

    def __repr__(self):
        return f"{type(self).__name__}(dtype={self.dtype.name}, seed={self.seed})"

    def reseed(self, key):
        """Restart the Generator from a key (a list of ints): the trainer keys dropout per step."""
        self.rng = np.random.default_rng(key)

    def sample_streams_for(self, streams):
        """A context for one batch in flight: inside it, `sample_streams` is `streams` (its randomness.SampleStreams,
        one per row, or None), so dropout_mask draws row i of a mask with len(streams) rows from sample i's
        stream; on leaving, an exception included, it is None again (the Generator serves what runs outside).
        One batch at a time (not nested); the same context object serves every batch, so nothing is allocated.

            with backend.sample_streams_for(SampleStreams(seed, epoch, indices)):
                out = model.forward(x, training=True)
        """
        self._streams_scope.streams = streams
        return self._streams_scope

    # -- moving data -------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Array on this device (no copy when it already is one of the right dtype)."""
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a):
        """A NumPy array on the host."""
        return np.asarray(a)

    def batch_to_device(self, *arrays):
        """One step's batch arrays (inputs, targets) on this device: one array gives one array, several a
        tuple. A GPU copies them while it computes the step before, into buffers that later calls reuse:
        queue every use of a step's arrays before asking for the next step's."""
        out = tuple(self.asarray(a) for a in arrays)
        return out[0] if len(out) == 1 else out

    def upload(self, a):
        """A host array made during a step (a dropout mask), on this device; a GPU copies it without
        making the host wait for the work already queued."""
        return self.asarray(a)

    def synchronize(self):
        """Wait until the device has finished the work queued so far (timing; nothing on a CPU)."""

    # -- dense ---------------------------------------------------------------------------------
    def matmul(self, a, b, out=None):
        """a (M, K) @ b (K, N), into out when given."""
        return self.xp.matmul(a, b, out=out)

    def batched_matmul(self, a, b, out=None):
        """a (B, ..., M, K) @ b (B, ..., K, N), one product per leading index (views with any strides: the
        heads of attention), into out (any strides) when given."""
        r = self.xp.matmul(a, b)
        if out is None:
            return r
        out[...] = r
        return out

    # -- convolution -----------------------------------------------------------------------------
    def conv2d_plan(self, g, weight_shape):
        """How this backend computes a convolution of geometry g with weights of weight_shape (Co, C/groups,
        kh, kw): chosen once, when the layer is built, and passed to every forward and backward."""
        raise NotImplementedError(f"{type(self).__name__} has no convolution")

    def conv2d_forward(self, x, w, plan, keep=True):
        """y = conv(x, w): x (N, C, H, W) -> y (N, Co, Ho, Wo). Returns (y, ctx): what backward needs
        (None when keep is false)."""
        raise NotImplementedError(f"{type(self).__name__} has no convolution")

    def conv2d_backward(self, dy, w, ctx, plan, need_dx=True):
        """(dx or None, dw) of conv2d_forward for upstream dy (N, Co, Ho, Wo)."""
        raise NotImplementedError(f"{type(self).__name__} has no convolution")

    def bias_forward(self, y, b):
        """y (N, C, H, W) += b (C,) per channel, in place."""
        y += b.reshape(1, -1, 1, 1)

    def bias_backward(self, dy, out):
        """out (C,) = dy (N, C, H, W) summed over samples and pixels."""
        dy.sum(axis=(0, 2, 3), out=out)

    # -- pooling ---------------------------------------------------------------------------------
    def maxpool2d_forward(self, x, g, keep=True):
        """Max over windows, padding as -inf: (y, ctx), ctx locating each window's first maximum."""
        raise NotImplementedError(f"{type(self).__name__} has no pooling")

    def maxpool2d_backward(self, dy, ctx, g):
        """dx: each window's dy at its first maximum."""
        raise NotImplementedError(f"{type(self).__name__} has no pooling")

    def avgpool2d_forward(self, x, g, keep=True):
        """Mean over windows, zero padding counted in the divisor: (y, ctx)."""
        raise NotImplementedError(f"{type(self).__name__} has no pooling")

    def avgpool2d_backward(self, dy, ctx, g):
        """dx: each window's dy shared out over the window."""
        raise NotImplementedError(f"{type(self).__name__} has no pooling")

    # -- ReLU ------------------------------------------------------------------------------------
    def relu_forward(self, x, cap=None):
        """y = max(x, 0), and with a cap min(that, cap) (ReLU6: cap 6); NaN goes through."""
        y = self.xp.maximum(x, x.dtype.type(0))
        if cap is not None:
            self.xp.minimum(y, x.dtype.type(cap), out=y)
        return y

    def relu_backward(self, dy, y, cap=None):
        """dy where y > 0 (and, with a cap, y < cap), else 0."""
        if cap is None:
            return dy * (y > 0)
        return dy * ((y > 0) & (y < cap))

    # -- batch normalization -------------------------------------------------------------------
    # Per channel c of x (N, C) or (N, C, H, W), with m = N*H*W values per channel:
    #   forward  y = a*x + b,  a = weight / sqrt(var + eps),  b = bias - mean*a
    #   backward dx = k1*dy + k2*x + k0 (coefficients from the sums below)
    def channel_sums(self, a):
        """Per-channel sum of a, float64 (C,)."""
        return a.reshape(a.shape[0], a.shape[1], -1).sum(axis=(0, 2), dtype=np.float64)

    def channel_centered_dot(self, a, x, mean):
        """Per-channel sum of a * (x - mean), float64 (C,); a is x itself for the variance."""
        xc = x - self._per_channel(mean, x)
        other = xc if a is x else a
        r = lambda t: t.reshape(t.shape[0], t.shape[1], -1)  # noqa: E731
        return self.xp.einsum("ncl,ncl->nc", r(other), r(xc)).sum(axis=0, dtype=np.float64)

    def channel_moments(self, x):
        """(mean, biased variance, m): this batch's per-channel statistics in float64, and the count."""
        m = x.size // x.shape[1]
        mean = self.channel_sums(x) / m
        return mean, self.channel_centered_dot(x, x, mean) / m, m

    def channel_affine(self, x, a, b=None):
        """y = a * x + b (b None: a * x) with per-channel a, b (float64 (C,), applied in x's dtype)."""
        y = self.xp.multiply(x, self._per_channel(a, x))
        if b is not None:
            y += self._per_channel(b, x)
        return y

    def channel_affine_dx(self, dy, x, k1, k2, k0):
        """dx = k1 * dy + k2 * x + k0 with per-channel coefficients (float64 (C,))."""
        dx = self.xp.multiply(x, self._per_channel(k2, dy))
        dx += self._per_channel(k0, dy)
        dx += dy * self._per_channel(k1, dy)
        return dx

    def batchnorm_forward(self, x, weight, bias, eps):
        """Training-mode batch normalization on this batch's statistics: (y, mean, var, inv_std), var the
        biased variance and inv_std = 1 / sqrt(var + eps), all three float64 (C,)."""
        mean, var, _ = self.channel_moments(x)
        inv_std = 1 / self.xp.sqrt(var + eps)
        a = weight * inv_std
        return self.channel_affine(x, a, bias - mean * a), mean, var, inv_std

    def batchnorm_update_running(self, running_mean, running_var, mean, var, momentum, m):
        """running = (1 - momentum) * running + momentum * statistic, in place (PyTorch's rule): the mean, and
        the biased variance `var` of m values made unbiased (times m / (m - 1))."""
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += (momentum * m / max(m - 1, 1)) * var

    def batchnorm_backward(self, dy, x, mean, inv_std, weight):
        """Gradients of batchnorm_forward: (dx, dbias, dweight), the last two float64 (C,)."""
        db = self.channel_sums(dy)
        dw = self.channel_centered_dot(dy, x, mean) * inv_std  # sum(dy * xhat)
        m = dy.size // dy.shape[1]
        return self.channel_affine_dx(dy, x, *batchnorm_dx_coefficients(weight, mean, inv_std, db / m, dw / m)), db, dw

    def _per_channel(self, v, like):
        """v (C,) in like's dtype, shaped to broadcast against like (N, C) or (N, C, H, W)."""
        shape = (1, -1) + (1,) * (like.ndim - 2)
        return v.astype(like.dtype).reshape(shape)

    # -- transformer operations: over the last axis of (N, ..., D) ------------------------------------
    def layernorm_forward(self, x, weight, bias, eps):
        """y = (x - mean) / sqrt(var + eps) * weight + bias over the last axis, var the biased variance:
        (y, xhat, inv_std), xhat the normalized x and inv_std (N, ..., 1), in x's dtype."""
        mean = x.mean(axis=-1, keepdims=True)
        xhat = x - mean
        inv_std = 1 / self.xp.sqrt((xhat * xhat).mean(axis=-1, keepdims=True) + x.dtype.type(eps))
        xhat *= inv_std
        return xhat * weight + bias, xhat, inv_std

    def layernorm_backward(self, dy, xhat, inv_std, weight, dweight, dbias):
        """Gradients of layernorm_forward: dweight and dbias written in place (summed over every axis but
        the last); returns dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight."""
        lead = tuple(range(dy.ndim - 1))
        dy.sum(axis=lead, out=dbias)
        (dy * xhat).sum(axis=lead, out=dweight)
        g = dy * weight
        dx = g - g.mean(axis=-1, keepdims=True)
        dx -= xhat * (g * xhat).mean(axis=-1, keepdims=True)
        dx *= inv_std
        return dx

    def erf(self, x):
        """The error function, element-wise, in x's dtype (here math.erf per element: the reference)."""
        return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype)

    def gelu_forward(self, x, approximate="none"):
        """GELU: x * Phi(x), Phi the standard normal CDF 0.5 * (1 + erf(x / sqrt 2)); approximate="tanh":
        0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) (PyTorch's two forms)."""
        if approximate == "tanh":
            t = self.xp.tanh(x.dtype.type(GELU_C) * (x + x.dtype.type(0.044715) * x * x * x))
            return x.dtype.type(0.5) * x * (1 + t)
        return x.dtype.type(0.5) * x * (1 + self.erf(x * x.dtype.type(1 / math.sqrt(2))))

    def gelu_backward(self, dy, x, approximate="none"):
        """dy * GELU'(x): Phi(x) + x * phi(x) (phi the normal density), or the tanh form's derivative."""
        f = x.dtype.type
        if approximate == "tanh":
            t = self.xp.tanh(f(GELU_C) * (x + f(0.044715) * x * x * x))
            d = f(0.5) * (1 + t) + f(0.5) * x * (1 - t * t) * f(GELU_C) * (1 + f(3 * 0.044715) * x * x)
        else:
            d = f(0.5) * (1 + self.erf(x * f(1 / math.sqrt(2)))) + x * self.xp.exp(f(-0.5) * x * x) * f(
                1 / math.sqrt(2 * math.pi))
        return dy * d

    def attention_forward(self, qkv, scale, causal, keep=None):
        """Scaled dot-product self-attention of H heads: qkv (N, T, 3, H, hd), each token's q, k and v as the
        input projection writes them. Returns (o, a): a (N, H, T, T) = softmax(scale * q k^T) per head, query i
        seeing keys 0..i only when causal (0 beyond), and o (N, T, H, hd) = (a * keep) v, keep (N, H, T, T)
        dropout's mask on the weights (None: no dropout)."""
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # (N, H, T, hd) views
        a = self.softmax_forward(self.batched_matmul(q, k.transpose(0, 1, 3, 2)), scale, causal)
        n, t, _, h, hd = qkv.shape
        o = self.xp.empty((n, t, h, hd), qkv.dtype)
        self.batched_matmul(a * keep if keep is not None else a, v, out=o.transpose(0, 2, 1, 3))
        return o, a

    def attention_backward(self, do, qkv, a, scale, causal, keep=None):
        """Gradients of attention_forward from do (N, T, H, hd): dqkv (N, T, 3, H, hd), dq, dk and dv in q's, k's
        and v's places (a's zeros carry the causal mask)."""
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        do = do.transpose(0, 2, 1, 3)
        dqkv = self.xp.empty(qkv.shape, qkv.dtype)  # dq, dk and dv written in place by their products
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)
        self.batched_matmul((a * keep if keep is not None else a).transpose(0, 1, 3, 2), do, out=dv)
        da = self.batched_matmul(do, v.transpose(0, 1, 3, 2))
        if keep is not None:
            da *= keep
        ds = self.softmax_backward(da, a, scale)
        self.batched_matmul(ds, k, out=dq)
        self.batched_matmul(ds.transpose(0, 1, 3, 2), q, out=dk)
        return dqkv

    def softmax_forward(self, x, scale=1.0, causal=False):
        """Softmax of scale * x (scale > 0) over the last axis, a row of -inf giving zeros (a fully masked
        row) rather than NaN. causal: x ends in square (T, T) blocks of attention scores, and query i sees
        keys 0..i only (the entries above the diagonal are taken as -inf, whatever x holds there)."""
        xp = self.xp
        check_causal(x, causal)
        if scale != 1:
            x = x * x.dtype.type(scale)
        if causal:
            t = x.shape[-1]
            x = xp.where(xp.asarray(np.tril(np.ones((t, t), bool))), x, x.dtype.type(-np.inf))
        m = x.max(axis=-1, keepdims=True)
        e = xp.exp(x - xp.where(xp.isfinite(m), m, 0))
        s = e.sum(axis=-1, keepdims=True)
        e /= xp.where((s > 0) | xp.isnan(s), s, 1)  # a fully masked row gives zeros, a NaN in the row NaN
        return e

    def softmax_backward(self, dy, y, scale=1.0):
        """dx = scale * y * (dy - sum(dy * y)) over the last axis: the gradient of softmax_forward(x, scale)."""
        dx = y * (dy - (dy * y).sum(axis=-1, keepdims=True))
        if scale != 1:
            dx *= dx.dtype.type(scale)
        return dx

    # -- dropout ---------------------------------------------------------------------------------
    def dropout_mask(self, shape, rate, dtype, stream=None):
        """Mask of 0 (probability rate) and 1/(1-rate). With the trainer's per-sample streams set for a
        batch of shape[0] samples and a layer's `stream` given (randomness.layer_stream), row i is drawn
        from its sample's stream, so masks do not depend on the process count; else from the Generator."""
        streams = self.sample_streams
        if stream is not None and streams is not None and len(streams) == shape[0]:
            keep = streams.rows(stream).uniform_rows(shape, np.float32) >= rate
        else:
            keep = self.rng.random(shape, dtype=np.float32) >= rate  # float32 draws: half the bytes
        return self.upload(keep.astype(dtype) * np.dtype(dtype).type(1 / (1 - rate)))

    # -- optimizer updates ---------------------------------------------------------------------
    def sgd_update(self, p, g, buf, tmp, lr, weight_decay, momentum, dampening, nesterov, first):
        """One SGD step of p in place (torch.optim.SGD). With d = g + weight_decay * p:
        buf = d on the first step, else momentum * buf + (1 - dampening) * d (with momentum > 0);
        p -= lr * (d + momentum * buf if nesterov else buf if momentum else d).
        tmp: two scratch arrays shaped like p."""
        xp = self.xp
        d = g
        if weight_decay:
            d = xp.multiply(p, weight_decay, out=tmp[0])
            d += g
        if momentum:
            if first:
                buf[...] = d
            else:
                buf *= momentum
                buf += d if dampening == 0 else xp.multiply(d, 1 - dampening, out=tmp[1])
            if nesterov:
                d_next = xp.multiply(buf, momentum, out=tmp[1])
                d_next += d
                d = d_next
            else:
                d = buf
        p -= xp.multiply(d, lr, out=tmp[0])

    def adam_moments(self, p, g, m, v, tmp, lr, beta1, beta2, weight_decay, decoupled):
        """Adam's first half, shared with Nadam: weight decay (decoupled: p *= 1 - lr * weight_decay;
        else L2, d = g + weight_decay * p), then m += (1 - beta1) * (d - m) (torch's lerp) and
        v = beta2 * v + (1 - beta2) * d * d in place. Returns d (g or tmp[0])."""
        xp = self.xp
        d = g
        if weight_decay and decoupled:
            p *= 1 - lr * weight_decay
        elif weight_decay:
            d = xp.multiply(p, weight_decay, out=tmp[0])
            d += g
        s = tmp[1]
        xp.subtract(d, m, out=s)
        s *= 1 - beta1
        m += s
        v *= beta2
        xp.multiply(d, d, out=s)
        s *= 1 - beta2
        v += s
        return d

    def adam_update(self, p, g, m, v, tmp, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        """One Adam (decoupled=False) or AdamW (decoupled=True) step of p in place (torch.optim.Adam /
        AdamW): adam_moments, then p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)."""
        xp = self.xp
        self.adam_moments(p, g, m, v, tmp, lr, beta1, beta2, weight_decay, decoupled)
        s = xp.sqrt(v, out=tmp[1])
        s /= (1 - beta2**step) ** 0.5
        s += eps
        xp.divide(m, s, out=s)
        s *= lr / (1 - beta1**step)
        p -= s


def check_causal(x, causal):
    """ShapeError unless x ends in square blocks of scores (queries by keys) where the causal mask applies."""
    if causal and (x.ndim < 2 or x.shape[-2] != x.shape[-1]):
        raise ShapeError(f"a causal softmax takes scores (..., T, T), queries by keys; got shape {tuple(x.shape)}")


def batchnorm_dx_coefficients(weight, mean, inv_std, mean_dy, mean_dy_xhat):
    """(k1, k2, k0) of dx = k1*dy + k2*x + k0 = scale * (dy - mean_dy - xhat * mean_dy_xhat), with
    scale = weight * inv_std and xhat = (x - mean) * inv_std: per channel, float64."""
    scale = weight * inv_std
    k2 = -scale * inv_std * mean_dy_xhat
    return scale, k2, -scale * mean_dy - k2 * mean
