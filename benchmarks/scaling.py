"""Data-parallel training throughput: pydtnn (every reduction strategy) against PyTorch DDP (gloo).

    python benchmarks/scaling.py [--quick] [--nps 1,2,4] [--models simplecnn,vgg11_cifar10,resnet20_cifar10]
                                 [--batch 32] [--warmup 2] [--steps 6] [--json FILE] [--out FILE] [--plot PREFIX]
                                 [--strategies none,blocking,per_layer,bucketed] [--net none,1gbit,200mbit]

The driver starts, for each process count P, one `mpiexec -n P` job that trains every model with
every strategy in turn (pydtnn's Trainer.train_step on synthetic data, a fresh model per run), and
one PyTorch job that spawns P processes (torch.distributed, gloo, MASTER_ADDR=127.0.0.1, no torchrun)
and trains the same architectures, written out by hand below (the parameter counts are checked
against pydtnn's), with DistributedDataParallel.

Same per-process batch, float32, SGD with momentum, softmax cross-entropy, one BLAS/OpenMP thread per
process (threadpoolctl for NumPy, torch.set_num_threads(1) for PyTorch). Every run starts with a
barrier; each step is timed on every rank; a step's time is the slowest rank's, and throughput is
P * batch / the median step time after `--warmup` steps. Scaling efficiency = throughput(P) /
(P * throughput(1)) of the same library.

Strategies: pydtnn `blocking`, `per_layer`, `bucketed` (pydtnn.distributed.reducers, default options)
and `none` (no gradient reduction at all: every rank trains alone; the compute-only ceiling of data
parallelism on this machine); with --strategies also `hierarchical` (--ranks_per_node), `topk:D` (density
D), `oktopk:D` (Ok-Topk, density D), `powersgd:R` (rank R), `local_sgd:H` (the replicas averaged every H steps:
its step time is the mean over the timed steps, not the median, so give --steps a multiple of H), `stale` (--reduction_staleness 1),
`fp16` (bucketed, fp16 on the wire), and any of them with `+thread` (outstanding allreduces progressed
by a helper thread, progress="thread") or `+mpich` (the same reducer in a separate job whose environment
has MPIR_CVAR_ASYNC_PROGRESS=1: MPICH's own progress thread).

Networks (--net): `none` is plain mpiexec (MPICH over shared memory, gloo over the plain loopback); a
rate such as `1gbit` or `200mbit` runs both libraries' jobs under benchmarks/netem.py --rate R: one
network namespace whose loopback is capped at R, MPICH over TCP, so every byte between ranks crosses the
capped link (all ranks share it, like a bus). The np=1 runs have no communication and run once.
With --nodes 2 an emulated rate means two nodes instead (netem.py --nodes 2): ranks 0..P/2-1 in one
network namespace, the others in a second, joined by a veth pair capped at R each way; shared memory
inside a node. PyTorch's ranks are then started by the same mpiexec (rank and size from MPICH's
PMI_RANK and PMI_SIZE, gloo over the veth pair) instead of torch.multiprocessing. PyTorch: `ddp` (DistributedDataParallel, default 25 MB buckets) and
`no_sync` (the same model inside `ddp.no_sync()`, so no gradient allreduce: PyTorch's ceiling).

Exposed communication (pydtnn): per step, the time the last rank to arrive spends in
`reducer.finish()` (the Trainer's "reduce" span: waiting for outstanding allreduces, and for
`blocking` the whole pack-reduce-unpack) over the slowest rank's step; median over steps. Overhead
(both libraries): 1 - t(none or no_sync) / t(strategy), the share of a step that gradient averaging
adds over the same P processes training alone: it also counts communication work done inside
backward (MPI progress in test(), packing), which finish() does not see.

Before each job the driver waits (up to --wait_idle s) until other processes leave the cores, and
reports how many cores other processes used while it ran.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

MODELS = ("simplecnn", "vgg11_cifar10", "resnet20_cifar10")
PYDTNN_STRATEGIES = ("none", "blocking", "per_layer", "bucketed")
NODE0 = "10.213.0.1"  # benchmarks/netem.py's first node, where --nodes 2 runs the command
TORCH_STRATEGIES = ("no_sync", "ddp")
LR = 0.001


def parse_strategy(spec, ranks_per_node=0):
    """'topk:0.01+thread' -> ('topk', {'density': 0.01, 'progress': 'thread'}); 'none' and the reducers'
    names; 'fp16' is bucketed with fp16 on the wire; '+mpich' changes the job's environment only."""
    base, _, progress = spec.partition("+")
    name, _, arg = base.partition(":")
    options = {}
    if name == "fp16":
        name, options["compression"] = "bucketed", "fp16"
    if name in ("topk", "oktopk"):
        options["density"] = float(arg or 0.01)
    if name == "powersgd":
        options["rank"] = int(arg or 4)
    if name == "local_sgd":
        options["every"] = int(arg or 4)
    if name == "hierarchical" and ranks_per_node:
        options["ranks_per_node"] = ranks_per_node
    if progress == "thread":
        options["progress"] = "thread"
    return name, options


