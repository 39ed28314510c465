"""ZeRO stage 3 (--zero 3): each replica keeps its shard of the parameters only; each layer's are gathered just
before its forward and its backward, the next layer's gather started while it computes, and let go after.

In-process tests drive zero_params.ParamShards through a communicator that records its gathers; the N-process
equalities with plain data parallelism are in test_zero.py, beside stages 1 and 2's.
"""

import gc
import weakref

import numpy as np
import pytest
from test_pipeline import final, same_files
from test_zero import ThreadComm, assert_close, traced_summary, train

from pydtnn import models, optim
from pydtnn.backends import CPUBackend
from pydtnn.distributed import zero
from pydtnn.distributed.comm import SingleProcess
from pydtnn.layers.blocks import Container


class Recording(SingleProcess):
    """One replica whose gathers are noted in `log` as ("start", span) when started and ("wait", span) when
    waited for, and whose every hook call notes the bytes of parameters gathered at that moment."""

    def __init__(self, log):
        self.log = log

    def iallgatherv(self, send, recv, counts, label=""):
        recv[...] = send
        log, span = self.log, int(label.rsplit(" ", 1)[1])
        log.append(("start", span))

        class Request:
            def test(self):
                return True

            def wait(self):
                log.append(("wait", span))

        return Request()


def leaves_with_params(model):
    return [layer for _, layer in model.layers() if layer.params and not isinstance(layer, Container)]


def gathered(model):
    """The layers whose parameters are gathered now (views of real bytes, not of the placeholder's none)."""
    return [layer for layer in leaves_with_params(model) if all(any(p.strides) for p in layer.params.values())]


def sharded(model, comm, name="sgd", **hyper):
    return zero.ShardedOptimizer(lambda params: optim.create(name, params, backend=model.backend, **hyper), model,
                                 comm, 3)


def test_each_layer_is_gathered_just_before_it_runs_the_next_while_it_computes():
    """Two SGD steps with momentum on one replica at stage 3 end with plain SGD's parameters, to the bit. In the
    second step each layer's gather is started while the layer with parameters before it runs (after its
    forward, or its backward), and waited for just before the layer runs; the last two layers' backwards reuse
    what their forwards gathered; at most two layers hold their parameters at any time, and the whole arrays the
    model was built with are freed."""
    model = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
    plain = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
    ref = optim.create("sgd", plain.parameters(), backend=plain.backend, lr=0.1, momentum=0.9)
    log = []
    opt = sharded(model, Recording(log), lr=0.1, momentum=0.9)
    first = weakref.ref(model.parameters()[0][1])
    opt.shards.attach()
    gc.collect()
    assert first() is None  # the model's whole arrays are let go
    layers = leaves_with_params(model)
    span = {id(layer): opt.shards.index[id(layer)] for layer in layers}
    most = []
    def noting(layer, phase, f):
        def wrapped(*a):
            log.append(("run", span[id(layer)], phase))
            most.append(len(gathered(model)))
            assert layer in gathered(model)
            return f(*a)
        return wrapped

    for layer in layers:  # note each run, and how many layers hold their parameters then
        layer.forward, layer.backward = noting(layer, "forward", layer.forward), noting(layer, "backward",
                                                                                       layer.backward)
    rng = np.random.default_rng(0)
    for step in range(2):
        x = rng.standard_normal((4, *model.input_shape))
        dy = rng.standard_normal((4, *model.output_shape))
        if step == 1:
            log.clear()
        for m, o in ((model, opt), (plain, ref)):
            m.forward(x)
            m.backward(dy)
            o.step()
    got, want = model.state_dict(), plain.state_dict()
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert max(most) <= 2 and len(gathered(model)) <= 2
    order = [span[id(layer)] for layer in layers]
    cut = log.index(("run", order[-1], "forward")) + 1
    for part, phase, seq in ((log[:cut], "forward", order), (log[cut:], "backward", order[::-1])):
        where = {}
        for i, e in enumerate(part):
            where.setdefault(e, i)  # the first of each event in the pass
        assert all(("run", s, phase) in where for s in seq)
        kept = 0 if phase == "forward" else 2  # backward: the two layers forward gathered last are still held
        assert not any(("start", s) in where for s in seq[:kept])
        for before, after in zip(seq[kept:], seq[kept + 1:]):  # `after` gathered while `before` runs, waited for
            assert where[("start", after)] < where[("run", before, phase)] < where[("wait", after)] \
                < where[("run", after, phase)], (phase, before, after, part)
    assert [log.count(("start", s)) for s in order] == [2] * (len(order) - 2) + [1, 1]
    assert all(isinstance(p, np.ndarray) and not any(p.strides) for layer in layers if layer not in gathered(model)
               for p in layer.params.values())


