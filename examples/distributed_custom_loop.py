"""A hand-written training loop made data-parallel by wrapping its optimizer.

    python examples/distributed_custom_loop.py                 # one process
    mpiexec -n 2 python examples/distributed_custom_loop.py    # two: same result, half the work each

Each step takes a global batch of 64 digits; rank r trains on its share. The gradients are
averaged over ranks (opt.synchronize(), or inside opt.step()), so every rank ends with the same
parameters as one process. Gradients are read only after synchronize(): here, to clip their norm.
"""

import numpy as np

from pydtnn import data, models
from pydtnn.backends import CPUBackend
from pydtnn.distributed import launch
from pydtnn.distributed.optimizer import DistributedOptimizer
from pydtnn.data import epoch_order
from pydtnn.distributed.sampler import shard_bounds
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.optim import SGD

comm = launch.init()
train, test = data.load("mnist5k")
model = models.create("simplemlp", backend=CPUBackend("float64", seed=comm.rank))  # rank 0's weights win
loss = SoftmaxCrossEntropy()
opt = DistributedOptimizer(SGD(model.parameters(), lr=0.05, momentum=0.9), model, comm)

GLOBAL = 64
order = epoch_order(len(train), seed=0, epoch=0)  # the same shuffle on every rank
for start in range(0, 64 * 30, GLOBAL):
    bounds = shard_bounds(GLOBAL, comm.size)
    x, y = train.get_batch(order[start + bounds[comm.rank] : start + bounds[comm.rank + 1]], np.float64)
    opt.set_weight((bounds[comm.rank + 1] - bounds[comm.rank]) / GLOBAL)
    loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    opt.synchronize()  # the gradients are now the global average: safe to read and change
    norm = np.sqrt(sum(float((g * g).sum()) for _, _, g in model.parameters()))
    for _, _, g in model.parameters():
        g *= min(1.0, 3.0 / norm)  # clip the global gradient norm at 3
    opt.step()

x, y = test.get_batch(np.arange(len(test)), np.float64)
accuracy = float((model.forward(x, training=False).argmax(1) == y).mean())
if comm.rank == 0:
    total = sum(float(np.abs(p).sum()) for _, p, _ in model.parameters())
    print(f"processes {comm.size}: test accuracy {accuracy:.4f}, sum of |parameters| {total:.10f}")