def median_of_slowest(step_times):
    """step_times: (ranks, steps) -> median over steps of each step's slowest rank."""
    return float(np.median(np.max(np.asarray(step_times), axis=0)))


# ----------------------------------------------------------------------------------------------
# pydtnn worker (one per mpiexec job)
# ----------------------------------------------------------------------------------------------
def pydtnn_worker(args):
    from threadpoolctl import threadpool_limits

    from pydtnn import losses, models, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.distributed import launch, reducers
    from pydtnn.distributed.consistency import broadcast_state
    from pydtnn.profiling import Tracer
    from pydtnn.trainer import Trainer

    threadpool_limits(1)
    comm = launch.init(threads=1, stall_timeout=0)
    size, rank = comm.size, comm.rank
    strategies = args.strategies.split(",") if size > 1 else ("sequential",)
    cats = ("forward", "backward", "reduce", "wait", "optimizer")
    results = []
    for name in args.models.split(","):
        shape, classes = models.defaults(name)
        rng = np.random.default_rng([rank, 7])
        x = rng.standard_normal((args.batch,) + tuple(shape), dtype=np.float32)
        y = rng.integers(0, classes, args.batch)
        for strategy in strategies:
            model = models.create(name, backend=CPUBackend(seed=0))
            opt = optim.create("sgd", model.parameters(), lr=LR, momentum=0.9)
            kind, options = parse_strategy(strategy, args.ranks_per_node)
            reducer = reducers.create(kind, comm, **options) if kind in reducers.NAMES else None
            tracer = Tracer(pid=rank)
            trainer = Trainer(model, losses.SoftmaxCrossEntropy(), opt, progress=False, comm=comm, reducer=reducer,
                              tracer=tracer)
            broadcast_state(comm, model, opt)
            if reducer is not None:
                reducer.tracer = tracer
            steps, phase = [], {c: [] for c in cats}
            comm.barrier()  # every rank starts the run together (`none` never synchronises again)
            for i in range(args.warmup + args.steps):
                tracer.events.clear()
                t0 = time.perf_counter()
                trainer.train_step(x, y, weight=1 / size)
                t = time.perf_counter() - t0
                if i >= args.warmup:
                    steps.append(t)
                    totals = tracer.totals()
                    for c in cats:
                        phase[c].append(totals.get(c, 0.0))
            if reducer is not None:  # the stale reducer's last allreduce, local SGD's average: outside the timing
                reducer.end_epoch(opt)
            local = np.array([steps] + [phase[c] for c in cats], np.float64)
            if size > 1:
                every = np.empty((size,) + local.shape)
                comm.comm.Gather(local, every, root=0)
            else:
                every = local[None]
            if rank == 0:
                mean = float(np.mean(np.max(every[:, 0], axis=0)))  # local SGD: its averages every H steps counted
                step = mean if kind == "local_sgd" else median_of_slowest(every[:, 0])
                rec = {"lib": "pydtnn", "model": name, "strategy": strategy, "np": size, "batch": args.batch,
                       "params": model.count_params(), "step_s": step, "samples_per_s": size * args.batch / step,
                       "steps": args.steps, "step_mean_s": mean}
                for j, c in enumerate(cats, 1):
                    rec[f"{c}_s"] = median_of_slowest(every[:, j])
                # exposed communication: per step, the time the last rank to arrive spends in reducer.finish()
                # (the least over ranks: the others also wait for that rank) over the slowest rank's step;
                # median over steps. finish_max_frac keeps the most over ranks: communication plus imbalance.
                slowest = np.max(every[:, 0], axis=0)
                rec["exposed_frac"] = float(np.median(np.min(every[:, 3], axis=0) / slowest))
                rec["finish_max_frac"] = float(np.median(np.max(every[:, 3], axis=0) / slowest))
                results.append(rec)
                print(f"  pydtnn np={size} {name} {strategy}: {rec['samples_per_s']:.1f} samples/s, "
                      f"step {step * 1e3:.1f} ms, finish() {rec['exposed_frac']:.1%}", file=sys.stderr, flush=True)
            del trainer, model, opt, reducer
    if rank == 0:
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(results, f)
    comm.barrier()


