"""Max and average pooling on the CPU: one NumPy pass per kernel position over strided views of the
unpadded input, split over samples. With the compiled kernels (kernels/pooling.py), 2x2 windows at
stride 2 without padding (VGG's) take one compiled pass each way, and max pooling over any other
windows (Inception's 3x3 at stride 1, ResNet's 3x3 at stride 2 with padding) one generic compiled pass
each way, all with the NumPy path's results bit for bit."""

import numpy as np

from pydtnn.backends.geometry import positions, window_layout
from pydtnn.errors import ShapeError


def compiled_2x2(b, g):
    """Whether pooling runs the compiled 2x2 stride-2 kernels (no padding, floor mode)."""
    return b.kernels == "numba" and (g.kh, g.kw, g.sh, g.sw, g.dh, g.dw) == (2, 2, 2, 2, 1, 1) and not g.padded


def _window_args(g):
    return g.kh, g.kw, g.sh, g.sw, g.dh, g.dw, g.pt, g.pl


def _check(what, a, want):
    """The compiled kernels index without bounds checks: an array of another shape than the layer's
    geometry is refused here (the NumPy path refuses it when it broadcasts)."""
    if tuple(a.shape[1:]) != want:
        raise ShapeError(f"max pooling: {what} of shape {tuple(a.shape)}; this layer takes "
                         f"(N, {', '.join(map(str, want))})")


def maxpool_forward(b, x, g, keep):
    """(y, ctx): ctx is the index k = i*kw + j of the first maximum in each window (ties go to the
    first, as in PyTorch); padding counts as -inf."""
    n = x.shape[0]
    y = np.empty((n, g.c, g.ho, g.wo), x.dtype)
    index = np.uint8 if g.kh * g.kw <= 256 else np.int32
    if b.kernels == "numba":
        from pydtnn.backends.cpu.kernels import pooling

        _check("x", x, (g.c, g.h, g.w))
        idx = np.empty(y.shape if keep else (0, 0, 0, 0), index)
        if compiled_2x2(b, g):
            args = (np.ascontiguousarray(x), y, idx, keep)
            b.split_compiled(pooling.maxpool2x2_forward, pooling.maxpool2x2_forward_chunks, n, args, x.nbytes)
        else:
            args = (np.ascontiguousarray(x), y, idx, keep, *_window_args(g))
            kernels = pooling.maxpool_forward, pooling.maxpool_forward_chunks
            b.split_compiled(*kernels, n, args, x.nbytes * g.kh * g.kw)
        return y, (idx if keep else None)
    pos = positions(g)
    idx = np.zeros(y.shape, index) if keep else None
    won = np.empty(y.shape, idx.dtype) if keep else None
    full = pos[0][0] == 0 and pos[0][3] == slice(0, g.ho) and pos[0][4] == slice(0, g.wo)

    def part(lo, hi):
        if full:
            y[lo:hi] = x[lo:hi, :, pos[0][5], pos[0][6]]
        else:
            y[lo:hi] = -np.inf
        for k, _, _, orows, ocols, irows, icols in pos[1:] if full else pos:
            yv, v = y[lo:hi, :, orows, ocols], x[lo:hi, :, irows, icols]
            if keep:
                # positions come in increasing k, so the running index is the max of k over the wins
                wv = won[lo:hi, :, orows, ocols]
                np.multiply(np.greater(v, yv), idx.dtype.type(k), out=wv)
                iv = idx[lo:hi, :, orows, ocols]
                np.maximum(iv, wv, out=iv)
            np.maximum(yv, v, out=yv)

    b.split(n, part, x.nbytes)
    return y, idx


