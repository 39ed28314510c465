"""Sharded data parallelism (--zero 1, 2, 3): each replica holds and updates its shard of the optimizer state (and
at stage 3 of the parameters: test_zero3.py), and N processes end where plain data parallelism ends, to the bit
or within 1e-12; checkpoints are one process's files.

Multi-process runs use the mpiexec next to the Python in use, as subprocesses with a timeout.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from test_pipeline import final, same_files

from pydtnn import models, optim
from pydtnn.backends import CPUBackend
from pydtnn.distributed import zero
from pydtnn.distributed.sampler import shard_bounds
from pydtnn.errors import ConfigError

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
TRAIN = [sys.executable, "-m", "pydtnn", "--num_epochs", "1", "--steps_per_epoch", "10", "--dtype", "float64",
         "--flip_images", "true", "--progress", "false"]


def train(n, out, *flags, timeout=180):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [*TRAIN, "--metrics_file", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, check=False)


# -- the shard map ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spans", [None, [(0, 6), (6, 20), (20, 23)]])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_the_shards_cover_the_buffer_once_cutting_parameters_where_they_fall(size, spans):
    """Every element of the buffer is one replica's, each span (bucket) cut into near-equal parts (empty where it
    has fewer elements than replicas), a replica's parts laid end to end in its shard, parameters cut anywhere."""
    offsets = {"a": (0, 5), "b": (5, 6), "c": (6, 20), "d": (20, 23)}
    runs, pieces = zero.shard_map(offsets, size, spans)
    for lo, hi in spans or [(0, 23)]:
        owned = [sum(min(b, hi) - max(a, lo) for a, b, _ in runs[r] if min(b, hi) > max(a, lo)) for r in range(size)]
        assert owned == np.diff(shard_bounds(hi - lo, size)).tolist()
    seen = []
    for r in range(size):
        at = 0
        for name, lo, hi, where in pieces[r]:
            assert where == at and 0 <= lo < hi <= offsets[name][1] - offsets[name][0]
            seen += list(range(offsets[name][0] + lo, offsets[name][0] + hi))
            at += hi - lo
        assert at == sum(hi - lo for lo, hi, _ in runs[r])
    assert sorted(seen) == list(range(23))


def test_spans_are_the_bucketed_reducers_buckets_of_whole_parameters():
    """buckets() cuts the buffer as the bucketed reducer does (the first small, whole parameters each); a span
    that cuts a parameter is refused, since a replica would own two pieces of it."""
    offsets = {"w3": (0, 300), "w2": (300, 700), "w1": (700, 900), "w0": (900, 1000)}
    got = zero.buckets(offsets, 8, bucket_mb=4000 / 2**20, first_bucket_mb=2500 / 2**20)
    assert got == [(["w3"], 0, 300), (["w2"], 300, 700), (["w1", "w0"], 700, 1000)]
    with pytest.raises(ValueError, match="crosses a span"):
        zero.shard_map(offsets, 2, [(0, 250), (250, 1000)])


