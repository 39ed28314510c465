"""SGD and Adam updates: one pass over a parameter, its gradient and its slots."""

import numba
import numpy as np

from pydtnn.backends.cpu.kernels.jit import exact as _exact
from pydtnn.backends.cpu.kernels.jit import parallel as _pjit


@_exact
def sgd_update(p, g, buf, lr, wd, momentum, keep, nesterov, first, lo, hi):
    """One SGD step (optim/sgd.py) over the flat elements lo..hi-1 of p, g and buf: the NumPy path's
    operations in its order, each rounded to the dtype (no fastmath: no fused multiply-adds), so
    the bits are the same. momentum 0: buf is not touched; keep = 1 - dampening."""
    pr, gr, br = p[lo:hi], g[lo:hi], buf[lo:hi]
    for i in range(pr.shape[0]):  # from 0: no negative-index wraparound to stop the vectorizer
        d = gr[i]
        if wd != 0:
            d = pr[i] * wd + d
        if momentum != 0:
            if first:
                b = d
            elif keep == 1:
                b = br[i] * momentum + d
            else:
                b = br[i] * momentum + d * keep
            br[i] = b
            d = b * momentum + d if nesterov else b
        pr[i] = pr[i] - d * lr


@_pjit
def sgd_update_chunks(n, t, p, g, buf, lr, wd, momentum, keep, nesterov, first):
    for i in numba.prange(t):
        sgd_update(p, g, buf, lr, wd, momentum, keep, nesterov, first, n * i // t, n * (i + 1) // t)


@_exact
def adam_update(p, g, m, v, lr_t, keep1, beta2, keep2, bc2_sqrt, eps, wd, decay, decoupled, lo, hi):
    """One Adam / AdamW step (optim/adam.py) over the flat elements lo..hi-1, the NumPy path's
    operations in its order, each rounded to the dtype: the same bits. keep1 = 1 - beta1, keep2 =
    1 - beta2, lr_t = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * wd."""
    pr, gr, mr, vr = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
    for i in range(pr.shape[0]):
        q = pr[i]
        d = gr[i]
        if wd != 0 and decoupled:
            q = q * decay
        elif wd != 0:
            d = q * wd + d
        a = mr[i] + (d - mr[i]) * keep1
        b = vr[i] * beta2 + (d * d) * keep2
        mr[i] = a
        vr[i] = b
        pr[i] = q - a / (np.sqrt(b) / bc2_sqrt + eps) * lr_t


@_pjit
def adam_update_chunks(n, t, p, g, m, v, lr_t, keep1, beta2, keep2, bc2_sqrt, eps, wd, decay, decoupled):
    for i in numba.prange(t):
        adam_update(p, g, m, v, lr_t, keep1, beta2, keep2, bc2_sqrt, eps, wd, decay, decoupled,
                    n * i // t, n * (i + 1) // t)
