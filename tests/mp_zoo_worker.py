"""Worker launched by tests/test_model_parallel.py under mpiexec: every named zoo model, split over the
processes, computes one process's forward output and gradients.

    mpiexec -n 3 python tests/mp_zoo_worker.py MODEL [MODEL ...]

For each model: build it whole twice in float64 (the same seed), run forward and backward in training
mode on 2 samples with the same dropout seed, split one copy (model_parallel.partition) and run it
again. The output and every gradient slice must agree with the whole model's to 1e-10, relative to the
largest value of each (or to 1e-4 of the model's largest gradient, for gradients that are zero but for
rounding, as a convolution's bias before BatchNorm). Prints one line per model; exits 1 at the first disagreement.
"""

import sys

import numpy as np

from pydtnn import models
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch, model_parallel


def run(model, x, dy):
    model.backend.reseed([5, 0, 0, 0, 1])
    out = model.forward(x, training=True)
    model.backward(dy)
    return np.array(out), {name: np.array(g) for name, _, g in model.parameters()}


def main():
    comm = launch.init(stall_timeout=120)
    launch.install_abort_handler(comm)
    for name in sys.argv[1:]:
        whole = models.create(name, backend=CPUBackend("float64", seed=11))
        split = models.create(name, backend=CPUBackend("float64", seed=11))
        rng = np.random.default_rng(1)
        x = rng.standard_normal((2,) + whole.input_shape)
        dy = rng.standard_normal((2,) + whole.output_shape)
        want_out, want_grads = run(whole, x, dy)
        sharding = model_parallel.partition(split, comm)
        got_out, got_grads = run(split, x, dy)
        worst, where = np.abs(got_out - want_out).max() / np.abs(want_out).max(), "output"
        floor = 1e-4 * max(np.abs(g).max() for g in want_grads.values())  # a bias before BatchNorm: 0 + rounding
        for k, g in want_grads.items():
            g = sharding.cut(k, g)
            scale = max(np.abs(g).max() if g.size else 0.0, floor)
            err = np.abs(got_grads[k] - g).max() / scale if g.size else 0.0
            if err > worst:
                worst, where = err, f"{k} (largest {scale:.2g})"
        inserted = sum(isinstance(layer, model_parallel.Gather | model_parallel.SumGrad)
                       for _, layer in split.root.named_layers())
        if comm.rank == 0:
            print(f"{name}: {len(sharding.slices)} sliced arrays, {inserted} inserted layers, worst {worst:.2e} "
                  f"at {where}",
                  flush=True)
        if not worst <= 1e-10:
            print(f"rank {comm.rank}: {name} differs from the whole model: {worst:.3g}", file=sys.stderr, flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