# ----------------------------------------------------------------------------------------------
# PyTorch: the same architectures, written out by hand
# ----------------------------------------------------------------------------------------------
def torch_model(name):
    from torch import nn

    if name == "simplecnn":
        # conv16-relu-maxpool-conv32-relu-maxpool-fc64-relu-fc10, 3x3 'same' convolutions, on 1x28x28
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))
    if name.startswith("vgg") and name.endswith("_cifar10"):
        # pydtnn's vgg<d>[bn]_cifar10: torchvision's features on 32x32 (ending at 512x1x1), no adaptive
        # pooling, classifier 512-4096-4096-10 with ReLU and Dropout(0.5)
        from pydtnn.models.vgg import CONFIGS

        tag = name.split("_")[0][3:]
        bn = tag.endswith("bn")
        depth = int(tag[:-2] if bn else tag)
        layers, c = [], 3
        for v in CONFIGS[depth]:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1)] + ([nn.BatchNorm2d(v)] if bn else []) + [nn.ReLU()]
                c = v
        return nn.Sequential(
            nn.Sequential(*layers), nn.Flatten(),
            nn.Sequential(nn.Linear(512, 4096), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4096, 10)))
    if name == "resnet20_cifar10":
        return resnet_cifar(3)
    raise SystemExit(f"scaling.py: no PyTorch equivalent written for {name}")


