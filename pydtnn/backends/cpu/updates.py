"""SGD and Adam updates of large parameters in one compiled pass (kernels/updates.py), split over the
threads. Each does the operations of Backend.sgd_update / adam_update (backends/base.py) in their order,
so both give the same bits; parameters under tuning.update_compiled_min_bytes stay in cache through the
NumPy passes, and a model of only small parameters never loads Numba."""

import numpy as np


def compiled(b, p):
    """Whether p takes the compiled update."""
    return (
        b.kernels == "numba"
        and type(p) is np.ndarray
        and p.dtype in (np.float32, np.float64)
        and p.nbytes >= b.tuning.update_compiled_min_bytes
        and p.flags.c_contiguous
    )


def sgd(b, p, g, buf, lr, weight_decay, momentum, dampening, nesterov, first):
    from pydtnn.backends.cpu.kernels import updates

    t = p.dtype.type
    pf = p.reshape(-1)
    buf = buf.reshape(-1) if momentum else pf  # untouched without momentum
    args = (pf, np.ascontiguousarray(g).reshape(-1), buf, t(lr), t(weight_decay), t(momentum), t(1 - dampening),
            nesterov, first)
    b.split_compiled(updates.sgd_update, updates.sgd_update_chunks, p.size, args, p.nbytes * (5 if momentum else 3))


def adam(b, p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step):
    from pydtnn.backends.cpu.kernels import updates

    t = p.dtype.type
    args = (p.reshape(-1), np.ascontiguousarray(g).reshape(-1), m.reshape(-1), v.reshape(-1),
            t(lr / (1 - beta1**step)), t(1 - beta1), t(beta2), t(1 - beta2), t((1 - beta2**step) ** 0.5), t(eps),
            t(weight_decay), t(1 - lr * weight_decay), decoupled)
    b.split_compiled(updates.adam_update, updates.adam_update_chunks, p.size, args, p.nbytes * 7)