class Ranks:
    """Rank `rank` of `size`: all a ShardedOptimizer asks of a communicator before its first step."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("name,hyper", [("adam", {}), ("sgd", {"momentum": 0.9})])
def test_the_optimizer_state_of_4_replicas_is_a_quarter_each(name, hyper):
    """The bytes of each replica's optimizer state at np 4 are a quarter of one process's (to an element per
    slot), and the four shards hold every element once."""
    model = models.create("simplecnn", backend=CPUBackend(np.float32))
    whole = optim.create(name, model.parameters(), backend=model.backend, lr=0.01, **hyper)
    one = sum(a.nbytes for a in whole.state_dict()["arrays"].values())
    slots = len(whole.active_slots())
    shards = []
    for r in range(4):
        sharded = zero.ShardedOptimizer(lambda params: optim.create(name, params, backend=model.backend, lr=0.01,
                                                                    **hyper), model, Ranks(r, 4), stage=1)
        shards.append(sum(a.nbytes for slots_ in sharded.inner.state.values() for a in slots_.values()))
    assert sum(shards) == one
    assert all(abs(s - one / 4) <= slots * 4 * 2 for s in shards), (shards, one)


def test_a_stage_it_cannot_serve_is_a_config_error():
    with pytest.raises(ConfigError, match="--zero 4: expected one of 0, 1, 2, 3"):
        zero.check_stage(4)
    with pytest.raises(ConfigError, match="--zero 2 with --reduction topk"):
        zero.check_stage(2, "topk")
    for kwargs, what in (({"reduction": "per_layer"}, "--reduction per_layer"),
                         ({"compression": "fp16"}, "--gradient_compression fp16"),
                         ({"progress": "thread"}, "--reduction_progress thread"), ({"nccl": True}, "--enable_nccl")):
        for stage in (2, 3):
            with pytest.raises(ConfigError, match=f"--zero {stage} reduce-scatters the gradients itself.*{what}"):
                zero.check_stage(stage, **kwargs)
        zero.check_stage(1, **kwargs)  # stage 1 reduces with the run's reducer


def test_one_replica_reads_its_gradients_where_backward_wrote_them():
    """With one replica, stage 2's reduction only scales the buffer, and the update is the whole model's."""
    from pydtnn.distributed.comm import SingleProcess

    model = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
    model.grad_buffer[...] = 1.0
    opt = zero.ShardedOptimizer(lambda params: optim.create("sgd", params, backend=model.backend, lr=0.5), model,
                                SingleProcess(), 2)
    reducer = zero.ShardedReducer(SingleProcess(), opt).attach(model)
    before = {n: p.copy() for n, p, _ in model.parameters()}
    reducer.begin_step(0.5)
    reducer.grads_ready([n for n, _, _ in model.parameters()])
    reducer.finish()
    opt.step()
    assert all(np.allclose(p, before[n] - 0.25) for n, p, _ in model.parameters())


# -- N processes equal plain data parallelism ---------------------------------------------------------
def assert_close(a, b, rtol=1e-12):
    """Every tensor of checkpoint a's model file equals checkpoint b's within rtol of its largest magnitude."""
    from safetensors.numpy import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(x) == list(y)
    for k in x:
        scale = np.abs(y[k]).max()
        assert scale > 0, k
        err = np.abs(x[k] - y[k]).max() / scale
        assert err <= rtol, f"{k}: relative difference {err:.3g} > {rtol}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain data parallelism at np 2 and 3 with SGD with momentum and Adam: each run's record and checkpoint."""
    d = tmp_path_factory.mktemp("dp")
    for n in (2, 3):
        for opt in ("sgd", "adam"):
            r = train(n, d / f"{opt}{n}.jsonl", "--optimizer", opt, "--checkpoint_dir", str(d / f"{opt}{n}"))
            assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_sharded_replicas_end_where_data_parallelism_ends(plain, tmp_path, n, stage, opt):
    """10 steps, float64, with flips, at np 2 and 3 (uneven shards, cut inside parameters): stage 1 ends with
    plain data parallelism's parameters to the bit (the same allreduce, each element's update the same);
    stages 2 and 3 within 1e-12 (a reduce-scatter sums the replicas in another order than an allreduce)."""
    r = train(n, tmp_path / "z.jsonl", "--optimizer", opt, "--zero", str(stage), "--checkpoint_dir",
              str(tmp_path / "z"))
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = final(tmp_path / "z.jsonl"), final(plain / f"{opt}{n}.jsonl")
    if stage == 1:
        assert got["params_sha256"] == want["params_sha256"]
    assert_close(tmp_path / "z", plain / f"{opt}{n}")
    assert got["test_accuracy"] == want["test_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("n", [3])
@pytest.mark.parametrize("opt,flags", [
    ("sgd", ["--momentum", "0"]), ("sgd", ["--nesterov", "true", "--decay", "1e-3"]), ("adamw", []),
    ("rmsprop", ["--decay", "1e-3"]), ("nadam", []), ("adam", ["--accumulation_steps", "3"]),
    ("sgd", ["--lr_schedulers", "warm_up", "--warm_up_epochs", "1"])])
def test_every_optimizer_sharded_ends_where_data_parallelism_ends(tmp_path, opt, flags, n):
    """Every optimizer, weight decay, Nesterov, gradient accumulation and a learning-rate schedule: --zero 1, 2
    and 3 at np 3 (uneven shards, cut inside parameters; np 2 and 3 with SGD and Adam above) end with plain data
    parallelism's parameters after 10 steps (within 1e-12)."""
    for z in ("0", "1", "2", "3"):
        r = train(n, tmp_path / f"{z}.jsonl", "--optimizer", opt, *flags, "--zero", z, "--checkpoint_dir",
                  str(tmp_path / z))
        assert r.returncode == 0, r.stderr[-3000:]
    for z in ("1", "2", "3"):
        assert_close(tmp_path / z, tmp_path / "0")


# -- checkpoints --------------------------------------------------------------------------------------
def test_a_sharded_checkpoint_is_data_parallelisms_and_resumes_on_one_process(tmp_path):
    """--zero 3 at np 2 writes the files plain data parallelism writes (the parameters and the optimizer state
    gathered whole, bit for bit); one process resuming it ends where one process resuming data parallelism's
    ends."""
    for z in ("0", "3"):
        r = train(2, tmp_path / f"z{z}.jsonl", "--optimizer", "adam", "--zero", z, "--checkpoint_dir",
                  str(tmp_path / f"ck{z}"))
        assert r.returncode == 0, r.stderr[-3000:]
    same_files(tmp_path / "ck3", tmp_path / "ck0")
    for z in ("0", "3"):
        r = train(1, tmp_path / f"r{z}.jsonl", "--resume", str(tmp_path / f"ck{z}"), "--num_epochs", "2",
                  "--zero", "0")
        assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "r3.jsonl")["params_sha256"] == final(tmp_path / "r0.jsonl")["params_sha256"]