def resnet_cifar(n, num_classes=10):
    """He et al. 2016 CIFAR ResNet (6n + 2 layers): 16-32-64 channels, global average pool, fc; option-B
    shortcuts (identity, or 1x1 convolution + BatchNorm where the shape changes), as pydtnn builds it."""
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU()
            self.downsample = None
            if stride != 1 or cin != planes:
                self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

        def forward(self, x):
            out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(out + (x if self.downsample is None else self.downsample(x)))

    blocks, c = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()], 16
    for i, planes in enumerate((16, 32, 64)):
        for b in range(n):
            blocks.append(BasicBlock(c, planes, 2 if i > 0 and b == 0 else 1))
            c = planes
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def torch_rank(rank, args, size, port, out, master="127.0.0.1"):
    import torch
    import torch.distributed as dist
    from torch import nn

    from pydtnn import models

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if size > 1:
        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
    results = []
    for name in args.models.split(","):
        shape, classes = models.defaults(name)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn((args.batch,) + tuple(shape), generator=g)
        y = torch.randint(0, classes, (args.batch,), generator=g)
        for strategy in (TORCH_STRATEGIES if size > 1 else ("sequential",)):
            model = torch_model(name)
            params = sum(p.numel() for p in model.parameters())
            expected = models.create(name).count_params()
            if params != expected:
                raise SystemExit(f"scaling.py: PyTorch {name} has {params} parameters, pydtnn's {expected}")
            net = nn.parallel.DistributedDataParallel(model) if size > 1 else model
            opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
            loss_fn = nn.CrossEntropyLoss()
            times = []
            if size > 1:
                dist.barrier()
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                if strategy == "no_sync":
                    with net.no_sync():
                        loss_fn(net(x), y).backward()
                else:
                    loss_fn(net(x), y).backward()
                opt.step()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            local = torch.tensor(times, dtype=torch.float64)
            if size > 1:
                every = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(every, local)
                every = torch.stack(every).numpy()
            else:
                every = local.numpy()[None]
            if rank == 0:
                step = median_of_slowest(every)
                results.append({"lib": "torch", "model": name, "strategy": strategy, "np": size, "batch": args.batch,
                                "params": params, "step_s": step, "samples_per_s": size * args.batch / step,
                                "steps": args.steps})
                print(f"  torch np={size} {name} {strategy}: {size * args.batch / step:.1f} samples/s, "
                      f"step {step * 1e3:.1f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f)
    if size > 1:
        dist.barrier()
        dist.destroy_process_group()


def torch_worker(args):
    if args.worker == "torch_mpi":  # started by mpiexec, one process per rank
        return torch_rank(int(os.environ["PMI_RANK"]), args, int(os.environ["PMI_SIZE"]), args.port, args.result,
                          args.master)
    import torch.multiprocessing as mp

    size = args.np
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if size == 1:
        torch_rank(0, args, 1, port, args.result)
    else:
        mp.spawn(torch_rank, args=(args, size, port, args.result), nprocs=size, join=True)


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def busy_seconds():
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_seconds():
    """CPU-seconds of this process and of its finished children (their children included)."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def wait_idle(max_wait, threshold=0.15, window=2.0):
    """Wait (up to max_wait s) until other processes use less than `threshold` cores over `window` s."""
    t0 = time.perf_counter()
    while busy_seconds() is not None:
        b0, o0 = busy_seconds(), own_seconds()
        time.sleep(window)
        load = (busy_seconds() - b0 - (own_seconds() - o0)) / window
        if load < threshold:
            return
        if time.perf_counter() - t0 > max_wait:
            print(f"  (machine still busy, {load:.2f} cores used by other processes; running anyway)",
                  file=sys.stderr, flush=True)
            return
        print(f"  (waiting: other processes use {load:.2f} cores)", file=sys.stderr, flush=True)


def run_job(cmd, result, args, net="none", env=None):
    """Run one job (under netem.py for an emulated rate) and return its records, tagged with the network
    (None for np=1 runs, which have no communication)."""
    if net != "none" and args.np_job > 1:  # np=1 has no communication: never under a network
        nodes = ["--nodes", "2", "--procs-per-node", str(args.np_job // 2)] if args.nodes == 2 else []
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "netem.py"),
               "--rate", net, *nodes, "--"] + cmd
    wait_idle(args.wait_idle)
    t0, b0, o0 = time.perf_counter(), busy_seconds(), own_seconds()
    proc = subprocess.run(cmd, check=False, env={**os.environ, **(env or {})}, timeout=args.job_timeout)
    if proc.returncode:
        raise SystemExit(f"scaling.py: {' '.join(cmd)} failed with exit code {proc.returncode}")
    wall = time.perf_counter() - t0
    foreign = max(0.0, (busy_seconds() - b0 - (own_seconds() - o0)) / wall) if b0 is not None else float("nan")
    with open(result, encoding="utf-8") as f:
        out = json.load(f)
    for r in out:
        r["foreign_cores"] = foreign
        r["net"] = None if r["np"] == 1 else net
    print(f"  ({wall:.0f} s, other processes used {foreign:.2f} cores meanwhile: {' '.join(cmd[-8:])})",
          file=sys.stderr, flush=True)
    return out


def mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or "mpiexec"


def drive(args):
    nps = [int(p) for p in args.nps.split(",")]
    common = ["--models", args.models, "--batch", str(args.batch), "--warmup", str(args.warmup),
              "--steps", str(args.steps), "--ranks_per_node", str(args.ranks_per_node)]
    me = os.path.abspath(__file__)
    strategies = args.strategies.split(",")
    # '+mpich' strategies run in jobs of their own: MPICH reads MPIR_CVAR_ASYNC_PROGRESS when it starts
    groups = [(g, env) for g, env in (([s for s in strategies if not s.endswith("+mpich")], {}),
                                      ([s for s in strategies if s.endswith("+mpich")],
                                       {"MPIR_CVAR_ASYNC_PROGRESS": "1"})) if g]
    records = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, net in enumerate(args.net.split(",")):
            for p in nps:
                if p == 1 and i > 0:
                    continue  # no communication at np=1: one run serves every network
                args.np_job = p
                two = args.nodes == 2 and net != "none" and p > 1
                for k, (group, env) in enumerate(groups if p > 1 else groups[:1]):
                    res = os.path.join(tmp, f"pydtnn{p}-{i}-{k}.json")
                    records += run_job([mpiexec(), "-n", str(p), sys.executable, me, "--worker", "pydtnn",
                                        "--result", res, "--strategies", ",".join(group)] + common, res, args, net, env)
                if args.torch:
                    res = os.path.join(tmp, f"torch{p}-{i}.json")
                    if two:  # ranks on both nodes: started by mpiexec, gloo over the veth pair
                        records += run_job([mpiexec(), "-n", str(p), sys.executable, me, "--worker", "torch_mpi",
                                            "--master", NODE0, "--port", "29533", "--result", res] + common,
                                           res, args, net, {"GLOO_SOCKET_IFNAME": "eth0"})
                    else:
                        records += run_job([sys.executable, me, "--worker", "torch", "--np", str(p), "--result", res]
                                           + common, res, args, net)
    wall = time.perf_counter() - t0
    info = machine_info()
    text = report(records, nps, args, info, wall)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "args": vars(args), "wall_s": wall, "records": records}, f, indent=1)
    if args.plot:
        plot(records, nps, args.plot, args)


def merged(paths):
    """The runs saved in these --json files as one: records joined (np=1 records once per model), models,
    process counts, networks and strategies in order of first appearance, the first file's other settings."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            runs.append(json.load(f))
    out = dict(runs[0], args=dict(runs[0]["args"]), records=[], wall_s=sum(r["wall_s"] for r in runs))

    def union(key, default):
        seen = []
        for r in runs:
            for v in str(r["args"].get(key, default)).split(","):
                if v not in seen:
                    seen.append(v)
        return seen

    for key, default in (("models", ""), ("net", "none"), ("strategies", ",".join(PYDTNN_STRATEGIES))):
        out["args"][key] = ",".join(union(key, default))
    out["args"]["nps"] = ",".join(map(str, sorted({int(p) for p in union("nps", "1")})))
    seen = set()
    for r in runs:
        for rec in r["records"]:
            key = (rec["lib"], rec["model"], rec["strategy"], rec["np"], rec.get("net"))
            if key not in seen:
                seen.add(key)
                out["records"].append(rec)
    return out


def machine_info():
    import platform

    import torch

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": model, "numpy": np.__version__, "torch": torch.__version__,
            "python": platform.python_version()}


