"""CPU backend: NumPy arrays, a seeded Generator, and the kernels that differ per device.

Layers hold their logic once and call the backend for the few operations a GPU backend does
differently (convolution and pooling through cuDNN there, im2col + GEMM here). Everything else in
a layer is written against `backend.xp`, which is `numpy` here and `cupy` on a GPU.

All tensors are NCHW. Convolution geometry is described by `ConvGeometry`, built once per layer.
"""

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes of one 2-D convolution or pooling window, fixed at build time.

    c, h, w: input channels and size; kh, kw: kernel; sh, sw: stride; dh, dw: dilation;
    pt, pb, pl, pr: zero padding top/bottom/left/right; ho, wo: output size; groups.
    """

    c: int
    h: int
    w: int
    kh: int
    kw: int
    sh: int = 1
    sw: int = 1
    dh: int = 1
    dw: int = 1
    pt: int = 0
    pb: int = 0
    pl: int = 0
    pr: int = 0
    groups: int = 1

    @property
    def ho(self):
        return (self.h + self.pt + self.pb - self.dh * (self.kh - 1) - 1) // self.sh + 1

    @property
    def wo(self):
        return (self.w + self.pl + self.pr - self.dw * (self.kw - 1) - 1) // self.sw + 1

    @property
    def padded(self):
        return self.pt or self.pb or self.pl or self.pr


class CPUBackend:
    """NumPy backend. One per model, passed down explicitly to every layer.

    dtype: default floating dtype of parameters and activations.
    seed: seeds the Generator used for initialization and dropout masks.
    """

    name = "cpu"
    xp = np

    def __init__(self, dtype=np.float32, seed=0):
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def __repr__(self):
        return f"CPUBackend(dtype={self.dtype.name}, seed={self.seed})"

    def reseed(self, key):
        """Restart the Generator from a key (a list of ints): the trainer keys dropout per step."""
        self.rng = np.random.default_rng(key)

    # -- host <-> device -------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Array on this device (no copy when it already is one of the right dtype)."""
        return np.asarray(a, dtype=dtype)

    def to_numpy(self, a):
        return np.asarray(a)

    # -- windows ---------------------------------------------------------------------------
    def _pad(self, x, g, value=0.0):
        if not g.padded:
            return x
        return np.pad(x, ((0, 0), (0, 0), (g.pt, g.pb), (g.pl, g.pr)), constant_values=value)

    @staticmethod
    def _windows(xp_, g):
        """Strided view (N, C, kh, kw, Ho, Wo) of a padded input: no copy."""
        n, c, _, _ = xp_.shape
        s_n, s_c, s_h, s_w = xp_.strides
        return as_strided(
            xp_,
            shape=(n, c, g.kh, g.kw, g.ho, g.wo),
            strides=(s_n, s_c, g.dh * s_h, g.dw * s_w, g.sh * s_h, g.sw * s_w),
            writeable=False,
        )

    def _scatter_windows(self, dcols, g, n):
        """Adjoint of _windows: sum (N, C, kh, kw, Ho, Wo) window values back into (N, C, H, W)."""
        hp, wp = g.h + g.pt + g.pb, g.w + g.pl + g.pr
        dx = np.zeros((n, g.c, hp, wp), dtype=dcols.dtype)
        for i in range(g.kh):
            for j in range(g.kw):
                r0, c0 = i * g.dh, j * g.dw
                dx[:, :, r0 : r0 + g.sh * (g.ho - 1) + 1 : g.sh, c0 : c0 + g.sw * (g.wo - 1) + 1 : g.sw] += dcols[
                    :, :, i, j
                ]
        return dx[:, :, g.pt : g.pt + g.h, g.pl : g.pl + g.w] if g.padded else dx

    # -- convolution -----------------------------------------------------------------------
    def conv2d_forward(self, x, w, g, keep=True):
        """y = conv(x, w): x (N, C, H, W), w (Co, C/groups, kh, kw) -> y (N, Co, Ho, Wo).

        Returns (y, ctx); ctx holds what backward needs (the im2col matrix) when keep is true.
        """
        n = x.shape[0]
        G, co = g.groups, w.shape[0]
        cg = g.c // G
        win = self._windows(self._pad(x, g), g)  # (N, C, kh, kw, Ho, Wo)
        # cols: (G, Cg*kh*kw, N*Ho*Wo), one contiguous copy
        cols = win.reshape(n, G, cg, g.kh, g.kw, g.ho, g.wo).transpose(1, 2, 3, 4, 0, 5, 6)
        cols = np.ascontiguousarray(cols).reshape(G, cg * g.kh * g.kw, n * g.ho * g.wo)
        wm = w.reshape(G, co // G, cg * g.kh * g.kw)
        y = np.matmul(wm, cols)  # (G, Co/G, N*Ho*Wo)
        y = y.reshape(co, n, g.ho, g.wo).transpose(1, 0, 2, 3)
        return np.ascontiguousarray(y), (cols if keep else None)

    def conv2d_backward(self, dy, w, ctx, g, need_dx=True):
        """Gradients of conv2d_forward: returns (dx or None, dw) for upstream dy (N, Co, Ho, Wo)."""
        cols = ctx
        n, co = dy.shape[0], dy.shape[1]
        G = g.groups
        cg = g.c // G
        dym = np.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(G, co // G, n * g.ho * g.wo)
        dw = np.matmul(dym, cols.transpose(0, 2, 1)).reshape(w.shape)
        if not need_dx:
            return None, dw
        wm = w.reshape(G, co // G, cg * g.kh * g.kw)
        dcols = np.matmul(wm.transpose(0, 2, 1), dym)  # (G, Cg*kh*kw, N*Ho*Wo)
        dcols = dcols.reshape(g.c, g.kh, g.kw, n, g.ho, g.wo).transpose(3, 0, 1, 2, 4, 5)
        return self._scatter_windows(dcols, g, n), dw

    # -- pooling ---------------------------------------------------------------------------
    def maxpool2d_forward(self, x, g, keep=True):
        """Max over windows; padding counts as -inf (PyTorch semantics). Returns (y, argmax ctx)."""
        win = self._windows(self._pad(x, g, value=-np.inf), g)
        n = x.shape[0]
        flat = win.transpose(0, 1, 4, 5, 2, 3).reshape(n, g.c, g.ho, g.wo, g.kh * g.kw)
        idx = flat.argmax(axis=-1)
        y = np.take_along_axis(flat, idx[..., None], axis=-1)[..., 0]
        return y, (idx if keep else None)

    def maxpool2d_backward(self, dy, ctx, g):
        idx = ctx
        n = dy.shape[0]
        k = np.arange(g.kh * g.kw).reshape(g.kh, g.kw, 1, 1, 1, 1)
        # (kh, kw, N, C, Ho, Wo) -> (N, C, kh, kw, Ho, Wo): dy where that window position won
        dcols = np.where(idx[None, None] == k, dy[None, None], 0).astype(dy.dtype, copy=False)
        return self._scatter_windows(dcols.transpose(2, 3, 0, 1, 4, 5), g, n)

    def avgpool2d_forward(self, x, g, keep=True):
        """Mean over windows; zero padding is counted in the divisor (PyTorch's default)."""
        win = self._windows(self._pad(x, g), g)
        return win.mean(axis=(2, 3)), None

    def avgpool2d_backward(self, dy, ctx, g):
        n = dy.shape[0]
        share = dy / (g.kh * g.kw)
        dcols = np.broadcast_to(share[:, :, None, None], (n, g.c, g.kh, g.kw, g.ho, g.wo))
        return self._scatter_windows(dcols, g, n)