@pytest.mark.slow
def test_one_process_resumes_as_sharded_replicas_and_sharded_as_model_parallelism(tmp_path):
    """One process's checkpoint resumed by --zero 2 and by --zero 3 at np 3 ends where plain data parallelism at
    np 3 ends from it (within 1e-12); a --zero 1 checkpoint at np 2 resumed by model parallelism of 2 ends where a
    plain one does."""
    r = train(1, tmp_path / "one.jsonl", "--optimizer", "adam", "--checkpoint_dir", str(tmp_path / "one"))
    assert r.returncode == 0, r.stderr[-3000:]
    import shutil

    for z in ("0", "2", "3"):
        shutil.copytree(tmp_path / "one", tmp_path / f"one{z}")
        r = train(3, tmp_path / f"a{z}.jsonl", "--resume", str(tmp_path / f"one{z}"), "--num_epochs", "2",
                  "--zero", z, "--checkpoint_dir", str(tmp_path / f"a{z}"))
        assert r.returncode == 0, r.stderr[-3000:]
    assert_close(tmp_path / "a2", tmp_path / "a0")
    assert_close(tmp_path / "a3", tmp_path / "a0")
    for z in ("0", "1"):
        r = train(2, tmp_path / f"b{z}.jsonl", "--optimizer", "adam", "--zero", z, "--checkpoint_dir",
                  str(tmp_path / f"b{z}"))
        assert r.returncode == 0, r.stderr[-3000:]
        r = train(2, tmp_path / f"m{z}.jsonl", "--resume", str(tmp_path / f"b{z}"), "--num_epochs", "2",
                  "--parallel", "model", "--zero", "0")
        assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "m1.jsonl")["params_sha256"] == final(tmp_path / "m0.jsonl")["params_sha256"]


def test_zero_with_topk_is_one_line_and_exit_2(tmp_path):
    r = train(2, tmp_path / "m.jsonl", "--zero", "2", "--reduction", "topk", timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert lines and "--zero 2 with --reduction topk" in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("layout", [["--parallel", "hybrid", "--model_parallel_size", "2"],
                                    ["--parallel", "hybrid", "--pipeline_stages", "2", "--micro_batches", "2"]],
                         ids=["model-parallel groups", "pipelines"])
def test_replicas_of_split_models_shard_across_the_replicas(tmp_path, layout):
    """np 4 as 2 replicas of a model split over 2 processes, or of a 2-stage pipeline: --zero 2 shards each
    process's part over its replicas and ends with the parameters and the checkpoint files of --zero 0."""
    for z in ("0", "2"):
        r = train(4, tmp_path / f"{z}.jsonl", "--optimizer", "adam", *layout, "--zero", z, "--checkpoint_dir",
                  str(tmp_path / z))
        assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "2.jsonl")["params_sha256"] == final(tmp_path / "0.jsonl")["params_sha256"]
    same_files(tmp_path / "2", tmp_path / "0")