def _nets(args):
    return getattr(args, "net", "none").split(",")


def _strategies(args):
    return getattr(args, "strategies", ",".join(PYDTNN_STRATEGIES)).split(",")


def _base(records, lib, model):
    r = _find(records, lib, model, "sequential", 1)
    return r["samples_per_s"] if r else None


def _find(records, lib, model, strategy, p, net="none"):
    for r in records:
        if (r["lib"], r["model"], r["strategy"], r["np"]) == (lib, model, strategy, p) and (
                p == 1 or r.get("net", "none") == net):
            return r
    return None


NET_NOTES = {"none": "plain mpiexec: MPICH over shared memory, gloo over the loopback"}


def report(records, nps, args, info, wall):
    multi = [p for p in nps if p > 1]
    cpus = info["cpus"]
    lines = [(f"{info['cpu']}, {cpus} cores; numpy {info['numpy']}, torch {info['torch']}; per-process batch "
             f"{args.batch}, {args.warmup} warm-up + {args.steps} timed steps per run, 1 thread per process; "
             f"script wall time {wall:.0f} s"), ""]
    foreign = max((r.get("foreign_cores", 0.0) for r in records), default=0.0)
    lines += [f"Other processes on the machine used at most {foreign:.2f} cores on average during any one job.", ""]
    over = [p for p in multi if p > cpus]
    if over:
        lines += [f"np={','.join(map(str, over))}: more processes than cores (oversubscribed).", ""]
    strategies = _strategies(args)
    ddp = any(r["lib"] == "torch" and r["strategy"] == "ddp" for r in records)
    for net in _nets(args):
        if _nets(args) != ["none"]:
            how = (f"two nodes of np/2 ranks joined by a veth pair capped at {net} each way (shared memory inside a "
                   "node)" if getattr(args, "nodes", 1) == 2 else "one namespace, its loopback capped, MPICH over TCP")
            lines += [f"Network `{net}`: " + NET_NOTES.get(net, f"benchmarks/netem.py --rate {net}: {how}"), ""]
        head = "| model | library | strategy | np=1 samples/s | " + " | ".join(
            f"np={p} samples/s | eff. np={p} | finish() np={p} | overhead np={p}"
            + (f" | x DDP np={p}" if ddp else "") for p in multi) + " |"
        cols = "---: | ---: | ---: | ---:" + (" | ---:" if ddp else "")
        lines += [head, "| --- | --- | --- | ---: | " + " | ".join(cols for _ in multi) + " |"]
        for model in args.models.split(","):
            for lib, strats, ref in (("pydtnn", strategies, "none"), ("torch", TORCH_STRATEGIES, "no_sync")):
                base = _base(records, lib, model)
                for s in strats:
                    if not any(_find(records, lib, model, s, p, net) for p in multi):
                        continue  # not run on this network (merged runs)
                    cells = []
                    for p in multi:
                        r, rr = _find(records, lib, model, s, p, net), _find(records, lib, model, ref, p, net)
                        d = _find(records, "torch", model, "ddp", p, net)
                        if r is None:
                            cells.append(" | | | " + (" | " if ddp else ""))
                            continue
                        eff = r["samples_per_s"] / (p * base) if base else float("nan")
                        fin = f"{r['exposed_frac']:.1%}" if "exposed_frac" in r and s != "none" else ""
                        ovh = f"{1 - rr['step_s'] / r['step_s']:.1%}" if rr is not None and s != ref else ""
                        vs = f" | {r['step_s'] / d['step_s']:.2f}" if d is not None else (" | " if ddp else "")
                        cells.append(f"{r['samples_per_s']:.1f} | {eff:.2f} | {fin} | {ovh}{vs}")
                    lines.append(f"| {model} | {lib} | {s} | {base or float('nan'):.1f} | " + " | ".join(cells) + " |")
        lines += [""]
    lines += [("eff.: throughput(np) / (np * throughput(np=1)) of the same library. finish(): pydtnn's exposed "
              "communication, the share of the step that the last rank to arrive spends in reducer.finish(). "
              "overhead: 1 - t_step(none or no_sync) / t_step(strategy) at the same np and network: what gradient "
              "averaging adds over P processes training alone (negative: within noise)."
               + (" x DDP: the step time over PyTorch DDP's at the same np and network." if ddp else "")),
              "", ("Per-phase medians of pydtnn runs (ms, slowest rank per phase; the finish() shares are per step, "
              "of the last rank to arrive and of the first, which also waits for the others):"), "",
              ("| model | strategy | np | network | step | forward | backward | finish() | of which wait | optimizer "
              "| finish() last rank % | finish() first rank % |"),
              "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        if r["lib"] == "pydtnn":
            fr = (f"{r['exposed_frac']:.1%} | {r['finish_max_frac']:.1%}" if r["strategy"] not in ("none", "sequential")
                  else " | ")
            lines.append(f"| {r['model']} | {r['strategy']} | {r['np']} | {r.get('net') or ''} | {r['step_s'] * 1e3:.1f} | "
                         f"{r['forward_s'] * 1e3:.1f} | {r['backward_s'] * 1e3:.1f} | {r['reduce_s'] * 1e3:.1f} | "
                         f"{r['wait_s'] * 1e3:.1f} | {r['optimizer_s'] * 1e3:.1f} | {fr} |")
    return "\n".join(lines) + "\n"


def plot(records, nps, prefix, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = _nets(args)
    if nets != ["none"]:
        plot_network(records, nps, prefix, args, plt)
    if "none" not in nets:
        return
    strategies = _strategies(args)
    models = list(dict.fromkeys(r["model"] for r in records))
    series = [("pydtnn", s) for s in strategies] + [("torch", s) for s in TORCH_STRATEGIES]
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        ax, ax2 = axes[0][col], axes[1][col]
        for lib, s in series:
            xs, ys, effs = [], [], []
            base = _base(records, lib, model)
            for p in nps:
                r = _find(records, lib, model, s, p) if p > 1 else _find(records, lib, model, "sequential", 1)
                if r is not None:
                    xs.append(p)
                    ys.append(r["samples_per_s"])
                    effs.append(r["samples_per_s"] / (p * base))
            style = "-" if lib == "pydtnn" else "--"
            ax.plot(xs, ys, style, marker="o", label=f"{lib} {s}", markersize=4)
            ax2.plot(xs, effs, style, marker="o", label=f"{lib} {s}", markersize=4)
        base = _base(records, "pydtnn", model)
        ax.plot(nps, [p * base for p in nps], color="grey", lw=0.8, ls=":", label="pydtnn ideal")
        ax.set_title(model)
        ax.set_xlabel("processes (2 cores: np=4 oversubscribed)")
        ax.set_ylabel("samples/s")
        ax.set_xticks(nps)
        ax2.axhline(0.95, color="red", lw=0.6, ls=":", label="0.95 (1.9x at np=2)")
        ax2.set_xticks(nps)
        ax2.set_ylim(0, 1.25)
        ax2.set_xlabel("processes")
        ax2.set_ylabel("scaling efficiency")
        for a in (ax, ax2):
            a.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax2.legend(handles=ax2.get_lines()[-1:], fontsize=7, loc="lower left")
    fig.tight_layout()
    out = f"{prefix}_scaling.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}", file=sys.stderr)

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    multi = [p for p in nps if p > 1]
    bars = [(p, kind) for p in multi for kind in ("finish", "overhead")]
    for ax, model in zip(axes[0], models):
        width = 0.8 / max(len(bars), 1)
        for k, (p, kind) in enumerate(bars):
            vals = []
            for s in strategies[1:]:
                r, rr = _find(records, "pydtnn", model, s, p), _find(records, "pydtnn", model, "none", p)
                if r is None:
                    vals.append(0)
                elif kind == "finish":
                    vals.append(100 * r["exposed_frac"])
                else:
                    vals.append(100 * (1 - rr["step_s"] / r["step_s"]) if rr else 0)
            label = f"np={p}: in finish()" if kind == "finish" else f"np={p}: overhead vs none"
            ax.bar(np.arange(len(strategies) - 1) + k * width, vals, width, label=label, color=f"C{multi.index(p)}",
                   hatch="" if kind == "finish" else "//", alpha=1 if kind == "finish" else 0.55)
        ax.axhline(10, color="red", lw=0.8, ls=":", label="target 10%")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(np.arange(len(strategies) - 1) + width * (len(bars) - 1) / 2, strategies[1:], rotation=30,
                      fontsize=7)
        ax.set_ylabel("% of a step")
        ax.set_title(f"{model}: communication cost")
        ax.legend(fontsize=6, loc="best", framealpha=0.6)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out = f"{prefix}_exposed.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}", file=sys.stderr)


