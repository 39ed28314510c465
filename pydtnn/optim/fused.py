"""One-pass optimizer updates: CuPy elementwise kernels for GPU arrays, and compiled (Numba) SGD and
Adam / AdamW updates for large NumPy parameters.

Each kernel reads the parameter, its gradient and its slots once and writes them once, where the
array-module code of sgd.py and adam.py makes one pass per term. The formulas are those of the
classes' docstrings. On the CPU the compiled update does the NumPy code's operations in its order,
so both give the same bits; it takes float32 and float64 parameters from COMPILED_MIN_BYTES on
(VGG-11's 28 M parameters, SGD with momentum: 45 -> 32 ms a step on one thread, 41 -> 23 on two;
Adam 131 -> 30 and 25), smaller ones stay in cache through the NumPy passes and a model of only
small parameters never loads Numba. Whether the compiled update is used follows
PYDTNN_CPU_KERNELS (the optimizer does not see a backend's kernels= argument; the bits are the
same either way).
"""

import functools

import numpy as np

from pydtnn.backends.threads import split_compiled

COMPILED_MIN_BYTES = 1 << 20


@functools.cache
def _kernels():
    import cupy

    sgd = cupy.ElementwiseKernel(
        "T g, T lr, T wd", "T p", "p = p - lr * (g + wd * p);", "pydtnn_sgd")
    sgd_momentum = cupy.ElementwiseKernel(
        "T g, T lr, T wd, T momentum, T keep, bool nesterov, bool first", "T p, T buf",
        """
        T d = g + wd * p;
        buf = first ? d : momentum * buf + keep * d;
        p = p - lr * (nesterov ? d + momentum * buf : buf);
        """, "pydtnn_sgd_momentum")
    adam = cupy.ElementwiseKernel(
        "T g, T lr_t, T one_m_beta1, T beta2, T one_m_beta2, T eps, T wd, T decay, T bc2_sqrt", "T p, T m, T v",
        """
        p = p * decay;
        T d = g + wd * p;
        m = m + one_m_beta1 * (d - m);
        v = beta2 * v + one_m_beta2 * d * d;
        p = p - lr_t * m / (sqrt(v) / bc2_sqrt + eps);
        """, "pydtnn_adam")
    return sgd, sgd_momentum, adam


def sgd(opt, p, g, state):
    """SGD (optim/sgd.py) in one pass."""
    t = p.dtype.type
    plain, with_momentum, _ = _kernels()
    if not opt.momentum:
        plain(g, t(opt.lr), t(opt.weight_decay), p)
        return
    with_momentum(g, t(opt.lr), t(opt.weight_decay), t(opt.momentum), t(1 - opt.dampening), opt.nesterov,
                  opt.t == 1, p, state["momentum_buffer"])


def adam(opt, p, g, state):
    """Adam and AdamW (optim/adam.py) in one pass."""
    t = p.dtype.type
    decay = 1 - opt.lr * opt.weight_decay if opt.decoupled else 1.0
    wd = 0.0 if opt.decoupled else opt.weight_decay
    # 1 - beta taken in float64 and then rounded, as the CPU code's Python scalars are
    _kernels()[2](g, t(opt.lr / (1 - opt.beta1**opt.t)), t(1 - opt.beta1), t(opt.beta2), t(1 - opt.beta2),
                  t(opt.eps), t(wd), t(decay),
                  t((1 - opt.beta2**opt.t) ** 0.5), p, state["exp_avg"], state["exp_avg_sq"])


def on_gpu(p):
    return type(p).__module__.split(".")[0] == "cupy"


def compiled_cpu(p):
    """Whether the NumPy parameter p takes the compiled update (the CPU kernels are Numba's)."""
    if type(p) is not np.ndarray or p.dtype not in (np.float32, np.float64):
        return False
    if p.nbytes < COMPILED_MIN_BYTES or not p.flags.c_contiguous:
        return False
    from pydtnn.backends.cpu import resolve_kernels

    return resolve_kernels() == "numba"


def sgd_cpu(opt, p, g, state):
    """SGD (optim/sgd.py) in one compiled pass, split over the CPU backend's threads."""
    from pydtnn.backends import compiled

    t = p.dtype.type
    pf = p.reshape(-1)
    buf = state["momentum_buffer"].reshape(-1) if opt.momentum else pf  # untouched without momentum
    args = (pf, np.ascontiguousarray(g).reshape(-1), buf, t(opt.lr), t(opt.weight_decay), t(opt.momentum),
            t(1 - opt.dampening), opt.nesterov, opt.t == 1)
    split_compiled(compiled.sgd_update, compiled.sgd_update_chunks, p.size, args, p.nbytes * (5 if opt.momentum else 3))


def adam_cpu(opt, p, g, state):
    """Adam and AdamW (optim/adam.py) in one compiled pass, split over the CPU backend's threads."""
    from pydtnn.backends import compiled

    t = p.dtype.type
    args = (p.reshape(-1), np.ascontiguousarray(g).reshape(-1), state["exp_avg"].reshape(-1),
            state["exp_avg_sq"].reshape(-1), t(opt.lr / (1 - opt.beta1**opt.t)), t(1 - opt.beta1), t(opt.beta2),
            t(1 - opt.beta2), t((1 - opt.beta2**opt.t) ** 0.5), t(opt.eps), t(opt.weight_decay),
            t(1 - opt.lr * opt.weight_decay), opt.decoupled)
    split_compiled(compiled.adam_update, compiled.adam_update_chunks, p.size, args, p.nbytes * 7)