# -- the performance model ----------------------------------------------------------------------------
def test_the_time_model_prices_the_shards_update_and_their_allgather():
    """At 4 replicas the update is the largest shard's (a quarter), an allgather of the parameters follows it,
    and stage 2 sends a reduce-scatter per bucket in place of the reducer's messages."""
    import dataclasses

    from pydtnn.perfmodel import collectives, machine
    from pydtnn.perfmodel.predict import predict

    m = dataclasses.replace(machine.DEFAULT, cores=8, processes_per_node=8)
    model = models.create("simplecnn", backend=CPUBackend(np.float32))
    nbytes = sum(p.nbytes for _, p, _ in model.parameters())
    plain, one, two = (predict(model, 32, 4, m, optimizer="adam", zero=z) for z in (0, 1, 2))
    assert one.update_s == pytest.approx(plain.update_s / 4, rel=1e-3) and one.zero == 1
    gather = collectives.seconds("allgather", "ring", nbytes, 4, m, level="intra")
    assert one.comm_s - plain.comm_s == pytest.approx(gather, rel=1e-9)
    scatter = collectives.seconds("reduce_scatter", "ring", nbytes, 4, m, level="intra")
    assert two.comm_s == pytest.approx(scatter + gather, rel=1e-9) and two.messages == 2
    assert two.exposed_comm_s == pytest.approx(two.comm_s)
    cut = zero.buckets(model.grad_offsets, 4, bucket_mb=0.1, first_bucket_mb=0.01)  # stage 2 over 3 buckets
    assert len(cut) == 3
    many = predict(model, 32, 4, m, optimizer="adam", zero=2, bucket_mb=0.1, first_bucket_mb=0.01)
    scatters = sum(collectives.seconds("reduce_scatter", "ring", 4 * (hi - lo), 4, m, level="intra")
                   for _, lo, hi in cut)
    assert many.comm_s == pytest.approx(scatters + gather, rel=1e-9) and many.messages == len(cut) + 1
    with pytest.raises(ConfigError, match="--zero 1 with --reduction topk"):
        predict(model, 32, 4, m, reduction="topk", zero=1)
    for kwargs, what in (({"progress": "thread"}, "--reduction_progress thread"),
                         ({"compression": "fp16"}, "--gradient_compression fp16")):  # as pydtnn-train refuses them
        with pytest.raises(ConfigError, match=f"--zero 2 reduce-scatters the gradients itself.*{what}"):
            predict(model, 32, 4, m, zero=2, **kwargs)


class ThreadComm:
    """Rank `rank` of `size` threads: the allgatherv a ShardedOptimizer calls, a digest's broadcasts, and the
    reduce-scatters a ShardedReducer starts (done at once, summing in rank order), through shared memory; each
    reduce-scatter is noted in shared["started"] with whether this rank's backward was still running."""

    def __init__(self, rank, size, shared):
        self.rank, self.size, self.shared = rank, size, shared

    def ireduce_scatterv(self, send, recv, counts, label=""):
        from pydtnn.distributed.communicator import Completed

        self.shared["started"][self.rank].append((label, self.shared["in_backward"][self.rank]))
        self.shared["sends"][self.rank] = send.copy()
        self.shared["barrier"].wait()
        total = self.shared["sends"][0].copy()
        for other in self.shared["sends"][1:]:
            total += other
        lo = sum(counts[: self.rank])
        self.shared["barrier"].wait()  # every rank has read every send before an in-place result overwrites one
        (send[: counts[self.rank]] if recv is None else recv)[...] = total[lo : lo + counts[self.rank]]
        self.shared["barrier"].wait()
        return Completed()

    def allgatherv(self, send, recv, counts, label=""):
        self.shared["sends"][self.rank] = send.copy()
        self.shared["barrier"].wait()
        recv[...] = np.concatenate(self.shared["sends"])
        self.shared["barrier"].wait()
        return recv

    def bcast(self, buf, root=0):
        if self.rank == root:
            self.shared["sends"][root] = buf.copy()
        self.shared["barrier"].wait()
        buf[...] = self.shared["sends"][root]
        self.shared["barrier"].wait()
        return buf


