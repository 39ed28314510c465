"""CPUBackend: the Backend contract (backends/base.py) on NumPy, with compiled Numba kernels where they win.

Every method here picks an implementation and hands it this backend, a Workspace (workspace.py) carrying
what they share: `kernels` ('numba' or 'numpy'), `tuning` (tuning.py), the scratch `pool` (scratch.py)
and the thread split (`split`, `split_compiled`; threads.py). The algorithms live one family per file:
a convolution is computed by its plan's entry of conv_algorithms.py (conv_plan.py chooses it);
pooling.py, normalization.py, elementwise.py, updates.py; kernels/ holds the compiled kernels.
"""

import importlib.util
from dataclasses import astuple

import numpy as np

from pydtnn import env
from pydtnn.backends.base import Backend
from pydtnn.backends.cpu import autotune as autotune_module
from pydtnn.backends.cpu import conv_plan, elementwise, normalization, pooling, threads, updates
from pydtnn.backends.cpu import tuning as tuning_module
from pydtnn.backends.cpu.conv_algorithms import BY_NAME
from pydtnn.backends.cpu.workspace import Workspace
from pydtnn.backends.geometry import ConvGeometry

KERNELS = ("auto", "numba", "numpy")


def numba_installed():
    return importlib.util.find_spec("numba") is not None


def resolve_kernels(kernels=None):
    """'numba' or 'numpy': the kernels asked for (default: $PYDTNN_CPU_KERNELS, else 'auto', which is
    'numba' when Numba is installed). Finding Numba does not import it: the first compiled kernel a
    layer uses does."""
    choice = kernels if kernels is not None else env.cpu_kernels()
    if choice not in KERNELS:
        raise ValueError(f"CPU kernels must be one of {', '.join(KERNELS)}, got {choice!r}")
    if choice == "numba" and not numba_installed():
        raise ValueError("CPU kernels 'numba' asked for, but numba is not installed; pip install numba, or use 'numpy'")
    if choice == "auto":
        return "numba" if numba_installed() else "numpy"
    return choice


