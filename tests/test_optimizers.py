"""Every optimizer against torch.optim step by step, state-dict round trips, errors and convergence."""

import contextlib
import json
import tracemalloc

import numpy as np
import pytest
import torch

from pydtnn import optim
from pydtnn.errors import ConfigError
from pydtnn.backends import CPUBackend
from pydtnn.backends.base import Backend
from pydtnn.backends.cpu import Tuning
from pydtnn.backends.cpu import updates as cpu_updates

SHAPES = [(3, 4), (7,), (2, 3, 2, 2)]
STEPS = 10
RTOL = {np.float64: 1e-12, np.float32: 1e-5}

# (name, hyperparameters); together they switch every option on and off.
CASES = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05)),
    ("sgd", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    ("sgd", dict(lr=0.1, weight_decay=0.1)),
    ("rmsprop", dict()),
    ("rmsprop", dict(lr=0.01, momentum=0.9)),
    ("rmsprop", dict(centered=True)),
    ("rmsprop", dict(lr=0.02, rho=0.9, momentum=0.5, weight_decay=0.1, centered=True)),
    ("rmsprop", dict(rho=0.3, eps=1e-3)),
    ("adam", dict()),
    ("adam", dict(lr=0.01, weight_decay=0.1)),
    ("adam", dict(lr=0.01, beta1=0.0, beta2=0.5, eps=1e-3)),
    ("adamw", dict()),
    ("adamw", dict(lr=0.01, beta1=0.8, weight_decay=0.1)),
    ("nadam", dict()),
    ("nadam", dict(lr=0.01, weight_decay=0.1, momentum_decay=0.01)),
    ("nadam", dict(beta1=0.5, beta2=0.9, eps=1e-4)),
]


def torch_optimizer(name, tensors, hyper):
    """The torch.optim counterpart of optim.create(name, ..., **hyper)."""
    h = dict(hyper)
    if name in ("adam", "adamw", "nadam"):
        h["betas"] = (h.pop("beta1", 0.9), h.pop("beta2", 0.999))
    if name == "rmsprop":
        h["alpha"] = h.pop("rho", 0.99)
    defaults = {"sgd": {"lr": 0.01}, "rmsprop": {"lr": 0.01}, "adamw": {"weight_decay": 0.01}}
    cls = {"sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop, "adam": torch.optim.Adam,
           "adamw": torch.optim.AdamW, "nadam": torch.optim.NAdam}[name]
    return cls(tensors, **{**defaults.get(name, {}), **h})


def make_params(dtype, rng, shapes=SHAPES):
    return [(f"{i}.weight", rng.standard_normal(s).astype(dtype), np.zeros(s, dtype)) for i, s in enumerate(shapes)]