@pytest.mark.parametrize("size,chunk,bucket_mb", [(3, 256, 25.0), (4, 1000, 1e-3), (2, 1 << 30, 1e-3)])
def test_shards_gathered_in_many_chunks_give_the_whole_update_and_state(monkeypatch, size, chunk, bucket_mb):
    """Replicas (threads here) whose shards are cut inside parameters (of one bucket, or of many of about 1 KB)
    and gathered in allgathers of a few elements each: every replica ends with the parameters one Adam step over
    the whole model gives, to the bit, and state_dict() gives the whole optimizer's state."""
    import threading

    monkeypatch.setattr(zero, "CHUNK_BYTES", chunk)

    def build():  # the same parameters and gradients every time
        m = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
        m.grad_buffer[...] = np.random.default_rng(0).standard_normal(m.grad_buffer.size)
        return m

    whole = build()
    ref = optim.create("adam", whole.parameters(), backend=whole.backend, lr=0.1)
    ref.step()
    ref.step()
    shared = {"sends": [None] * size, "barrier": threading.Barrier(size)}
    replicas = [build() for _ in range(size)]
    opts = [zero.ShardedOptimizer(lambda params, m=m: optim.create("adam", params, backend=m.backend, lr=0.1), m,
                                  ThreadComm(r, size, shared), 1, bucket_mb=bucket_mb, first_bucket_mb=bucket_mb)
            for r, m in enumerate(replicas)]
    assert len(opts[0].buckets) == (1 if bucket_mb > 1 else len(replicas[0].parameters()))
    states = [None] * size

    def run(r):
        opts[r].step()
        opts[r].step()
        states[r] = opts[r].state_dict()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert chunk > 1000 or opts[0].chunks > 3
    want = whole.state_dict()
    for m, state in zip(replicas, states):
        got = m.state_dict()
        assert all(np.array_equal(got[k], want[k]) for k in want)
        ref_state = ref.state_dict()
        assert state["arrays"].keys() == ref_state["arrays"].keys()
        assert all(np.array_equal(state["arrays"][k], ref_state["arrays"][k]) for k in ref_state["arrays"])
        assert state["scalars"] == ref_state["scalars"]


@pytest.mark.slow
def test_stage_2_over_many_buckets_ends_where_data_parallelism_ends(tmp_path):
    """ResNet-20 in float64 (2.2 MB of gradients) in buckets of 0.5 MB at np 3: --zero 2 reduce-scatters each
    through MPI during backward and ends within 1e-12 of --zero 0, and --zero 1 to the bit."""
    flags = ("--model", "resnet20_cifar10", "--use_synthetic_data", "--steps_per_epoch", "3",
             "--global_batch_size", "24", "--optimizer", "adam", "--bucket_size_mb", "0.5")
    for z in ("0", "1", "2"):
        r = train(3, tmp_path / f"{z}.jsonl", *flags, "--zero", z, "--checkpoint_dir", str(tmp_path / z))
        assert r.returncode == 0, r.stderr[-3000:]
    same_files(tmp_path / "1", tmp_path / "0", names=("model.safetensors",))
    assert_close(tmp_path / "2", tmp_path / "0")


def test_a_traced_stage_2_run_counts_its_reduce_scatters_as_communication_in_flight(tmp_path):
    """The buckets' reduce-scatters run from backward into the reduction's wait: the trace's summary keeps them
    beside the phases (no phase of their own, the phases adding up to the step) and says how much was hidden."""
    out, rows = traced_summary(tmp_path, "--zero", "2", "--bucket_size_mb", "0.01")
    assert rows and not any(line.startswith(("reduce_scatter", "ireduce_scatter")) for line in rows), out[-3000:]
    assert "in flight" in out and "hidden behind computation" in out, out[-3000:]


