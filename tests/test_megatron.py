"""Transformers under model parallelism: TransformerBlock split Megatron's way (attention by heads, the MLP by
columns then rows), N processes equal to one for a GPT and a ViT, and what the performance model is told."""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from pydtnn.distributed import model_parallel
from pydtnn.errors import ConfigError
from pydtnn.layers import Dense, LayerNorm, TransformerBlock
from pydtnn.model import Model

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
GPT_FILE = """
from pydtnn.models.transformer import gpt


def create_model(input_shape, num_classes):
    return gpt(input_shape, num_classes, dim=24, depth=2, heads=3, mlp_dim=40, dropout=0.1, attention_dropout=0.1)
"""
VIT_FILE = """
from pydtnn.models.transformer import vit


def create_model(input_shape, num_classes):
    return vit(input_shape, num_classes, dim=24, depth=2, heads=3, mlp_dim=30, patch=7, dropout=0.1,
               attention_dropout=0.1)
"""
PROSE = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of folly.\n" * 10


class FakeGroup:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def block_model(dropout=0.1):
    return Model([TransformerBlock(12, 3, 20, causal=True, dropout=dropout, attention_dropout=dropout), LayerNorm(),
                  Dense(7)], (5, 12), name="tiny")


def test_a_transformer_block_is_split_by_heads_and_mlp_columns_with_one_sum_per_branch():
    model = block_model()
    whole = {k: v.copy() for k, v in model.state_dict().items()}
    model_parallel.partition(model, FakeGroup(1, 2))  # heads 2:3 of 3 (4 features each), MLP columns 10:20 of 20
    attention, mlp = (dict(dict(dict(model.root.children)["0"].children)[b].children)[""] for b in ("attention", "mlp"))
    assert [n for n, _ in attention.children] == ["ln_1", "attn:sum_dx", "attn", "attn:sum", "drop"]
    assert [n for n, _ in mlp.children] == ["ln_2", "fc:sum_dx", "fc", "gelu", "proj", "proj:sum", "drop"]
    state = model.state_dict()
    rows = np.r_[8:12, 20:24, 32:36]  # this rank's head of q, k and v
    p = "0.attention.attn."
    np.testing.assert_array_equal(state[p + "in_proj_weight"], whole[p + "in_proj_weight"][rows])
    np.testing.assert_array_equal(state[p + "in_proj_bias"], whole[p + "in_proj_bias"][rows])
    np.testing.assert_array_equal(state[p + "out_proj_weight"], whole[p + "out_proj_weight"][:, 8:12])
    np.testing.assert_array_equal(state[p + "out_proj_bias"], whole[p + "out_proj_bias"])
    np.testing.assert_array_equal(state["0.mlp.fc.weight"], whole["0.mlp.fc.weight"][10:20])
    np.testing.assert_array_equal(state["0.mlp.fc.bias"], whole["0.mlp.fc.bias"][10:20])
    np.testing.assert_array_equal(state["0.mlp.proj.weight"], whole["0.mlp.proj.weight"][:, 10:20])
    np.testing.assert_array_equal(state["0.mlp.proj.bias"], whole["0.mlp.proj.bias"])
    attn, proj = dict(attention.children)["attn"], dict(mlp.children)["proj"]
    assert not attn.bias_here and not proj.bias_here  # rank 0 adds the biases of the summed outputs
    assert {k: shape for k, (shape, _) in model.state_layout().items()} == {k: v.shape for k, v in whole.items()}
    assert model.count_params() == sum(v.size for v in whole.values())
    for k, v in whole.items():  # cut() takes this rank's part of any whole array (a checkpoint's)
        np.testing.assert_array_equal(model.sharding.cut(k, v), state[k])


def test_the_whole_state_is_gathered_back_from_every_rank_s_blocks_and_columns():
    ranks = [block_model() for _ in range(3)]
    whole = {k: v.copy() for k, v in ranks[0].state_dict().items()}
    for r, m in enumerate(ranks):
        model_parallel.partition(m, FakeGroup(r, 3))
    states = [m.state_dict() for m in ranks]

    class Gathering:  # gather_rows as the group would: every rank's piece, in rank order
        rank, size = 0, 3

        def gather_rows(self, piece, bounds):
            pieces = [np.moveaxis(s[name], cut.axis, 0) for s in states]
            assert list(bounds) == np.cumsum([0] + [len(p) for p in pieces]).tolist()  # each rank's rows, in order
            np.testing.assert_array_equal(piece, pieces[0])
            return np.concatenate(pieces)

    sharding = model_parallel.Sharding(Gathering(), ranks[0].sharding.slices)
    cuts = sharding.slices.values()
    assert {c.blocks for c in cuts} == {1, 3} and {c.axis for c in cuts} == {0, 1}
    for name, cut in sharding.slices.items():
        np.testing.assert_array_equal(sharding.gather(name, states[0][name]), whole[name])