@pytest.mark.parametrize("accumulation", [1, 3])
def test_nothing_the_trainer_builds_before_the_shards_keeps_the_whole_parameters(accumulation):
    """pydtnn-train builds the Trainer, its Step and the reducer before the replicas agree and the shards take
    over: none of them holds a parameter array, so every whole array is freed once the shards let go."""
    from pydtnn import losses
    from pydtnn.step import Step
    from pydtnn.trainer import Trainer

    model = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
    comm = Recording([])
    opt = sharded(model, comm, "adam")
    reducer = zero.ShardedReducer(comm, opt)
    loss = losses.create("categorical_cross_entropy")
    trainer = Trainer(model, loss, opt, reducer=reducer, accumulation_steps=accumulation, progress=False)
    step = trainer.step
    assert isinstance(step, Step) and reducer.gradients  # attached by the Trainer
    whole = [weakref.ref(p) for _, p, _ in model.parameters()]
    opt.shards.attach()
    gc.collect()
    assert [w for w in whole if w() is not None] == []
    x = np.random.default_rng(0).standard_normal((6, *model.input_shape))
    y = np.eye(10)[np.arange(6) % 10]
    step.run(x, y)
    assert trainer.model is model and len(gathered(model)) <= 2


def test_a_replica_holds_a_quarter_of_the_parameters_at_np_4_and_two_layers_gathered():
    """The shard of replica 0 of 4 (the largest) is a quarter of the parameters, up to an element per layer; the
    memory model's parameters at stage 3 are that shard and the most two layers gathered at once hold, as
    measured while a step runs."""
    from pydtnn.perfmodel import memory, split

    model = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
    total = sum(p.nbytes for _, p, _ in model.parameters())
    spans = zero.layer_spans(model)
    quarter = sharded(model, split.LocalRank0(4)).shards.flat.nbytes
    assert total / 4 <= quarter <= total / 4 + len(spans) * 8
    one = models.create("simplecnn", backend=CPUBackend(np.float64, seed=1))
    opt = sharded(one, Recording([]))
    opt.shards.attach()
    held = []
    for layer in leaves_with_params(one):
        def wrapped(x, training=True, f=layer.forward):
            held.append(sum(h[5].nbytes for h in opt.shards.held if h is not None))
            return f(x, training)
        layer.forward = wrapped
    one.forward(np.zeros((2, *one.input_shape)))
    assert memory.sharded_parameters(model, 4) == quarter + max(held)
    m = memory.predict_memory(model, 8, ("adam", {}), zero=3, replicas=4)
    assert m.parts["parameters"] == quarter + max(held) and m.zero == 3
    two = memory.predict_memory(model, 8, ("adam", {}), zero=2, replicas=4)
    assert m.parts["optimizer"] == pytest.approx(two.parts["optimizer"], rel=0.05)  # the shard's state, as at 2
    assert m.parts["gradients"] == two.parts["gradients"] == total


def test_the_digest_gathers_one_layer_at_a_time_and_equals_the_whole_models():
    """params_sha256 at stage 3 (pydtnn-train's final record) is the unsharded model's digest, and gathering it
    holds less than two layers' parameters beyond the shard, not the whole model (eight layers here)."""
    import tracemalloc

    from pydtnn.layers import Dense
    from pydtnn.model import Model

    def mlp():
        return Model([Dense(64) for _ in range(8)], (64,), backend=CPUBackend(np.float64, seed=3))

    want, model = mlp().params_sha256(), mlp()
    layer = max(p.nbytes for _, p, _ in model.parameters()) * 1.1  # a weight and its bias
    sharded(model, Recording([])).shards.attach()
    gc.collect()
    tracemalloc.start()
    got = model.params_sha256()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == want
    assert peak < 2 * layer < sum(p.nbytes for p in model.param_shards.whole().values()) / 3


