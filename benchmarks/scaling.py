"""Data-parallel training throughput at 1, 2 (and 4) processes, pydtnn against PyTorch DDP (gloo).

    python benchmarks/scaling.py [--models simplecnn,resnet20_cifar10,vgg11_cifar10] [--procs 1,2,4]
                                 [--batch 32] [--steps 8] [--out FILE]

Each configuration runs in fresh processes (mpiexec for pydtnn, one process per rank with
torch.distributed's gloo backend for PyTorch), one BLAS/torch thread per process, per-process batch
`--batch` of synthetic data, the same architecture and initial weights (benchmarks/torch_equivalent.py).
Reports samples/s (median step after warm-up), scaling efficiency = throughput_P / (P * throughput_1),
and for pydtnn the exposed communication: time spent waiting in reducer.finish() per step.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def batch_for(model_name, batch, rank, step):
    from pydtnn import models

    shape, classes = models.defaults(model_name)
    rng = np.random.default_rng([rank, step])
    return rng.standard_normal((batch,) + shape, np.float32), rng.integers(0, classes, batch)


def pydtnn_worker(args):
    from pydtnn import models
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import launch, reducers
    from pydtnn.distributed.consistency import broadcast_state
    from pydtnn.losses import SoftmaxCrossEntropy
    from pydtnn.optim import SGD
    from pydtnn.trainer import Trainer

    comm = launch.init(threads=1, stall_timeout=None)
    model = models.create(args.model, backend=CPUBackend(seed=0))
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    reducer = reducers.create(args.strategy, comm) if comm.size > 1 else None
    trainer = Trainer(model, SoftmaxCrossEntropy(), opt, progress=False, comm=comm, reducer=reducer)
    broadcast_state(comm, model, opt)
    waits, steps = [], []
    if reducer is not None:
        finish = reducer.finish

        def timed_finish():
            t0 = time.perf_counter()
            finish()
            waits.append(time.perf_counter() - t0)

        reducer.finish = timed_finish
    for step in range(args.steps + 2):
        x, y = batch_for(args.model, args.batch, comm.rank, step)
        t0 = time.perf_counter()
        trainer.train_step(x, y, weight=1 / comm.size)
        steps.append(time.perf_counter() - t0)
    steps, waits = steps[2:], waits[2:]
    if comm.rank == 0:
        step = statistics.median(steps)
        print(json.dumps({"step_s": step, "exposed_s": statistics.median(waits) if waits else 0.0}))


def torch_worker(args):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from torch_equivalent import to_torch

    from pydtnn import models
    from pydtnn.backends import CPUBackend

    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    net = to_torch(models.create(args.model, backend=CPUBackend(seed=0)))
    if size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    steps = []
    for step in range(args.steps + 2):
        x, y = batch_for(args.model, args.batch, rank, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"step_s": statistics.median(steps[2:])}))
    if size > 1:
        dist.destroy_process_group()


def run_pydtnn(model, strategy, procs, args):
    cmd = ([MPIEXEC, "-n", str(procs)] if procs > 1 else []) + [
        sys.executable, __file__, "--worker", "pydtnn", "--model", model, "--strategy", strategy,
        "--batch", str(args.batch), "--steps", str(args.steps)]
    return _last_json(subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800))


def run_torch(model, procs, args, port):
    cmd = [sys.executable, __file__, "--worker", "torch", "--model", model, "--batch", str(args.batch),
           "--steps", str(args.steps)]
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(procs)}
    children = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**env, "RANK": str(r)}) for r in range(procs)]
    outs = [c.communicate(timeout=1800) for c in children]
    for c, (_, err) in zip(children, outs):
        if c.returncode:
            raise RuntimeError(f"torch worker failed: {err[-2000:]}")
    return _last_json(subprocess.CompletedProcess(cmd, 0, outs[0][0], outs[0][1]))


def _last_json(r):
    if r.returncode:
        raise RuntimeError(f"{' '.join(r.args[:6])} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("pydtnn", "torch"))
    p.add_argument("--model", default="simplecnn")
    p.add_argument("--models", default="simplecnn,resnet20_cifar10,vgg11_cifar10")
    p.add_argument("--strategy", default="bucketed")
    p.add_argument("--strategies", default="blocking,per_layer,bucketed")
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker == "pydtnn":
        return pydtnn_worker(args)
    if args.worker == "torch":
        return torch_worker(args)

    procs = [int(n) for n in args.procs.split(",")]
    lines = [f"per-process batch {args.batch}, {args.steps} timed steps, 1 thread per process, "
             f"{os.cpu_count()} cores (more processes than cores are oversubscribed)", "",
             "| model | implementation | processes | samples/s | speed-up | efficiency | exposed comm. / step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    port = 29500
    for model in args.models.split(","):
        impls = [("pydtnn " + s, lambda n, s=s: run_pydtnn(model, s, n, args)) for s in args.strategies.split(",")]
        impls.append(("PyTorch DDP (gloo)", None))
        base = {}
        for label, fn in impls:
            for n in procs:
                if fn is None:
                    port += 1
                    res = run_torch(model, n, args, port)
                elif n == 1 and "pydtnn" in base:
                    res = base["pydtnn"]  # one process has no reduction: the same run for every strategy
                else:
                    res = fn(n)
                key = "pydtnn" if fn is not None else "torch"
                if n == 1:
                    base[key] = res
                thr = n * args.batch / res["step_s"]
                thr1 = args.batch / base[key]["step_s"]
                exposed = f"{100 * res['exposed_s'] / res['step_s']:.1f}%" if "exposed_s" in res and n > 1 else ""
                lines.append(f"| {model} | {label} | {n} | {thr:.1f} | {thr / thr1:.2f}x | {thr / (n * thr1):.0%} | "
                             f"{exposed} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