def plot_network(records, nps, prefix, args, plt):
    """PREFIX_network.png: step time of every strategy and of DDP, one panel per model and np, one bar
    group per strategy, one bar per network."""
    nets = _nets(args)
    models = args.models.split(",")
    multi = [p for p in nps if p > 1]
    series = [("pydtnn", s) for s in _strategies(args) if s != "none"] + [("torch", "ddp")]
    fig, axes = plt.subplots(len(multi), len(models), figsize=(6.5 * len(models), 3.6 * len(multi)), squeeze=False)
    width = 0.8 / len(nets)
    for row, p in enumerate(multi):
        for col, model in enumerate(models):
            ax = axes[row][col]
            for k, net in enumerate(nets):
                vals = [(_find(records, lib, model, s, p, net) or {}).get("step_s", np.nan) * 1e3 for lib, s in series]
                ax.bar(np.arange(len(series)) + k * width, vals, width, label=f"network {net}", color=f"C{k}")
                d = _find(records, "torch", model, "ddp", p, net)
                if d is not None:
                    ax.axhline(d["step_s"] * 1e3, color=f"C{k}", lw=0.8, ls=":")
            ax.set_xticks(np.arange(len(series)) + width * (len(nets) - 1) / 2,
                          [s if lib == "pydtnn" else "DDP (gloo)" for lib, s in series], rotation=35, fontsize=7,
                          ha="right")
            ax.set_yscale("log")
            ax.set_ylabel("step time (ms, log)")
            ax.set_title(f"{model}, np={p} (dotted: DDP)", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = f"{prefix}_network.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}", file=sys.stderr)