@pytest.mark.parametrize("limit", [7, 1 << 20])
def test_the_digest_streams_runs_across_the_replicas_parts(limit):
    """3 replicas (threads): the runs the digest streams, cut at `limit` elements across the replicas' parts of
    each layer, give the unsharded model's digest on every replica."""
    import threading

    from pydtnn.model import params_digest

    want = models.create("simplecnn", backend=CPUBackend(np.float64, seed=4)).params_sha256()
    shared, got = {"sends": [None] * 3, "barrier": threading.Barrier(3, timeout=60)}, {}
    replicas = [models.create("simplecnn", backend=CPUBackend(np.float64, seed=4)) for _ in range(3)]
    shards = [sharded(m, ThreadComm(r, 3, shared)).shards.attach() for r, m in enumerate(replicas)]

    def digest(r):
        names = [n for n, _, _ in replicas[r].parameters()]
        got[r] = params_digest(shards[r].runs(names, limit)), replicas[r].params_sha256()

    threads = [threading.Thread(target=digest, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {r: (want, want) for r in range(3)}


def test_the_time_model_gathers_each_layer_before_it_runs_and_reduce_scatters_per_layer():
    """At 4 replicas, stage 3 sends a reduce-scatter per layer with parameters, and gathers every layer's
    parameters before its forward and, but the last two's (still held), before its backward: no allgather after
    the update;
    the update is the shard's, as at stage 2; the gathers hidden by computation are not exposed."""
    import dataclasses

    from pydtnn.perfmodel import collectives, machine
    from pydtnn.perfmodel.predict import predict

    m = dataclasses.replace(machine.DEFAULT, cores=8, processes_per_node=8)
    model = models.create("simplecnn", backend=CPUBackend(np.float32))
    two, three = (predict(model, 32, 4, m, optimizer="adam", zero=z) for z in (2, 3))
    sizes = [4 * (hi - lo) for _, lo, hi in zero.layer_spans(model)]
    scatter = sum(collectives.seconds("reduce_scatter", "ring", n, 4, m, level="intra") for n in sizes)
    gathers = [collectives.seconds("allgather", "ring", n, 4, m, level="intra") for n in sizes]
    assert three.comm_s == pytest.approx(scatter + 2 * sum(gathers) - gathers[0] - gathers[1], rel=1e-9)  # reversed
    assert three.messages == len(sizes) + 2 * len(sizes) - 2
    assert three.update_s == pytest.approx(two.update_s) and three.zero == 3
    assert 0 < three.exposed_comm_s < three.comm_s
    slow = dataclasses.replace(m, links={k: dataclasses.replace(v, bandwidth_bytes_per_s=v.bandwidth_bytes_per_s / 1e3,
                                                                collectives={}) for k, v in m.links.items()})
    assert predict(model, 32, 4, slow, optimizer="adam", zero=3).exposed_comm_s > 100 * three.exposed_comm_s


@pytest.mark.parametrize("micro,recompute", [(3, "none"), (1, "all"), (2, "segments")])
def test_the_time_model_counts_the_gathers_a_step_makes(micro, recompute):
    """The gathers the time model prices per step are those a step makes (counted in its second step): fewer in
    the micro-batches after the first, whose first two layers the backward before left gathered, and more where
    recomputation runs layers' forwards again."""
    import dataclasses

    from pydtnn import losses
    from pydtnn.perfmodel import machine
    from pydtnn.perfmodel.predict import predict
    from pydtnn.step import Step

    model = models.create("resnet20_cifar10" if recompute == "segments" else "simplecnn",
                          backend=CPUBackend(np.float32, seed=1))
    m = dataclasses.replace(machine.DEFAULT, cores=8, processes_per_node=8)
    p = predict(model, 12, 4, m, optimizer="adam", zero=3, micro_batches=micro, recompute=recompute)
    predicted = p.messages - len(zero.layer_spans(model))  # the rest are the layers' reduce-scatters
    log = []
    opt = sharded(model, Recording(log), "adam")
    step = Step(model, losses.create("categorical_cross_entropy"), opt, accumulation_steps=micro,
                recompute=recompute)
    opt.shards.attach()
    x = np.random.default_rng(0).standard_normal((12, *model.input_shape)).astype(np.float32)
    y = np.eye(10, dtype=np.float32)[np.arange(12) % 10]
    step.run(x, y)
    log.clear()
    step.run(x, y)
    made = sum(e[0] == "start" for e in log)
    # the model takes backward as forward reversed; ResNet's block with a downsampling shortcut runs its main path's
    # backward first, so where it ends a recomputed segment (once here) its shortcut's two layers, left gathered by
    # the segment's forward, are gathered again after the main path's: 2 per micro-batch the model does not count
    assert made - predicted == (2 * micro if recompute == "segments" else 0)


def test_a_traced_stage_3_run_counts_its_gathers_as_communication_in_flight(tmp_path):
    """The layers' gathers run on their own track, as communication beside the phases (none of their own), with
    their waits; the summary says how much was hidden."""
    out, rows = traced_summary(tmp_path, "--zero", "3")
    assert rows and not any(line.startswith(("iallgather", "allgather")) for line in rows), out[-3000:]
    assert "in flight" in out and "hidden behind computation" in out, out[-3000:]
    import json

    events = json.loads((tmp_path / "t.rank0.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert sum(e.get("cat") == "iallgather" for e in events) >= 4 * (2 * 4 - 2)  # simplecnn: 4 layers gathered


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallel", "hybrid", "--model_parallel_size", "2"],
                                    ["--parallel", "hybrid", "--pipeline_stages", "2", "--micro_batches", "2"],
                                    ["--recompute", "all", "--accumulation_steps", "2"]],
                         ids=["model-parallel groups", "pipelines", "recomputed and accumulated"])
def test_stage_3_in_split_models_pipelines_and_recomputation_ends_where_stage_0_ends(tmp_path, layout):
    """np 4: 2 replicas of a model split over 2 processes, or of a 2-stage pipeline (their checkpoint files those
    of --zero 0, to the bit), or 4 replicas recomputing their activations over 2 micro-batches (within 1e-12)."""
    for z in ("0", "3"):
        r = train(4, tmp_path / f"{z}.jsonl", "--optimizer", "adam", *layout, "--zero", z, "--checkpoint_dir",
                  str(tmp_path / z))
        assert r.returncode == 0, r.stderr[-3000:]
    if layout[0] == "--parallel":
        assert final(tmp_path / "3.jsonl")["params_sha256"] == final(tmp_path / "0.jsonl")["params_sha256"]
        same_files(tmp_path / "3", tmp_path / "0")
    else:
        assert_close(tmp_path / "3", tmp_path / "0")


def test_replicas_with_unequal_evaluation_shares_gather_alike(tmp_path):
    """1,000 test images over 3 replicas in batches of 111: 4 batches on the first, 3 on the others, which run a
    blank batch so that every replica gathers as often: the run ends (not hung), with the test loss and accuracy
    --zero 0 gives."""
    flags = ["--batch_size", "111", "--stall_timeout", "30"]
    for z in ("0", "3"):
        r = train(3, tmp_path / f"{z}.jsonl", "--zero", z, *flags, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    got, want = final(tmp_path / "3.jsonl"), final(tmp_path / "0.jsonl")
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-12)
    assert got["test_accuracy"] == want["test_accuracy"]


def test_a_replica_short_of_micro_batches_is_refused_at_stage_3(tmp_path):
    """Every replica must run every micro-batch for the gathers to match: a last global batch of 4 samples over 2
    replicas with 8 micro-batches is refused before training, in one line, not hung on."""
    r = train(2, tmp_path / "m.jsonl", "--zero", "3", "--micro_batches", "8", "--global_batch_size", "54",
              "--steps_per_epoch", "100", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert lines and "--zero 3 with --micro_batches 8: the global batch of 4 samples" in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "m.jsonl").exists()