class CPUBackend(Backend, Workspace):
    """NumPy backend. One per model, passed down explicitly to every layer.

    dtype: default floating dtype of parameters and activations (float32 or float64).
    seed: seeds the Generator used for initialization and dropout masks.
    kernels: 'auto' (default: $PYDTNN_CPU_KERNELS, else Numba's compiled kernels when numba is
    installed), 'numba' or 'numpy' (the pure-NumPy path, the reference and fallback).
    tuning: a Tuning (tuning.py); default tuning.DEFAULT.
    autotune: False (default: each convolution's algorithm by conv_plan.choose's thresholds), True
    (measured on this machine and cached: autotune.py), or an autotune.Tuner (its own cache file).
    Shapes not in the cache are timed together by tune_convolutions(), which the command line calls
    before training, or else the first convolution forward calls.

    Making one changes nothing outside it: thread count, BLAS threads and malloc are process-wide
    settings of pydtnn.runtime.configure, which the trainer and the command line call.
    """

    name = "cpu"

    def __init__(self, dtype=np.float32, seed=0, kernels=None, tuning=None, autotune=False):
        super().__init__(np, dtype, seed)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        Workspace.__init__(self, resolve_kernels(kernels), tuning if tuning is not None else tuning_module.DEFAULT)
        self.tuner = autotune_module.Tuner() if autotune is True else autotune or None
        self._plans = {}  # (geometry, co) -> the ConvPlan handed to its layers (autotune)
        self._measured = {}  # id of a plan handed out -> the measured one, where they differ (two shapes
        # with one geometry and different output channels are handed equal plans, so equality cannot key it)
        self._tuned_at = None  # the thread count of the last tune_convolutions; None: shapes wait for one

    def __repr__(self):
        tuned = ", autotune" if self.tuner is not None else ""
        return f"CPUBackend(dtype={self.dtype.name}, seed={self.seed}, kernels={self.kernels}{tuned})"

    # -- dense -----------------------------------------------------------------------------------
    def matmul(self, a, b, out=None):
        """a (M, K) @ b (K, N), into out when given; split over the columns of the product, so each
        thread reads only its own columns of b (Dense's weight, the large operand each way)."""
        if out is None:
            out = np.empty((a.shape[0], b.shape[1]), np.result_type(a, b))

        def columns(lo, hi):
            np.matmul(a, b[:, lo:hi], out=out[:, lo:hi])

        self.split(b.shape[1], columns, self.gemm_bytes(2 * a.shape[0] * a.shape[1] * b.shape[1], a, b, out))
        return out

    def batched_matmul(self, a, b, out=None):
        """a (B, ..., M, K) @ b (B, ..., K, N) into out when given; split over the leading axis B (the
        batch's samples), each thread's NumPy matmul a BLAS call per product of its samples. Operands whose
        leading axes differ (broadcast) are NumPy's, unsplit."""
        if a.shape[:-2] != b.shape[:-2]:
            return super().batched_matmul(a, b, out)
        if out is None:
            out = np.empty(a.shape[:-1] + (b.shape[-1],), np.result_type(a, b))

        def samples(lo, hi):
            np.matmul(a[lo:hi], b[lo:hi], out=out[lo:hi])

        flops = 2 * out.size * a.shape[-1]
        self.split(out.shape[0], samples, self.gemm_bytes(flops, a, b, out))
        return out

    # -- convolution -------------------------------------------------------------------------------
    def conv2d_plan(self, g, weight_shape):
        """The algorithm for this layer: conv_plan.choose's, or with autotune the cached measured one (a
        shape not in the cache is handed choose's, which runs as the measured one once
        tune_convolutions has timed it: see plan_in_use)."""
        co = weight_shape[0]
        if self.tuner is None:
            return conv_plan.choose(g, co, self.kernels, self.tuning)
        plan = self._plans.get((g, co))
        if plan is None:
            algorithm = self.tuner.cached(g, co, self.dtype, self.kernels, self.tuning)
            if algorithm is None:
                plan = conv_plan.choose(g, co, self.kernels, self.tuning)
                self._tuned_at = None
            else:
                plan = conv_plan.plan_for(g, algorithm)
            self._plans[(g, co)] = plan
        return plan

    def tune_convolutions(self, comm=None, say=None, shapes=None):
        """Measure the algorithm of every convolution shape planned so far that the cache does not hold
        (autotune only; nothing else to do otherwise). With a communicator, every rank ends with rank
        0's choices: the ranks' shapes are gathered, rank 0 times those not cached and writes the
        cache, and broadcasts every choice. say: rank 0's one-line notice before timing. shapes: the
        (geometry, output channels) still in use, when some planned ones are not (a model rebuilt
        by model parallelism); the others keep their threshold plans, untimed."""
        if self.tuner is None:
            return
        shapes = sorted(self._plans if shapes is None else set(shapes) & set(self._plans), key=repr)
        several = comm is not None and comm.size > 1
        if several:  # the collectives carry JSON: a shape travels as its 15 integers
            gathered = comm.allgather_obj([[*astuple(g), co] for g, co in shapes])
            shapes = sorted({(ConvGeometry(*v[:-1]), v[-1]) for rank in gathered for v in rank}, key=repr)
        choices = None
        if not several or comm.rank == 0:
            choices = self.tuner.choose(shapes, self.dtype, self.kernels, self.tuning, say)
        if several:
            sent = comm.bcast_obj(None if choices is None else [[*astuple(g), co, a] for (g, co), a in choices.items()])
            choices = {(ConvGeometry(*v[:-2]), v[-2]): v[-1] for v in sent}
            self.tuner.choices().update(  # later plans on this rank follow rank 0 too
                {self.tuner.key(g, co, self.dtype, self.kernels): a
                 for (g, co), a in choices.items()})
        for (g, co), plan in self._plans.items():
            if (g, co) in choices:
                self._measured.pop(id(plan), None)
                if choices[(g, co)] != plan.algorithm:
                    self._measured[id(plan)] = conv_plan.plan_for(g, choices[(g, co)])
        self._tuned_at = threads.threads()

    def plan_in_use(self, plan):
        """The plan a layer's `plan` (from conv2d_plan) computes with: itself, or the measured one."""
        return self._measured.get(id(plan), plan) if self._measured else plan

    def _plan(self, plan, w):
        if isinstance(plan, ConvGeometry):
            plan = self.conv2d_plan(plan, w.shape)
        if self.tuner is not None and self._tuned_at != threads.threads():
            self.tune_convolutions()  # new shapes, or other threads, and nobody tuned before this forward
        return self.plan_in_use(plan)

    def conv2d_forward(self, x, w, plan, keep=True):
        """y = conv(x, w): x (N, C, H, W), w (Co, C/groups, kh, kw) -> y (N, Co, Ho, Wo). Returns (y, ctx);
        ctx holds what backward needs (the im2col matrix, or x) when keep is true. plan: from
        conv2d_plan (a ConvGeometry is planned on the spot)."""
        plan = self._plan(plan, w)
        x = np.asarray(x, dtype=w.dtype)  # the layer's dtype: no silent upcast, and the kernels assume one dtype
        return BY_NAME[plan.algorithm].forward(self, x, w, plan.run, keep)

    def conv2d_backward(self, dy, w, ctx, plan, need_dx=True):
        """(dx or None, dw) for upstream dy (N, Co, Ho, Wo)."""
        if ctx is None or ctx.array is None:
            raise RuntimeError(
                "conv2d_backward: no saved forward state; run forward(x, training=True) before each backward"
            )
        plan = self._plan(plan, w)
        dy = np.asarray(dy, dtype=w.dtype)
        return BY_NAME[plan.algorithm].backward(self, dy, w, ctx, plan.run, need_dx)

    def bias_forward(self, y, b):
        elementwise.bias_forward(self, y, b)

    def bias_backward(self, dy, out):
        elementwise.bias_backward(self, dy, out)

    # -- pooling ---------------------------------------------------------------------------------
    def maxpool2d_forward(self, x, g, keep=True):
        return pooling.maxpool_forward(self, x, g, keep)

    def maxpool2d_backward(self, dy, ctx, g):
        return pooling.maxpool_backward(self, dy, ctx, g)

    def avgpool2d_forward(self, x, g, keep=True):
        return pooling.avgpool_forward(self, x, g, keep)

    def avgpool2d_backward(self, dy, ctx, g):
        return pooling.avgpool_backward(self, dy, g)

    # -- ReLU ------------------------------------------------------------------------------------
    def relu_forward(self, x, cap=None):
        return elementwise.relu_forward(self, x, cap)

    def relu_backward(self, dy, y, cap=None):
        return elementwise.relu_backward(self, dy, y, cap)

    # -- GELU and softmax -------------------------------------------------------------------------
    def gelu_forward(self, x, approximate="none"):
        return elementwise.gelu_forward(self, x, approximate)

    def gelu_backward(self, dy, x, approximate="none"):
        return elementwise.gelu_backward(self, dy, x, approximate)

    def softmax_forward(self, x, scale=1.0, causal=False):
        return elementwise.softmax_forward(self, x, scale, causal)

    def softmax_backward(self, dy, y, scale=1.0):
        return elementwise.softmax_backward(self, dy, y, scale)

    # -- batch normalization -------------------------------------------------------------------
    def channel_sums(self, a):
        return normalization.sums(self, a)

    def channel_centered_dot(self, a, x, mean):
        return normalization.centered_dot(self, a, x, mean)

    def channel_affine(self, x, a, b=None):
        return normalization.affine(self, x, a, b)

    def channel_affine_dx(self, dy, x, k1, k2, k0):
        return normalization.affine_dx(self, dy, x, k1, k2, k0)

    def batchnorm_forward(self, x, weight, bias, eps):
        if self.kernels == "numba":
            return normalization.compiled_forward(self, x, weight, bias, eps)
        return super().batchnorm_forward(x, weight, bias, eps)

    def batchnorm_backward(self, dy, x, mean, inv_std, weight):
        if self.kernels == "numba":
            return normalization.compiled_backward(self, dy, x, mean, inv_std, weight)
        return super().batchnorm_backward(dy, x, mean, inv_std, weight)

    def layernorm_forward(self, x, weight, bias, eps):
        if self.kernels == "numba":
            return normalization.layernorm_forward(self, x, weight, bias, eps)
        return super().layernorm_forward(x, weight, bias, eps)

    def layernorm_backward(self, dy, xhat, inv_std, weight, dweight, dbias):
        if self.kernels == "numba":
            return normalization.layernorm_backward(self, dy, xhat, inv_std, weight, dweight, dbias)
        return super().layernorm_backward(dy, xhat, inv_std, weight, dweight, dbias)

    # -- optimizer updates ---------------------------------------------------------------------
    def sgd_update(self, p, g, buf, tmp, lr, weight_decay, momentum, dampening, nesterov, first):
        if updates.compiled(self, p):
            return updates.sgd(self, p, g, buf, lr, weight_decay, momentum, dampening, nesterov, first)
        return super().sgd_update(p, g, buf, tmp, lr, weight_decay, momentum, dampening, nesterov, first)

    def adam_update(self, p, g, m, v, tmp, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        if updates.compiled(self, p):
            return updates.adam(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step)
        return super().adam_update(p, g, m, v, tmp, lr, beta1, beta2, eps, weight_decay, decoupled, step)