def main():
    class OneLineErrors(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"scaling.py: error: {message}\n")

    p = OneLineErrors(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--nps", default="1,2,4", help="process counts, comma-separated (1 is the baseline)")
    p.add_argument("--batch", type=int, default=32, help="per-process batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--strategies", default=",".join(PYDTNN_STRATEGIES),
                   help="pydtnn strategies: none, blocking, per_layer, bucketed, hierarchical, topk:D, fp16, each "
                        "optionally +thread or +mpich (default none,blocking,per_layer,bucketed; none first)")
    p.add_argument("--net", default="none", help="networks, comma-separated: none (shared memory) or a netem.py "
                   "rate such as 1gbit, 200mbit (default none)")
    p.add_argument("--ranks_per_node", type=int, default=0, help="hierarchical: processes per node (0: detect)")
    p.add_argument("--torch", type=int, choices=(0, 1), default=1, help="run the PyTorch jobs too (default 1)")
    p.add_argument("--job_timeout", type=float, default=1800, help="seconds one job may take (default 1800)")
    p.add_argument("--wait_idle", type=float, default=60,
                   help="before each job, wait up to this many seconds for other processes to leave the cores")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps, np=1,2 only")
    p.add_argument("--out", help="also write the tables (markdown) here")
    p.add_argument("--json", help="also write every record here")
    p.add_argument("--plot", metavar="PREFIX", help="write PREFIX_scaling.png and PREFIX_exposed.png")
    p.add_argument("--from_json", metavar="FILE", nargs="+",
                   help="print the tables (and --plot) of runs saved with --json; several files are merged (their "
                        "models, process counts, networks and strategies joined; --json writes the merged file)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="emulated rates: 1, every rank in one namespace (default); 2, two nodes of np/2 ranks "
                        "joined by a capped veth pair (netem.py --nodes 2)")
    p.add_argument("--worker", choices=("pydtnn", "torch", "torch_mpi"), help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29533, help=argparse.SUPPRESS)
    p.add_argument("--np", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.warmup, args.steps, args.nps = 1, 3, "1,2"
    if args.worker == "pydtnn":
        return pydtnn_worker(args)
    if args.worker in ("torch", "torch_mpi"):
        return torch_worker(args)
    if args.nodes == 2 and any(int(p) % 2 for p in args.nps.split(",") if int(p) > 1):
        p.error(f"--nodes 2 --nps {args.nps}: every process count above 1 must be even (half on each node)")
    for spec in args.strategies.split(","):
        kind = parse_strategy(spec)[0]
        if kind != "none" and kind not in ("blocking", "per_layer", "bucketed", "hierarchical", "topk", "oktopk",
                                           "powersgd", "local_sgd", "stale"):
            p.error(f"--strategies: {spec!r}; expected none, blocking, per_layer, bucketed, hierarchical, topk:D, "
                    "oktopk:D, powersgd:R, local_sgd:H, stale or fp16, optionally +thread or +mpich")
    if args.from_json:
        saved = merged(args.from_json)
        run = argparse.Namespace(**saved["args"])
        nps = [int(p) for p in run.nps.split(",")]
        print(report(saved["records"], nps, run, saved["machine"], saved["wall_s"]))
        if args.plot:
            plot(saved["records"], nps, args.plot, run)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(saved, f, indent=1)
        return None
    return drive(args)


if __name__ == "__main__":
    main()
