"""Checks for layers, losses and models: float64 finite differences and a PyTorch oracle.

    layer = Conv2D(4, 3, stride=2)
    check_gradients(layer, (2, 3, 9, 9))                     # builds in float64 if not built
    check_against_torch(layer, (2, 3, 9, 9), lambda x, p: F.conv2d(x, p["weight"], p["bias"], 2))

Both feed random inputs and a random upstream gradient r, i.e. they check the gradient of the
scalar L = sum(layer(x) * r). Stochastic layers (Dropout) see the same random draws in every
evaluation: the backend's Generator state is restored before each forward.
"""

import copy

import numpy as np

from pydtnn.backends import CPUBackend


def numerical_gradient(f, x, eps=1e-6, max_entries=None, rng=None):
    """Central differences of scalar f() w.r.t. array x (perturbed in place and restored).

    Returns (indices, values): flat indices checked and df/dx there. max_entries samples a random
    subset for large arrays.
    """
    flat = x.reshape(-1)
    idx = np.arange(flat.size)
    if max_entries is not None and flat.size > max_entries:
        idx = np.sort((rng or np.random.default_rng(0)).choice(flat.size, max_entries, replace=False))
    out = np.empty(idx.size)
    for n, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        out[n] = (fp - fm) / (2 * eps)
    return idx, out


def _built(layer, x_shape, dtype, backend=None):
    if layer.input_shape is None:
        layer.build(x_shape[1:], dtype, backend or CPUBackend(dtype, seed=0))
    return layer


def _assert_close(name, got, want, rtol, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape}, expected {want.shape}")
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    if bad.any():
        i = tuple(int(k) for k in np.unravel_index(np.argmax(err - rtol * np.abs(want)), err.shape))
        raise AssertionError(  # plain Python numbers: NumPy 2's repr would print np.float64(...)
            f"{name}: {int(bad.sum())} of {bad.size} entries differ; worst at {i}: got {float(got[i])!r}, "
            f"expected {float(want[i])!r}, difference {float(err[i]):.3g} (rtol={rtol}, atol={atol})"
        )


def check_gradients(layer, x_shape, training=True, seed=0, eps=1e-6, rtol=1e-6, atol=1e-8, max_entries=60, x=None):
    """Compare a layer's backward with float64 central differences of L = sum(forward(x) * r).

    Checks dL/dx (unless the layer has need_dx=False) and dL/dparam for every parameter, on up to
    `max_entries` randomly chosen entries each. The layer is built in float64 if it is not built.
    """
    layer = _built(layer, x_shape, np.float64)
    if layer.dtype != np.float64:
        raise ValueError(f"check_gradients needs a float64 layer, got {layer.dtype}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape) if x is None else np.array(x, np.float64)
    state = copy.deepcopy(layer.backend.rng.bit_generator.state)

    def forward():
        layer.backend.rng.bit_generator.state = copy.deepcopy(state)
        return layer.forward(x, training=training)

    r = rng.standard_normal((x_shape[0],) + tuple(layer.output_shape))
    forward()
    dx = layer.backward(r.copy())
    analytic = {k: np.array(g) for k, g in _all_grads(layer).items()}
    loss = lambda: float(np.sum(forward() * r))  # noqa: E731
    if layer.need_dx:
        idx, num = numerical_gradient(loss, x, eps, max_entries, rng)
        _assert_close(f"{layer.name} dL/dx", np.asarray(dx).reshape(-1)[idx], num, rtol, atol)
    for name, p in _all_params(layer).items():
        idx, num = numerical_gradient(loss, p, eps, max_entries, rng)
        _assert_close(f"{layer.name} dL/d{name}", analytic[name].reshape(-1)[idx], num, rtol, atol)


def _all_params(layer):
    return {f"{p}.{k}" if p else k: v for p, l in layer.named_layers() for k, v in l.params.items()}


def _all_grads(layer):
    return {f"{p}.{k}" if p else k: v for p, l in layer.named_layers() for k, v in l.grads.items()}


def check_against_torch(layer, x_shape, torch_fn, dtype=np.float64, training=True, seed=0, rtol=None, atol=None):
    """Compare forward, dL/dx and dL/dparams with PyTorch autograd on the same inputs.

    torch_fn(x, params) -> y, where x is a torch tensor and params a dict of torch tensors named like
    the layer's own (nested names for blocks: "0.0.weight"). The layer is built in `dtype` if needed.
    """
    import torch

    layer = _built(layer, x_shape, dtype)
    dtype = layer.dtype
    if rtol is None:
        rtol, atol = (1e-10, 1e-12) if dtype == np.float64 else (2e-4, 2e-5)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(dtype)
    r = rng.standard_normal((x_shape[0],) + tuple(layer.output_shape)).astype(dtype)
    tx = torch.tensor(x, requires_grad=True)
    tparams = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in _all_params(layer).items()}
    ty = torch_fn(tx, tparams)
    (ty * torch.tensor(r)).sum().backward()

    y = layer.forward(x, training=training)
    if y.dtype != dtype:
        raise AssertionError(f"{layer.name}: output dtype {y.dtype}, expected {dtype}")
    dx = layer.backward(r.copy())
    scale = max(1.0, float(np.abs(ty.detach().numpy()).max()))
    _assert_close(f"{layer.name} forward", y, ty.detach().numpy(), rtol, atol * scale)
    if layer.need_dx:
        _assert_close(f"{layer.name} dL/dx", dx, tx.grad.numpy(), rtol, atol * max(1.0, float(tx.grad.abs().max())))
    for name, g in _all_grads(layer).items():
        want = tparams[name].grad.numpy()
        _assert_close(f"{layer.name} dL/d{name}", g, want, rtol, atol * max(1.0, float(np.abs(want).max())))
    return layer