def traced_summary(tmp_path, *flags):
    """(output, the summary's rows of phases) of a traced 4-step simplecnn run at np 2 with `flags`; its trace in
    tmp_path/t.rank*.json."""
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--model", "simplecnn",
                        "--use_synthetic_data", "--steps_per_epoch", "4", "--global_batch_size", "16", *flags,
                        "--tracing", "--tracer_output", str(tmp_path / "t.json"), "--progress", "false"],
                       capture_output=True, text=True, timeout=180, env=ENV, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    return out, [line for line in out.splitlines() if line and not line[0].isspace() and "%" in line
                 and not line.startswith(("total", "communication"))]


@pytest.mark.parametrize("size", [2, 3])
def test_stage_2_reduce_scatters_each_bucket_during_backward(size):
    """Replicas (threads) with a bucket per parameter: every bucket's reduce-scatter starts inside backward, as
    soon as its gradients are ready, and the step that follows gives every replica the parameters of one Adam
    step on the weighted sum of their gradients (float64, 1e-12)."""
    import threading

    from pydtnn.distributed.comm import SingleProcess

    def build():
        return models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))

    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((3 + r,) + build().input_shape) for r in range(size)]
    weights = [len(x) / sum(len(x) for x in xs) for x in xs]
    whole, grads = build(), []
    for x in xs:  # the reference: each replica's gradients, weighted and summed in rank order
        out = whole.forward(x)
        whole.backward(np.random.default_rng(len(x)).standard_normal(out.shape))
        grads.append(whole.grad_buffer * weights[len(grads)])
    total = grads[0].copy()
    for g in grads[1:]:
        total += g
    whole.grad_buffer[...] = total
    ref = optim.create("adam", whole.parameters(), backend=whole.backend, lr=0.1)
    ref.step()
    shared = {"sends": [None] * size, "barrier": threading.Barrier(size), "started": [[] for _ in range(size)],
              "in_backward": [False] * size}
    replicas = [build() for _ in range(size)]
    opts = [zero.ShardedOptimizer(lambda params, m=m: optim.create("adam", params, backend=m.backend, lr=0.1), m,
                                  ThreadComm(r, size, shared), 2, bucket_mb=1e-6, first_bucket_mb=1e-6)
            for r, m in enumerate(replicas)]
    reducers = [zero.ShardedReducer(ThreadComm(r, size, shared), opts[r]).attach(m) for r, m in enumerate(replicas)]
    errors = []

    def run(r):
        try:
            out = replicas[r].forward(xs[r])
            reducers[r].begin_step(weights[r])
            shared["in_backward"][r] = True
            replicas[r].backward(np.random.default_rng(len(xs[r])).standard_normal(out.shape))
            shared["in_backward"][r] = False
            reducers[r].finish()
            opts[r].step()
        except Exception as e:  # reported below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    n = len(whole.parameters())
    for r in range(size):
        assert len(shared["started"][r]) == n and all(during for _, during in shared["started"][r]), shared["started"]
    want = whole.state_dict()
    for m in replicas:
        got = m.state_dict()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-15, err_msg=k)
    one = zero.ShardedReducer(SingleProcess(), opts[0])  # a bucket left unreported is an error, not a silent skip
    one.attach(build())
    one.begin_step(1.0)
    with pytest.raises(RuntimeError, match=f"0 of {n} buckets were started"):
        one.finish()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process in /proc")
def test_a_killed_replica_ends_a_sharded_job_within_30_s(tmp_path):
    """SIGKILL to one replica of --zero 3 (no word to anyone): the other, waiting in a collective (a layer's
    gather, most likely), is ended by mpiexec within 30 s."""
    import signal
    import time

    from test_distributed import signal_rank

    p = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "pydtnn", "--num_epochs", "50", "--zero", "3",
                          "--optimizer", "adam", "--progress", "false", "--metrics_file", str(tmp_path / "m.jsonl")],
                         stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        signal_rank(p, "pydtnn: adam, learning rate", 1, signal.SIGKILL)
        start = time.monotonic()
        p.communicate(timeout=30)
        assert time.monotonic() - start < 30
    finally:
        p.kill()
    assert p.returncode != 0
