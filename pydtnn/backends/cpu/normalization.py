"""Batch normalization on the CPU.

Compiled (kernels/normalization.py): training on the batch's own statistics takes one channel at a
time through all its passes (statistics, then the affine map; in backward the two sums, then dx), so
the channel's values are still in cache for the second pass; split over channels, each channel one
thread's whole work, so the thread count never changes a result.

NumPy: per-channel sums are matrix-vector products per row, centered dot products run in batch chunks
of tuning.batchnorm_chunk_bytes (a chunk, its centered copy and the matching dy fit in L2), and the
per-channel coefficients are written out to one sample's shape (C, H, W): NumPy multiplies or adds two
contiguous operands about twice as fast as an operand that repeats one value per channel row.

Layer normalization (the last axis) has compiled kernels only: each row's passes while it is in cache.
"""

import numpy as np


def rows(a):
    """The (N, C, L) view of an (N, C) or (N, C, H, W) array, L = H*W (1 for (N, C))."""
    return a.reshape(a.shape[0], a.shape[1], -1)


def chunks(b, a):
    """Batch slices of about tuning.batchnorm_chunk_bytes."""
    n = a.shape[0]
    step = max(1, b.tuning.batchnorm_chunk_bytes // (a[0].nbytes or 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def coefficient(b, v, like, slot):
    """(key, buffer): v (C,) in like's dtype written out to one sample's shape, in pooled buffer `slot`."""
    key, buf = b.pool.take(("bn_coef", slot), (1,) + like.shape[1:], like.dtype)
    np.copyto(buf, v.astype(like.dtype).reshape((1, -1) + (1,) * (like.ndim - 2)))
    return key, buf


def sums(b, a):
    """Per-channel sum, float64: one matrix-vector product per row, rows added in float64."""
    a3 = rows(a)
    key, ones = b.pool.take("bn_ones", (a3.shape[2],), a.dtype)
    if a3.shape[2] and ones[0] != 1:
        ones[...] = 1
    total = (a3 @ ones).sum(axis=0, dtype=np.float64)
    b.pool.give(key, ones)
    return total


def centered_dot(b, a, x, mean):
    """Per-channel sum of a * (x - mean), float64; x - mean formed a chunk at a time in a pooled buffer."""
    parts = chunks(b, x)
    mkey, mc = coefficient(b, mean, x, 0)
    skey, buf = b.pool.take("bn_chunk", (parts[0].stop,) + x.shape[1:], x.dtype)
    total = 0
    for sl in parts:
        xc = np.subtract(x[sl], mc, out=buf[: sl.stop - sl.start])
        other = xc if a is x else a[sl]
        total = total + np.vecdot(rows(other), rows(xc)).sum(axis=0, dtype=np.float64)
    b.pool.give(mkey, mc)
    b.pool.give(skey, buf)
    return total


def affine(b, x, a, c):
    """y = a * x + c per channel (c None: a * x)."""
    akey, ab = coefficient(b, a, x, 0)
    y = np.empty_like(x)
    np.multiply(x, ab, out=y)
    b.pool.give(akey, ab)
    if c is not None:
        ckey, cb = coefficient(b, c, x, 1)
        y += cb
        b.pool.give(ckey, cb)
    return y


def affine_dx(b, dy, x, k1, k2, k0):
    """dx = k1 * dy + k2 * x + k0 per channel, chunked so that the three passes over dx stay in cache."""
    keys, (c1, c2, c0) = zip(*(coefficient(b, k, dy, i) for i, k in enumerate((k1, k2, k0))))
    dx = np.empty_like(dy)
    parts = chunks(b, dy)
    skey, buf = b.pool.take("bn_chunk", (parts[0].stop,) + dy.shape[1:], dy.dtype)
    for sl in parts:
        d, t = dx[sl], buf[: sl.stop - sl.start]
        np.multiply(x[sl], c2, out=d)
        d += c0
        np.multiply(dy[sl], c1, out=t)
        d += t
    for key, c in zip(keys, (c1, c2, c0)):
        b.pool.give(key, c)
    b.pool.give(skey, buf)
    return dx


def compiled_forward(b, x, weight, bias, eps):
    """(y, mean, var, inv_std) by the fused per-channel kernel; statistics float64."""
    from pydtnn.backends.cpu.kernels import normalization

    x3 = rows(np.ascontiguousarray(x))
    y = np.empty(x3.shape, x.dtype)
    mean, var = np.empty(x3.shape[1]), np.empty(x3.shape[1])
    args = (x3, weight.astype(np.float64), bias.astype(np.float64), float(eps), y, mean, var)
    nbytes = x.nbytes if x.nbytes >= b.tuning.batchnorm_split_bytes else 0
    kernels = normalization.batchnorm_forward, normalization.batchnorm_forward_chunks
    b.split_compiled(*kernels, x3.shape[1], args, nbytes)
    return y.reshape(x.shape), mean, var, 1 / np.sqrt(var + eps)


def compiled_backward(b, dy, x, mean, inv_std, weight):
    """(dx, dbias, dweight) by the fused per-channel kernel; the last two float64 (C,)."""
    from pydtnn.backends.cpu.kernels import normalization

    dy3, x3 = rows(np.ascontiguousarray(dy)), rows(np.ascontiguousarray(x))
    dx = np.empty(x3.shape, dy.dtype)
    db, dw = np.empty(x3.shape[1]), np.empty(x3.shape[1])
    args = (dy3, x3, mean, inv_std, weight.astype(np.float64), dx, db, dw)
    nbytes = x.nbytes if x.nbytes >= b.tuning.batchnorm_split_bytes else 0
    kernels = normalization.batchnorm_backward, normalization.batchnorm_backward_chunks
    b.split_compiled(*kernels, x3.shape[1], args, nbytes)
    return dx.reshape(dy.shape), db, dw


def layernorm_forward(b, x, weight, bias, eps):
    """backends/base.py's layernorm_forward, compiled: each row's statistics and both passes over it while it
    is in cache, rows split over the threads (each row one thread's: the thread count changes nothing)."""
    from pydtnn.backends.cpu.kernels import normalization

    x = np.ascontiguousarray(x)
    y, xhat = np.empty_like(x), np.empty_like(x)
    inv_std = np.empty(x.shape[:-1] + (1,), x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    args = (rows, weight.astype(x.dtype), bias.astype(x.dtype), float(eps), y.reshape(rows.shape),
            xhat.reshape(rows.shape), inv_std.reshape(-1))
    b.split_compiled(normalization.layernorm_forward, normalization.layernorm_forward_chunks, rows.shape[0], args,
                     3 * x.nbytes)
    return y, xhat, inv_std


def layernorm_backward(b, dy, xhat, inv_std, weight, dweight, dbias):
    """backends/base.py's layernorm_backward: dweight and dbias summed by NumPy, dx by a compiled pass per row."""
    from pydtnn.backends.cpu.kernels import normalization

    dy = np.ascontiguousarray(dy)
    lead = tuple(range(dy.ndim - 1))
    dy.sum(axis=lead, out=dbias)
    (dy * xhat).sum(axis=lead, out=dweight)
    dx = np.empty_like(dy)
    d = dy.shape[-1]
    args = (dy.reshape(-1, d), xhat.reshape(-1, d), inv_std.reshape(-1), weight.astype(dy.dtype), dx.reshape(-1, d))
    b.split_compiled(normalization.layernorm_backward, normalization.layernorm_backward_chunks, dy.size // d, args,
                     3 * dy.nbytes)
    return dx
