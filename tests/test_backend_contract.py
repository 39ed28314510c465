"""The backend contract (backends/base.py): the generic Backend runs every layer that has a generic form,
layers ask nothing else of a backend, the CPU backend's choices are made once, making a backend changes
nothing outside it, and the NumPy path does not leak."""

import ast
import gc
import json
import pathlib
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from pydtnn import optim
from pydtnn.backends import Backend, CPUBackend
from pydtnn.layers import BatchNorm, Conv2D, Dense, Dropout, Flatten, ReLU
from pydtnn.model import Model

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pydtnn"


def _mlp(backend):
    # no bias before BatchNorm: its gradient would be rounding noise, which Adam scales up to whole steps
    layers = [Flatten(), Dense(16, use_bias=False), BatchNorm(), ReLU(), Dropout(0.25), Dense(5)]
    return Model(layers, (3, 4, 4), backend)


def test_the_generic_backend_trains_what_has_a_generic_form_as_the_cpu_backend_does():
    """Dense, BatchNorm, ReLU and Dropout, then SGD and Adam steps: the generic Backend over NumPy (no
    override at all) gives the CPU backend's results with both of its kernel sets."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3, 4, 4))
    dy = rng.standard_normal((8, 5))
    runs = []
    for backend in (Backend(np, np.float64, seed=3), CPUBackend(np.float64, seed=3, kernels="numpy"),
                    CPUBackend(np.float64, seed=3, kernels="numba")):
        model = _mlp(backend)
        outs = []
        for name in ("sgd", "adam"):
            opt = optim.create(name, model.parameters(), backend=backend, lr=0.01, weight_decay=0.1)
            for _ in range(3):
                y = model.forward(x, training=True)
                model.backward(dy)
                opt.step()
                outs.append(y)
        outs.append(model.forward(x, training=False))
        runs.append(outs + [p.copy() for _, p, _ in model.parameters()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_the_generic_backend_names_what_it_lacks():
    with pytest.raises(NotImplementedError, match="Backend has no convolution"):
        Model([Conv2D(4, 3)], (3, 8, 8), Backend(np))


def _calls_on_backend(tree):
    """getattr/hasattr calls whose first argument mentions `backend`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if node.args and "backend" in ast.unparse(node.args[0]):
                found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("folder", ["layers", "optim", "models"])
def test_layers_optimizers_and_models_ask_no_backend_what_it_has_nor_import_one(folder):
    for path in sorted((PACKAGE / folder).glob("*.py")):
        tree = ast.parse(path.read_text())
        assert _calls_on_backend(tree) == [], path.name
        imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        specific = [i for i in imports if "backends.cpu" in i or "backends.gpu" in i]
        assert specific == [], f"{path.name} imports a specific backend: {specific}"


@pytest.mark.parametrize("part", ["trainer.py", "step.py", "readings.py"])
def test_the_trainer_asks_no_backend_what_it_has(part):
    assert _calls_on_backend(ast.parse((PACKAGE / part).read_text())) == []


def test_a_convolution_is_planned_once_when_built(monkeypatch):
    backend = CPUBackend(kernels="numpy")
    calls = []
    real = backend.conv2d_plan
    monkeypatch.setattr(backend, "conv2d_plan", lambda *a: calls.append(a) or real(*a))
    model = Model([Conv2D(4, 3, padding=1), ReLU(), Conv2D(4, 1)], (3, 8, 8), backend)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    for _ in range(3):
        model.backward(model.forward(x))
    assert len(calls) == 2
    layers = [layer for _, layer in model.layers() if isinstance(layer, Conv2D)]
    assert [layer.plan.algorithm for layer in layers] == ["gemm", "gemm"]


def test_the_numpy_depthwise_convolution_does_not_grow_over_steps():
    """Its chunked loops once went through a cache keyed on a fresh closure: every step added an entry
    that kept that step's arrays alive (119 MB to 488 MB over 40 steps of a 5x5 depthwise layer)."""
    backend = CPUBackend(kernels="numpy")
    model = Model([Conv2D(32, 5, padding=2, groups=32)], (32, 16, 16), backend)
    x = np.random.default_rng(0).standard_normal((8, 32, 16, 16)).astype(np.float32)
    step_bytes = 4 * x.nbytes  # more than one step's activations, gradients and scratch together

    def step():
        model.backward(model.forward(x))

    for _ in range(3):
        step()
    gc.collect()
    tracemalloc.start()
    try:
        step()
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            step()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < step_bytes, f"{grown / 1e6:.1f} MB more after 20 steps"


PROCESS_STATE = """
import json, os
from threadpoolctl import threadpool_info
import numpy as np
from pydtnn import runtime
from pydtnn.backends import CPUBackend
from pydtnn.models import create

def state():
    blas = sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
    return {"blas": blas, "gomp": os.environ.get("GOMP_SPINCOUNT"), "configured": runtime.configured()}

before = state()
model = create("mobilenetv1_cifar10", backend=CPUBackend(kernels="numba"))
x = np.zeros((2, 3, 32, 32), np.float32)
model.backward(model.forward(x))
after_model = state()
applied = runtime.configure(threads=1)
print(json.dumps([before, after_model, state(), applied]))
"""


def test_making_a_backend_and_training_a_model_change_nothing_outside_until_configure():
    pytest.importorskip("numba")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "2"
    r = subprocess.run([sys.executable, "-c", PROCESS_STATE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after_model, after_configure, applied = json.loads(r.stdout)
    assert after_model == before and before["gomp"] is None and before["configured"] is None
    assert after_configure["blas"] == [1] and after_configure["gomp"] == "30000"
    assert after_configure["configured"] == applied and applied["threads"] == 1