def test_plan_names_the_sums_partition_inserts_and_the_model_prices_them():
    from pydtnn.perfmodel import machine as machines
    from pydtnn.perfmodel.split import group_messages

    model = block_model()
    steps = model_parallel.plan(model, 2)
    model_parallel.partition(model, FakeGroup(0, 2))
    inserted = [type(layer).__name__ for _, layer in model.root.named_layers()
                if isinstance(layer, model_parallel.SumGrad | model_parallel.SumOutput | model_parallel.Gather)]
    kinds = {"sum_dx": "SumGrad", "sum_output": "SumOutput", "allgather": "Gather"}
    planned = [kinds[s["op"]] for s in steps if "op" in s]
    assert planned == inserted == ["SumGrad", "SumOutput", "SumGrad", "SumOutput"]
    shares = {s["layer"]: s["fraction"] for s in steps if "kind" in s}
    assert shares["0.attention.attn"] == 2 / 3 and shares["0.mlp.fc"] == shares["0.mlp.proj"] == 0.5
    messages = group_messages(steps, 8, 4, 2, machines.DEFAULT, "best")
    assert [(phase, op) for phase, op, _, _ in messages] == [("backward", "allreduce"), ("forward", "allreduce")] * 2
    assert all(nbytes == 8 * 5 * 12 * 4 for _, _, nbytes, _ in messages)


def test_more_processes_than_heads_are_refused_naming_the_most():
    with pytest.raises(ConfigError, match="has 3 heads, fewer than the 4 processes.*at most 3"):
        model_parallel.partition(block_model(), FakeGroup(0, 4))


def run(n, tmp_path, name, *flags):
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, "-m", "pydtnn", *flags,
                                                        "--checkpoint_dir", str(tmp_path / name)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return [load_file(str(tmp_path / name / f)) for f in ("model.safetensors", "optimizer.safetensors")]


def assert_same(want, got, rtol=1e-12):
    for w, g in zip(want, got):
        assert g.keys() == w.keys()
        for k in w:
            scale = np.abs(w[k]).max()
            assert scale > 0 or k.endswith("bias"), k
            err = np.abs(g[k] - w[k]).max() / max(scale, 1e-300)
            assert err <= rtol, f"{k}: relative difference {err:.3g}"


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    (d / "gpt.py").write_text(GPT_FILE)
    (d / "book.txt").write_text(PROSE)
    flags = ("--model_file", "gpt.py", "--dataset", "text", "--dataset_train_path", "book.txt", "--context_length",
             "16", "--dtype", "float64", "--global_batch_size", "8", "--steps_per_epoch", "3", "--num_epochs", "1",
             "--progress", "false")
    return d, flags, run(1, d, "one", *flags)


@pytest.mark.parametrize("n,layout", [(2, ("--parallel", "model")), (2, ("--parallel", "data")),
                                      pytest.param(3, ("--parallel", "model"), marks=pytest.mark.slow),
                                      pytest.param(4, ("--parallel", "hybrid", "--model_parallel_size", "2"),
                                                   marks=pytest.mark.slow),
                                      pytest.param(2, ("--parallel", "pipeline", "--pipeline_stages", "2",
                                                       "--accumulation_steps", "2"), marks=pytest.mark.slow)])
def test_a_gpt_with_dropout_trains_at_any_layout_as_one_process(gpt_run, n, layout):
    """3 heads over 2 ranks (2 + 1) and 3, data parallel, hybrid 2x2, a pipeline cut between the blocks,
    attention and residual dropout on: parameters and optimizer state
    after 3 steps of SGD with momentum equal one process's (float64). (With Adam, the key bias's gradient,
    zero but for rounding, is scaled up to a step of the learning rate's size: its noise would be compared.)"""
    d, flags, one = gpt_run
    assert_same(one, run(n, d, f"{layout[1]}{n}", *flags, *layout))


@pytest.mark.slow
def test_a_vit_split_over_two_processes_trains_as_one(tmp_path):
    """The patch convolution split by channels, the blocks Megatron's way, dropout on."""
    (tmp_path / "vit.py").write_text(VIT_FILE)
    flags = ("--model_file", "vit.py", "--dataset", "mnist5k", "--dtype", "float64", "--global_batch_size", "8",
             "--steps_per_epoch", "3", "--num_epochs", "1", "--progress", "false")
    assert_same(run(1, tmp_path, "one", *flags), run(2, tmp_path, "two", *flags, "--parallel", "model"))