@contextlib.contextmanager
def float64_scalars():
    """torch keeps scalar state (NAdam's mu_product, the step count) in the default dtype, created at
    the first step; in float32 it rounds mu_product every step, an error of ~1e-8 relative that
    float64 parameters show. pydtnn keeps it as a Python float, i.e. float64."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def set_lr(opt, t):
    """A schedule: halve the learning rate from step 6 on (same rule for both libraries)."""
    if t == 5:
        if isinstance(opt, torch.optim.Optimizer):
            for group in opt.param_groups:
                group["lr"] *= 0.5
        else:
            opt.lr *= 0.5


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,hyper", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_torch_every_step(name, hyper, dtype, kernels, monkeypatch):
    """With kernels "numba", SGD, Adam and AdamW take their compiled update for every parameter,
    however small."""
    rng = np.random.default_rng(len(CASES) + CASES.index((name, hyper)))
    params = make_params(dtype, rng)
    tensors = [torch.tensor(p.copy(), requires_grad=True) for _, p, _ in params]
    backend = CPUBackend(dtype, tuning=Tuning(update_compiled_min_bytes=0))
    opt = optim.create(name, params, backend=backend, **hyper)
    with float64_scalars():
        ref = torch_optimizer(name, tensors, hyper)
    for t in range(STEPS):
        set_lr(opt, t)
        set_lr(ref, t)
        for (_, _, g), x in zip(params, tensors):
            g[...] = rng.standard_normal(g.shape)
            x.grad = torch.from_numpy(g.copy())
        opt.step()
        with float64_scalars():
            ref.step()
        for (pname, p, _), x in zip(params, tensors):
            assert p.dtype == dtype
            np.testing.assert_allclose(
                p, x.detach().numpy(), rtol=RTOL[dtype], atol=RTOL[dtype], err_msg=f"{pname} after step {t + 1}"
            )


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_updates_give_the_numpy_bits(dtype, threads, monkeypatch):
    """The compiled SGD, Adam and AdamW updates against the one definition of their math (the generic
    Backend's NumPy passes), every option, several steps (the first sets SGD's momentum buffer), a
    learning-rate change, split over threads: the same bits."""
    from pydtnn.backends.cpu import threads as th

    shapes = [(300, 7), (1000,), (3, 5, 3, 3)]
    before = th.threads()
    try:
        th.set_threads(threads)
        for i, (name, hyper) in enumerate(c for c in CASES if c[0] in ("sgd", "adam", "adamw")):
            results = []
            compiled = CPUBackend(dtype, kernels="numba", tuning=Tuning(update_compiled_min_bytes=0, split_min_bytes=0))
            for backend in (Backend(np, dtype), compiled):  # the generic math, then the compiled update
                rng = np.random.default_rng(i)
                params = make_params(dtype, rng, shapes)
                assert cpu_updates.compiled(compiled, params[0][1])
                opt = optim.create(name, params, backend=backend, **hyper)
                for t in range(4):
                    set_lr(opt, t + 3)
                    for _, _, g in params:
                        g[...] = rng.standard_normal(g.shape)
                    opt.step()
                slots = opt.state_dict()["arrays"].values()
                results.append([p.copy() for _, p, _ in params] + [a.copy() for a in slots])
            bits = np.dtype(f"i{np.dtype(dtype).itemsize}")
            for a, b in zip(*results):
                np.testing.assert_array_equal(a.view(bits), b.view(bits), err_msg=f"{name} {hyper}")
    finally:
        th.set_threads(before)


def test_compiled_updates_leave_float16_to_numpy():
    """float16 parameters (no compiled kernel for them) keep the NumPy passes."""
    params = make_params(np.float16, np.random.default_rng(0))
    backend = CPUBackend(kernels="numba", tuning=Tuning(update_compiled_min_bytes=0))
    assert not cpu_updates.compiled(backend, params[0][1])
    for name in ("sgd", "adam"):
        opt = optim.create(name, params, backend=backend, lr=0.1, **({"momentum": 0.9} if name == "sgd" else {}))
        for _, _, g in params:
            g[...] = 1
        before = params[0][1].copy()
        opt.step()
        assert params[0][1].dtype == np.float16 and not np.array_equal(params[0][1], before)


def test_updates_in_place_and_leaves_grads_alone():
    rng = np.random.default_rng(0)
    for name in optim.NAMES:
        params = make_params(np.float32, rng)
        for _, _, g in params:
            g[...] = rng.standard_normal(g.shape)
        before = [(p, p.copy(), g.copy()) for _, p, g in params]
        opt = optim.create(name, params, weight_decay=0.1)
        opt.step()
        for (_, p, g), (same, old_p, old_g) in zip(params, before):
            assert p is same and not np.array_equal(p, old_p), name
            np.testing.assert_array_equal(g, old_g, err_msg=name)
        assert all(a.dtype == np.float32 for a in opt.state_dict()["arrays"].values())


@pytest.mark.parametrize("name,hyper", [
    ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
    ("sgd", dict(momentum=0.9, dampening=0.5)),
    ("rmsprop", dict(momentum=0.9, centered=True, weight_decay=0.1)),
    ("adam", dict(weight_decay=0.1)),
    ("adamw", dict()),
    ("nadam", dict(weight_decay=0.1)),
])
def test_step_allocates_no_arrays(name, hyper):
    params = make_params(np.float64, np.random.default_rng(1), shapes=[(100, 100), (50,)])
    opt = optim.create(name, params, **hyper)
    opt.step()  # the first SGD step copies into the momentum buffer; later ones are the steady state
    opt.step()
    tracemalloc.start()
    try:
        opt.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 100 * 8 // 4, f"{name}: a step allocated {peak} bytes"


@pytest.mark.parametrize("name,hyper", [
    ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
    ("rmsprop", dict(momentum=0.9, centered=True)),
    ("adam", dict(lr=0.01, weight_decay=0.1)),
    ("adamw", dict(lr=0.01)),
    ("nadam", dict(lr=0.01, weight_decay=0.1)),
])
def test_state_dict_round_trip_is_bit_identical(name, hyper):
    rng = np.random.default_rng(2)
    params = make_params(np.float32, rng)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(10)]

    def run(opt, ps, steps):
        for gs in steps:
            for (_, _, g), new in zip(ps, gs):
                g[...] = new
            opt.step()

    opt = optim.create(name, params, **hyper)
    run(opt, params, grads[:5])
    saved = opt.state_dict()
    # What a checkpoint does: arrays to a file, scalars through JSON.
    arrays = {k: np.array(v) for k, v in saved["arrays"].items()}
    scalars = json.loads(json.dumps(saved["scalars"]))
    assert scalars["step"] == 5 and scalars["lr"] == opt.lr

    copies = [(n, p.copy(), g.copy()) for n, p, g in params]
    other = optim.create(name, copies, **{**hyper, "lr": 0.123})  # lr comes back from the state
    other.load_state_dict({"arrays": arrays, "scalars": scalars})
    assert other.lr == opt.lr and other.t == 5
    run(opt, params, grads[5:])
    run(other, copies, grads[5:])
    for (n, p, _), (_, q, _) in zip(params, copies):
        np.testing.assert_array_equal(p, q, err_msg=n)
    for k, v in opt.state_dict()["arrays"].items():
        np.testing.assert_array_equal(v, other.state_dict()["arrays"][k], err_msg=k)
    assert opt.state_dict()["scalars"] == other.state_dict()["scalars"]


def test_load_state_dict_rejects_what_does_not_fit():
    rng = np.random.default_rng(3)
    opt = optim.create("adam", make_params(np.float32, rng))
    good = opt.state_dict()

    bad = {"arrays": {**good["arrays"], "0.weight.exp_avg": np.zeros((4, 3), np.float32)}, "scalars": good["scalars"]}
    with pytest.raises(ConfigError, match=r"'0.weight.exp_avg' has shape \(4, 3\), expected \(3, 4\)"):
        opt.load_state_dict(bad)

    renamed = {("9.weight.exp_avg" if k == "0.weight.exp_avg" else k): v for k, v in good["arrays"].items()}
    with pytest.raises(ConfigError, match=r"unexpected \['9.weight.exp_avg'\]; missing \['0.weight.exp_avg'\]"):
        opt.load_state_dict({"arrays": renamed, "scalars": good["scalars"]})

    sgd = optim.create("sgd", make_params(np.float32, rng), momentum=0.9)
    with pytest.raises(ConfigError, match="exp_avg_sq.*expected.*momentum_buffer"):
        sgd.load_state_dict(good)

    with pytest.raises(ConfigError, match="'step' is -1"):
        opt.load_state_dict({"arrays": good["arrays"], "scalars": {**good["scalars"], "step": -1}})

    with pytest.raises(ConfigError, match="beta1=1.5"):
        opt.load_state_dict({"arrays": good["arrays"], "scalars": {**good["scalars"], "lr": 0.5, "beta1": 1.5}})
    assert opt.lr == 0.001 and opt.beta1 == 0.9  # a refused state changes nothing

    nadam = optim.create("nadam", make_params(np.float32, rng))
    state = nadam.state_dict()
    state["scalars"].update(lr=0.5, mu_product=2.0)
    with pytest.raises(ConfigError, match="mu_product=2.0 is out of range"):
        nadam.load_state_dict(state)
    assert nadam.lr == 0.002 and nadam.mu_product == 1.0


@pytest.mark.parametrize("name,hyper,message", [
    ("sgd", dict(lr=-0.1), r"lr=-0.1 is out of range; expected 0.0 <= lr"),
    ("sgd", dict(lr=float("nan")), r"lr=nan is out of range"),
    ("sgd", dict(lr="fast"), r"lr='fast' is not a number; expected 0.0 <= lr"),
    ("sgd", dict(momentum=-0.5), r"momentum=-0.5 is out of range; expected 0.0 <= momentum"),
    ("sgd", dict(nesterov=True), r"nesterov=True needs momentum > 0 and dampening = 0, got momentum=0.0"),
    ("sgd", dict(momentum=0.9, nesterov=True, dampening=0.1), r"needs momentum > 0 and dampening = 0.*dampening=0.1"),
    ("sgd", dict(weight_decay=-1), r"weight_decay=-1 is out of range"),
    ("rmsprop", dict(eps=0.0), r"eps=0.0 is out of range; expected 0.0 < eps"),
    ("rmsprop", dict(rho=1.0), r"rho=1.0 is out of range; expected 0.0 <= rho < 1.0"),
    ("rmsprop", dict(centered="yes"), r"centered='yes'; expected True or False"),
    ("adam", dict(beta1=1.0), r"beta1=1.0 is out of range; expected 0.0 <= beta1 < 1.0"),
    ("adamw", dict(beta2=-0.1), r"beta2=-0.1 is out of range; expected 0.0 <= beta2 < 1.0"),
    ("nadam", dict(momentum_decay=-1e-3), r"momentum_decay=-0.001 is out of range"),
])
def test_bad_hyperparameter_names_value_and_range(name, hyper, message):
    with pytest.raises(ConfigError, match=message):
        optim.create(name, make_params(np.float32, np.random.default_rng(4)), **hyper)


def test_create_names_and_unknowns():
    params = make_params(np.float32, np.random.default_rng(5))
    for name, cls in zip(optim.NAMES, (optim.SGD, optim.RMSProp, optim.Adam, optim.AdamW, optim.Nadam)):
        assert type(optim.create(name.upper(), params)) is cls
    valid = "sgd, rmsprop, adam, adamw, nadam"
    with pytest.raises(ConfigError, match=f"unknown optimizer 'adagrad'; expected one of {valid}"):
        optim.create("adagrad", params)
    with pytest.raises(ConfigError, match="'adam' has no option momentum; it takes lr, beta1, beta2"):
        optim.create("adam", params, momentum=0.9)
    with pytest.raises(ConfigError, match="parameter name '0.weight' appears twice"):
        optim.create("sgd", params + params[:1])
    with pytest.raises(ConfigError, match=r"gradient of 'w' is float32\(3,\), expected float32\(4,\)"):
        optim.create("sgd", [("w", np.zeros(4, np.float32), np.zeros(3, np.float32))])


@pytest.mark.parametrize("name,hyper", [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("rmsprop", dict(lr=0.01, momentum=0.5)),
    ("rmsprop", dict(lr=0.01, centered=True)),
    ("adam", dict(lr=0.05)),
    ("adamw", dict(lr=0.05, weight_decay=0.0)),
    ("nadam", dict(lr=0.05)),
])
def test_converges_on_a_convex_quadratic(name, hyper):
    """min 0.5 x'Ax - b'x over two tensors (A block-diagonal, condition number 10): x* = A^-1 b.

    The learning rate decays by 0.5% a step: with a constant one the adaptive methods circle the
    minimum at a distance of about lr.
    """
    rng = np.random.default_rng(6)
    blocks = []
    for shape in [(6,), (2, 3)]:
        q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
        a = q @ np.diag(np.linspace(1, 10, 6)) @ q.T
        b = rng.standard_normal(6)
        blocks.append((a, b, np.linalg.solve(a, b).reshape(shape)))
    params = [(f"x{i}", np.zeros(x.shape), np.zeros(x.shape)) for i, (_, _, x) in enumerate(blocks)]
    opt = optim.create(name, params, **hyper)
    for _ in range(500):
        for (_, x, g), (a, b, _) in zip(params, blocks):
            g[...] = (a @ x.reshape(-1) - b).reshape(x.shape)
        opt.step()
        opt.lr *= 0.995
    for (n, x, _), (_, _, solution) in zip(params, blocks):
        np.testing.assert_allclose(x, solution, rtol=0, atol=1e-6, err_msg=f"{name}: {n}")