def maxpool_backward(b, dy, idx, g):
    """dx: each window's dy added at its first maximum, exactly +0.0 where no window's maximum lies
    (PyTorch's scatter: a NaN or infinite dy reaches the maximum's input only)."""
    n = dy.shape[0]
    disjoint, _ = window_layout(g)
    if b.kernels == "numba":
        from pydtnn.backends.cpu.kernels import pooling

        _check("dy", dy, (g.c, g.ho, g.wo))
        if idx.shape != dy.shape:
            raise ShapeError(f"max pooling: dy of shape {tuple(dy.shape)} for the argmax of a forward of "
                             f"{tuple(idx.shape)}")
        dx = np.empty((n, g.c, g.h, g.w), dy.dtype)
        if compiled_2x2(b, g):
            bits = np.dtype(f"i{dy.itemsize}")  # the kernel moves float bits through an integer mask
            args = (np.ascontiguousarray(dy).view(bits), idx, dx.view(bits))
            kernels = pooling.maxpool2x2_backward, pooling.maxpool2x2_backward_chunks
        else:
            args = (np.ascontiguousarray(dy), np.ascontiguousarray(idx), dx, *_window_args(g)[1:], disjoint)
            kernels = pooling.maxpool_backward, pooling.maxpool_backward_chunks
        b.split_compiled(*kernels, n, args, 2 * dx.nbytes)
        return dx
    dx = np.zeros((n, g.c, g.h, g.w), dy.dtype)
    pos = positions(g)

    def part(lo, hi):
        for k, _, _, orows, ocols, irows, icols in pos:
            won = idx[lo:hi, :, orows, ocols] == k
            dxv, dyv = dx[lo:hi, :, irows, icols], dy[lo:hi, :, orows, ocols]
            if disjoint:
                np.copyto(dxv, dyv, where=won)
            else:
                np.add(dxv, dyv, out=dxv, where=won)

    b.split(n, part, dx.nbytes)
    return dx


def avgpool_forward(b, x, g, keep):
    """(y, None): the mean over windows, zero padding counted in the divisor (PyTorch's default)."""
    y = np.empty((x.shape[0], g.c, g.ho, g.wo), x.dtype)
    if compiled_2x2(b, g):
        from pydtnn.backends.cpu.kernels import pooling

        args = (np.ascontiguousarray(x), y)
        b.split_compiled(pooling.avgpool2x2_forward, pooling.avgpool2x2_forward_chunks, x.shape[0], args, x.nbytes)
        return y, None
    pos = positions(g)
    full = pos[0][0] == 0 and pos[0][3] == slice(0, g.ho) and pos[0][4] == slice(0, g.wo)

    def part(lo, hi):
        if full:
            y[lo:hi] = x[lo:hi, :, pos[0][5], pos[0][6]]
        else:
            y[lo:hi] = 0
        for _, _, _, orows, ocols, irows, icols in pos[1:] if full else pos:
            yv = y[lo:hi, :, orows, ocols]
            yv += x[lo:hi, :, irows, icols]
        y[lo:hi] /= g.kh * g.kw

    b.split(x.shape[0], part, x.nbytes)
    return y, None


def avgpool_backward(b, dy, g):
    if compiled_2x2(b, g):
        from pydtnn.backends.cpu.kernels import pooling

        dx = np.empty((dy.shape[0], g.c, g.h, g.w), dy.dtype)
        args = (np.ascontiguousarray(dy), dx)
        kernels = pooling.avgpool2x2_backward, pooling.avgpool2x2_backward_chunks
        b.split_compiled(*kernels, dy.shape[0], args, dx.nbytes)
        return dx
    disjoint, covering = window_layout(g)
    share = dy / (g.kh * g.kw)
    dx = (np.empty if covering else np.zeros)((dy.shape[0], g.c, g.h, g.w), dy.dtype)
    pos = positions(g)

    def part(lo, hi):
        for _, _, _, orows, ocols, irows, icols in pos:
            dxv = dx[lo:hi, :, irows, icols]
            if disjoint:
                dxv[...] = share[lo:hi, :, orows, ocols]
            else:
                dxv += share[lo:hi, :, orows, ocols]

    b.split(dy.shape[0], part, dx.nbytes)
    return dx
