"""The collective cost models against hand-computed values, the machine file, and pydtnn-perfmodel collective."""

import dataclasses
import itertools
import json
import pathlib
import subprocess
import sys

import pytest

from pydtnn.errors import ConfigError
from pydtnn.perfmodel import collectives as C
from pydtnn.perfmodel.cli import main
from pydtnn.perfmodel.machine import DEFAULT, Link, Machine, from_dict, load, save, to_dict

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALPHA, BETA, GAMMA = 1e-5, 1e-9, 5e-10  # 10 us, 1 GB/s, 2 GB/s reduced
N = 1e6


def machine(ppn=1, intra=(ALPHA, 1 / BETA), inter=(ALPHA, 1 / BETA), reduce_rate=1 / GAMMA):
    return Machine(name="test", cores=4, processes_per_node=ppn,
                   rates={"gemm": 1e10, "direct3x3": 5e9, "depthwise": 1e9, "elementwise": 5e8},
                   thread_scaling={1: 1.0, 2: 1.9}, memory_bandwidth=1e10, reduce_rate=reduce_rate,
                   links={"intra": Link(*intra), "inter": Link(*inter)})


# Each value written out for p = 4 (lg p = L = 2, p2 = 4, (p-1)/p = 0.75), n = 1e6 bytes:
# n beta = 1e-3 s, n gamma = 5e-4 s.
HAND_P4 = {
    ("allreduce", "ring"): 2 * 3 * 1e-5 + 2 * 0.75 * 1e-3 + 0.75 * 5e-4,           # 1.935e-3
    ("allreduce", "recursive_doubling"): 2 * (1e-5 + 1e-3 + 5e-4),                 # 3.02e-3
    ("allreduce", "rabenseifner"): 2 * 2 * 1e-5 + 2 * 0.75 * 1e-3 + 0.75 * 5e-4,   # 1.915e-3
    ("allreduce", "binomial_tree"): 2 * (1e-5 + 1e-3 + 5e-4) + 2 * (1e-5 + 1e-3),  # reduce + bcast, 5.04e-3
    ("allgather", "ring"): 3 * 1e-5 + 0.75 * 1e-3,                                 # 7.8e-4
    ("allgather", "recursive_doubling"): 2 * 1e-5 + 0.75 * 1e-3,                   # 7.7e-4
    ("allgather", "binomial_tree"): (2 * 1e-5 + 0.75 * 1e-3) + 2 * (1e-5 + 1e-3),  # gather + bcast, 2.79e-3
    ("reduce_scatter", "ring"): 3 * 1e-5 + 0.75 * (1e-3 + 5e-4),                   # 1.155e-3
    ("reduce_scatter", "recursive_halving"): 2 * 1e-5 + 0.75 * (1e-3 + 5e-4),      # 1.145e-3
    ("reduce_scatter", "recursive_doubling"): 2 * 1e-5 + (2 - 0.75) * (1e-3 + 5e-4),  # 1.895e-3
    ("reduce_scatter", "binomial_tree"): 2 * (1e-5 + 1e-3 + 5e-4) + (2 * 1e-5 + 0.75 * 1e-3),  # 3.79e-3
    ("broadcast", "binomial_tree"): 2 * (1e-5 + 1e-3),                             # 2.02e-3
    ("broadcast", "ring"): (2 + 3) * 1e-5 + 2 * 0.75 * 1e-3,                       # scatter + ring allgather
    ("broadcast", "recursive_doubling"): (2 * 1e-5 + 0.75 * 1e-3) * 2,             # scatter + RD allgather
}
# p = 6: L = 2, p2 = 4, r = 2 processes fold in and out; lg p = 3; (p-1)/p = 5/6.
HAND_P6 = {
    ("allreduce", "ring"): 2 * 5 * 1e-5 + 2 * 5 / 6 * 1e-3 + 5 / 6 * 5e-4,
    ("allreduce", "recursive_doubling"): 2 * (1e-5 + 1e-3 + 5e-4) + (1e-5 + 1e-3 + 5e-4) + (1e-5 + 1e-3),
    ("allreduce", "rabenseifner"): (4 * 1e-5 + 1.5e-3 + 3.75e-4) + (1e-5 + 1e-3 + 5e-4) + (1e-5 + 1e-3),
    ("allreduce", "binomial_tree"): 3 * (2 * 1e-5 + 2 * 1e-3 + 5e-4),
    ("allgather", "recursive_doubling"): (2 * 1e-5 + 0.75 * 1e-3) + (1e-5 + 1e-3 / 6) + (1e-5 + 1e-3),
    ("reduce_scatter", "recursive_halving"): (2 * 1e-5 + 0.75 * 1.5e-3) + (1e-5 + 1.5e-3) + (1e-5 + 1e-3 / 6),
    ("reduce_scatter", "recursive_doubling"): (2 * 1e-5 + 1.25 * 1.5e-3) + (1e-5 + 1.5e-3) + (1e-5 + 1e-3 / 6),
    ("broadcast", "binomial_tree"): 3 * (1e-5 + 1e-3),
    ("broadcast", "ring"): (3 + 5) * 1e-5 + 2 * 5 / 6 * 1e-3,
}


def test_every_formula_has_a_hand_value():
    assert set(HAND_P4) == {(op, a) for op in C.OPS for a in C.FORMULAS[op]}


@pytest.mark.parametrize("p,hand", [(4, HAND_P4), (6, HAND_P6)], ids=["p4", "p6"])
def test_formulas_match_hand_values(p, hand):
    m = machine()
    for (op, algorithm), expected in hand.items():
        formula = C.FORMULAS[op][algorithm]
        assert formula(N, p, ALPHA, BETA, GAMMA) == pytest.approx(expected, rel=1e-12), (op, algorithm)
        assert C.seconds(op, algorithm, N, p, m, level="inter") == pytest.approx(expected, rel=1e-12), (op, algorithm)


def test_textbook_allreduce_of_the_ancestor_example():
    """25M fp32 values over 16 processes at 1 Gbit/s (reference, section 3): the long-message term is
    2 (p-1)/p n beta = 2 * 15/16 * 1e8 B * 8e-9 s/B = 1.5 s."""
    m = machine(inter=(0.0, 1.25e8), reduce_rate=float("1e300"))
    assert C.seconds("allreduce", "rabenseifner", 25_000_000 * 4, 16, m, level="inter") == pytest.approx(1.5)
    assert C.seconds("allreduce", "ring", 25_000_000 * 4, 16, m, level="inter") == pytest.approx(1.5)


def test_hierarchical_by_hand():
    """8 processes, 4 per node (2 nodes). Intra: alpha 1e-6, beta 1e-10; inter: alpha 1e-5, beta 1e-9."""
    m = machine(ppn=4, intra=(1e-6, 1e10), inter=(1e-5, 1e9))
    rs_intra = 3 * 1e-6 + 0.75 * 1e6 * (1e-10 + 5e-10)          # ring reduce-scatter, 4 processes: 4.53e-4
    ar_inter = 2 * 1e-5 + 2 * 0.5 * 1e-3 + 0.5 * 1e6 * 5e-10 / 4  # ring allreduce, 2 nodes, gamma / 4: 1.0825e-3
    ag_intra = 3 * 1e-6 + 0.75 * 1e6 * 1e-10                      # ring allgather, 4 processes: 7.8e-5
    assert C.seconds("allreduce", "hierarchical", N, 8, m) == pytest.approx(rs_intra + ar_inter + ag_intra, rel=1e-12)
    assert C.seconds("allreduce", "hierarchical", N, 8, m) == pytest.approx(1.6135e-3, rel=1e-12)
    rs_inter = 1e-5 + 0.5 * 1e6 * (1e-9 + 5e-10 / 4)              # ring reduce-scatter, 2 nodes, gamma / 4
    assert C.seconds("reduce_scatter", "hierarchical", N, 8, m) == pytest.approx(rs_intra + rs_inter, rel=1e-12)
    ag_inter = 1e-5 + 0.5 * 1e-3                                  # ring allgather, 2 nodes
    assert C.seconds("allgather", "hierarchical", N, 8, m) == pytest.approx(ag_inter + ag_intra, rel=1e-12)
    bcast = (1 + 1) * 1e-5 + 2 * 0.5 * 1e-3 + 2 * (1e-6 + 1e6 * 1e-10)  # vdG among 2 leaders + binomial in a node
    assert C.seconds("broadcast", "hierarchical", N, 8, m) == pytest.approx(bcast, rel=1e-12)
    # a partly filled node costs as a full one: 6 processes on 4 + 2 cost as 8 on 4 + 4
    assert C.seconds("allreduce", "hierarchical", N, 6, m) == C.seconds("allreduce", "hierarchical", N, 8, m)
    # the inner algorithm is the one named: Rabenseifner among 2 nodes, 2 alpha + 2 * 0.5 n beta + 0.5 n gamma/4
    ar_rab = 2 * 1e-5 + 2 * 0.5 * 1e-3 + 0.5 * 1e6 * 5e-10 / 4
    assert C.seconds("allreduce", "hierarchical", N, 8, m, inner="rabenseifner") == pytest.approx(
        rs_intra + ar_rab + ag_intra, rel=1e-12)


def test_node_aware_by_hand():
    """8 processes, 4 per node, an MPI that composes over the nodes: reduce to a leader inside each node, allreduce
    among the 2 leaders, broadcast inside. Intra: alpha 1e-6, beta 1e-10; inter: alpha 1e-5, beta 1e-9."""
    m = dataclasses.replace(machine(ppn=4, intra=(1e-6, 1e10), inter=(1e-5, 1e9)), node_aware_collectives=True)
    reduce_tree = 2 * (1e-6 + 1e6 * (1e-10 + 5e-10))                       # binomial, 4 processes: 1.202e-3
    reduce_rsg = (3 * 1e-6 + 0.75 * 1e6 * 6e-10) + (3 * 1e-6 + 0.75 * 1e-4)  # ring reduce-scatter + gather
    ar_leaders = 2 * 1e-5 + 2 * 0.5 * 1e-3 + 0.5 * 1e6 * 5e-10              # ring, 2 leaders, whole gamma
    bcast_rd = 2 * (2 * 1e-6 + 0.75 * 1e-4)                      # scatter + RD allgather: the cheapest in the node
    assert reduce_rsg < reduce_tree
    assert bcast_rd == pytest.approx(min(f(N, 4, 1e-6, 1e-10) for f in C.FORMULAS["broadcast"].values()), rel=1e-12)
    expected = reduce_rsg + ar_leaders + bcast_rd
    assert C.seconds("allreduce", "ring", N, 8, m) == pytest.approx(expected, rel=1e-12)
    assert C.node_aware("allreduce", N, 8, m) == pytest.approx(expected, rel=1e-12)
    bcast_leaders = (1 + 1) * 1e-5 + 2 * 0.5 * 1e-3                          # vdG among the 2 leaders
    assert C.seconds("broadcast", "ring", N, 8, m) == pytest.approx(bcast_leaders + bcast_rd, rel=1e-12)
    # one leader carries the whole buffer across: less than the flat ring over the 8 on the inter link
    flat = C.seconds("allreduce", "ring", N, 8, m, level="inter")
    assert expected < flat == pytest.approx(C.seconds("allreduce", "ring", N, 8, dataclasses.replace(
        m, node_aware_collectives=False)), rel=1e-12)
    # what MPICH does not compose stays flat, and so does a job on one node or a level named
    assert C.seconds("allgather", "ring", N, 8, m) == C.seconds("allgather", "ring", N, 8, m, level="inter")
    assert C.seconds("allreduce", "ring", N, 4, m) == C.seconds("allreduce", "ring", N, 4, m, level="intra")
    assert C.seconds("allreduce", "hierarchical", N, 8, m) == pytest.approx(1.6135e-3, rel=1e-12)
    with pytest.raises(ConfigError, match="node-aware 'allgather'"):
        C.node_aware("allgather", N, 8, m)
    assert C.node_aware_levels("allreduce", 8, m) == ("intra", "inter")
    assert C.node_aware_levels("allreduce", 8, dataclasses.replace(m, processes_per_node=1)) == ("inter",)
    assert C.node_aware_levels("allreduce", 4, m) is None and C.node_aware_levels("allgather", 8, m) is None


def test_node_aware_pays_the_inter_links_own_fit():
    fit = Link(2e-5, 5e8)
    base = machine(ppn=2, intra=(1e-6, 1e10), inter=(1e-5, 1e9))
    m = dataclasses.replace(base, node_aware_collectives=True,
                            links={"intra": base.links["intra"], "inter": Link(1e-5, 1e9, {"allreduce": fit})})
    local = C.node_aware("allreduce", N, 4, m) - C.allreduce_ring(N, 2, 2e-5, 1 / 5e8, GAMMA)
    plain = dataclasses.replace(m, links={"intra": base.links["intra"], "inter": Link(1e-5, 1e9)})
    assert local == pytest.approx(C.node_aware("allreduce", N, 4, plain) - C.allreduce_ring(N, 2, 1e-5, 1e-9, GAMMA))


def test_node_aware_collectives_in_the_machine_file(tmp_path):
    m = dataclasses.replace(machine(ppn=2), node_aware_collectives=True)
    assert to_dict(m)["node_aware_collectives"] is True and "node_aware_collectives" not in to_dict(machine())
    path = tmp_path / "m.json"
    save(m, str(path))
    assert load(str(path)).node_aware_collectives is True
    with pytest.raises(ConfigError, match="node_aware_collectives = 'yes' is invalid; expected true or false"):
        from_dict({**to_dict(m), "node_aware_collectives": "yes"})


@pytest.mark.parametrize("op", C.OPS)
@pytest.mark.parametrize("p", [2, 3, 4, 7, 16])
def test_hierarchical_with_one_process_per_node_is_the_flat_algorithm(op, p):
    m = machine(ppn=1, intra=(1e-7, 1e11), inter=(3e-5, 2e8))
    for inner in C.FORMULAS[op]:
        flat = C.seconds(op, inner, N, p, m, level="inter")
        assert C.seconds(op, "hierarchical", N, p, m, inner=inner) == pytest.approx(flat, rel=1e-12), inner
        # no algorithm beats the bound: some process receives at least (p-1)/p of the n bytes, in at least
        # one message, over the inter link
        assert flat >= (3e-5 + (p - 1) / p * N / 2e8) * (1 - 1e-12), inner


@pytest.mark.parametrize("op", C.OPS)
def test_one_process_costs_nothing(op):
    m = machine(ppn=2)
    for algorithm in C.algorithms(op):
        assert C.seconds(op, algorithm, N, 1, m) == 0.0, algorithm
    assert C.best(op, N, 1, m)[1] == 0.0


@pytest.mark.parametrize("op", C.OPS)
def test_monotonic_in_bytes_and_processes(op):
    m = machine(ppn=2, intra=(1e-6, 1e10), inter=(1e-5, 1e9))
    for algorithm in C.algorithms(op):
        by_size = [C.seconds(op, algorithm, n, 8, m) for n in (0, 1, 1e3, 1e6, 1e9)]
        assert all(a < b for a, b in itertools.pairwise(by_size)), (algorithm, by_size)
        # powers of two: every algorithm grows with p (between powers, recursive doubling pays a fold)
        by_p = [C.seconds(op, algorithm, N, p, m, level="inter") if algorithm != "hierarchical"
                else C.seconds(op, algorithm, N, p, m) for p in (1, 2, 4, 8, 16, 64)]
        assert all(a < b for a, b in itertools.pairwise(by_p)), (algorithm, by_p)
    for algorithm in ("ring", "binomial_tree"):  # trees and rings grow with every added process
        by_p = [C.seconds(op, algorithm, N, p, m, level="inter") for p in range(1, 40)]
        assert all(a <= b for a, b in itertools.pairwise(by_p)), (algorithm, by_p)
    # a non-power of two pays the fold: 5 processes cost more than 8 for recursive doubling
    rd5, rd8 = (C.seconds(op, "recursive_doubling", N, p, m, level="inter") for p in (5, 8))
    assert rd5 > rd8


def test_level_picks_the_link():
    m = machine(ppn=4, intra=(1e-6, 1e10), inter=(1e-5, 1e9))
    intra = 2 * 3 * 1e-6 + 2 * 0.75 * 1e6 * 1e-10 + 0.75 * 5e-4
    assert C.seconds("allreduce", "ring", N, 4, m) == pytest.approx(intra)  # 4 processes fit on one node
    assert C.seconds("allreduce", "ring", N, 4, m, level="inter") == pytest.approx(HAND_P4["allreduce", "ring"])
    inter5 = C.seconds("allreduce", "ring", N, 5, m, level="inter")
    assert C.seconds("allreduce", "ring", N, 5, m) == pytest.approx(inter5)
    assert C.seconds("allreduce", "ring", N, 4, m.with_link("intra", bandwidth=1e9, latency=1e-5)) == pytest.approx(
        HAND_P4["allreduce", "ring"])


def test_best_picks_the_cheapest():
    m = machine(ppn=1)
    # 1 MB on 4 processes: Rabenseifner (1.915e-3) beats ring (1.935e-3) and recursive doubling (3.02e-3)
    assert C.best("allreduce", N, 4, m) == ("rabenseifner", pytest.approx(HAND_P4["allreduce", "rabenseifner"]))
    # 8 bytes: latency rules, recursive doubling's 2 alpha beats ring's 6 alpha and Rabenseifner's 4 alpha
    name, cost = C.best("allreduce", 8, 4, m)
    assert name == "recursive_doubling" and cost == pytest.approx(2 * (1e-5 + 8e-9 + 4e-9))
    # 1 MB on 6: the fold makes Rabenseifner (4.435e-3) lose to ring (2.18e-3)
    assert C.best("allreduce", N, 6, m)[0] == "ring"
    assert C.best("broadcast", N, 4, m, level="inter")[0] == "recursive_doubling"


@pytest.mark.parametrize("call,words", [
    (lambda m: C.seconds("broadcast", "rabenseifner", N, 4, m), ["'rabenseifner'", "broadcast", "binomial_tree"]),
    (lambda m: C.seconds("allreduce", "recursive_halving", N, 4, m), ["'recursive_halving'", "rabenseifner"]),
    (lambda m: C.seconds("allreduce", "rign", N, 4, m), ["unknown algorithm 'rign'", "did you mean 'ring'"]),
    (lambda m: C.seconds("alltoall", "ring", N, 4, m), ["'alltoall'", "allreduce, allgather"]),
    (lambda m: C.seconds("allreduce", "ring", -1, 4, m), ["-1", ">= 0"]),
    (lambda m: C.seconds("allreduce", "ring", N, 0, m), ["processes 0", ">= 1"]),
    (lambda m: C.seconds("allreduce", "ring", N, 2.0, m), ["processes 2.0", "integer"]),
    (lambda m: C.seconds("allreduce", "ring", N, 4, m, level="rack"), ["'rack'", "intra, inter"]),
    (lambda m: C.seconds("allreduce", "hierarchical", N, 4, m, level="intra"), ["'intra'", "leave the level out"]),
    (lambda m: C.seconds("allreduce", "hierarchical", N, 4, m, inner="hierarchical"), ["'hierarchical'", "ring"]),
    (lambda m: C.seconds("broadcast", "hierarchical", N, 4, m, inner="rabenseifner"), ["'rabenseifner'", "broadcast"]),
])
def test_refused_combinations_name_the_value_and_the_choices(call, words):
    with pytest.raises(ConfigError) as e:
        call(machine())
    for word in words:
        assert word in str(e.value)


# --- the machine description ---------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_machine_round_trip(tmp_path, suffix):
    m = machine(ppn=3, intra=(2e-6, 7.5e9), inter=(4.5e-5, 1.1e8))
    path = tmp_path / f"m{suffix}"
    save(m, path)
    assert load(path) == m
    assert load(path).thread_scaling[2] == 1.9 and load(path).links["inter"].bandwidth_bytes_per_s == 1.1e8
    assert not list(tmp_path.glob("*.tmp"))
    save(DEFAULT, path)
    assert load(path) == DEFAULT


def test_machine_is_read_only_and_with_link_copies():
    m = machine()
    with pytest.raises(TypeError):
        m.rates["gemm"] = 1.0
    faster = m.with_link("inter", bandwidth=1e10)
    assert faster.links["inter"] == Link(ALPHA, 1e10) and m.links["inter"] == Link(ALPHA, 1 / BETA)
    assert faster.links["intra"] == m.links["intra"] and faster.rates == m.rates
    assert m.with_link("intra", latency=0.0).links["intra"] == Link(0.0, 1 / BETA)


def test_fixed_costs_and_class_scaling_round_trip_and_default_to_none(tmp_path):
    from pydtnn.perfmodel.machine import Overheads

    m = dataclasses.replace(machine(), overheads=Overheads(layer_forward_s=2e-5, step_s=4e-4),
                            thread_scaling_by_class={"gemm": {1: 1.0, 2: 1.5}})
    for suffix in (".yaml", ".json"):
        save(m, tmp_path / f"m{suffix}")
        assert load(tmp_path / f"m{suffix}") == m
    assert m.overheads.layer_backward_s == 0.0 and m.overheads.parameter_s == 0.0
    # the class's own scaling where it has one, the machine's otherwise; the largest count measured beyond
    assert m.thread_speedup(2, "gemm") == 1.5 and m.thread_speedup(2, "depthwise") == 1.9
    assert m.thread_speedup(8, "gemm") == 1.5 and m.thread_speedup(2) == 1.9
    serial = dataclasses.replace(m, thread_serial_s={2: 1.5e-4})
    for suffix in (".yaml", ".json"):
        save(serial, tmp_path / f"s{suffix}")
        assert load(tmp_path / f"s{suffix}") == serial and load(tmp_path / f"s{suffix}").serial_s(2) == 1.5e-4
    old = to_dict(machine())  # a file written before these fields existed
    del old["overheads"], old["thread_scaling_by_class"], old["thread_serial_s"]
    loaded = from_dict(old)
    assert loaded.overheads == Overheads() and dict(loaded.thread_scaling_by_class) == {}
    assert dict(loaded.thread_serial_s) == {} and loaded.threaded_seconds(1e-3, 2) == pytest.approx(1e-3 / 1.9)
    with pytest.raises(ConfigError, match=r"thread_serial_s\[2\].*-1e-05"):
        from_dict({**old, "thread_serial_s": {2: -1e-5}})
    partial = from_dict({**old, "overheads": {"parameter_s": "5e-6"}})
    assert partial.overheads == Overheads(parameter_s=5e-6)


def test_per_collective_links_and_the_oversubscribed_wait_round_trip_and_default_to_none(tmp_path):
    from pydtnn.perfmodel.machine import Overheads

    fit = Link(4e-5, 2.5e8)  # an allgather as measured: 40 us, 0.25 GB/s
    fixed = Overheads(layer_forward_s=2e-5, oversubscribed_collective_s=2e-3, layer_calls={"ReLU": (5e-6, 7e-6)})
    assert fixed.call_s("ReLU") == (5e-6, 7e-6) and fixed.call_s("Dense") == (2e-5, 0.0)
    m = dataclasses.replace(machine(ppn=2), overheads=fixed,
                            links={"intra": Link(ALPHA, 1 / BETA, collectives={"allgather": fit}),
                                   "inter": Link(ALPHA, 1 / BETA)})
    for suffix in (".yaml", ".json"):
        save(m, tmp_path / f"m{suffix}")
        loaded = load(tmp_path / f"m{suffix}")
        assert loaded == m and loaded.links["intra"].collectives["allgather"] == fit
        assert loaded.overheads.oversubscribed_collective_s == 2e-3
        assert dict(loaded.overheads.layer_calls) == {"ReLU": (5e-6, 7e-6)}
    old = to_dict(machine())  # no fits: the layout has no "collectives", and a file without them loads
    assert "collectives" not in old["links"]["intra"]
    del old["overheads"]
    loaded = from_dict(old)
    assert dict(loaded.links["intra"].collectives) == {} and loaded.overheads.oversubscribed_collective_s == 0.0
    assert dict(loaded.overheads.layer_calls) == {} and "layer_calls" not in to_dict(machine())["overheads"]
    assert loaded.links["intra"].for_op("allgather") is loaded.links["intra"]
    # a new bandwidth or latency is another link: the fits measured on the old one are dropped
    assert dict(m.with_link("intra", bandwidth=2e9).links["intra"].collectives) == {}


def test_a_collective_pays_its_own_fit_where_the_link_has_one_by_hand():
    """intra: 10 us, 1 GB/s, with an allgather fit of 40 us, 0.25 GB/s; n = 1e6 bytes.
    Ring allgather over 2 on one node: 4e-5 + 0.5 * 1e6 / 2.5e8 = 2.04e-3 s (1e-5 + 5e-4 without the fit).
    Hierarchical allgather over 4, 2 per node: ring across the 2 nodes (1e-5 + 5e-4) + ring in the node on
    the fit (2.04e-3) = 2.55e-3 s. An allreduce has no fit: it pays the link (HAND_P4)."""
    fit = Link(4e-5, 2.5e8)
    m = dataclasses.replace(machine(ppn=4), links={"intra": Link(ALPHA, 1 / BETA, collectives={"allgather": fit}),
                                                   "inter": Link(ALPHA, 1 / BETA)})
    assert C.seconds("allgather", "ring", N, 2, m) == pytest.approx(2.04e-3, rel=1e-12)
    assert C.seconds("allgather", "ring", N, 2, machine(ppn=4)) == pytest.approx(5.1e-4, rel=1e-12)
    assert C.seconds("allreduce", "ring", N, 4, m) == pytest.approx(HAND_P4["allreduce", "ring"], rel=1e-12)
    two_nodes = dataclasses.replace(m, processes_per_node=2)
    assert C.hierarchical("allgather", N, 4, two_nodes) == pytest.approx(2.55e-3, rel=1e-12)
    assert C.best("allgather", N, 2, m)[1] == pytest.approx(2.04e-3, rel=1e-12)


def test_yaml_exponent_without_sign_is_a_number(tmp_path):
    """YAML 1.1 reads 1.25e8 (no sign in the exponent) as text; a user writes it that way."""
    (tmp_path / "n.yaml").write_text(
        "name: x\ncores: 2\nprocesses_per_node: 1\nrates: {gemm: 1.0e10, direct3x3: 1.0e9, depthwise: 1.0e9, "
        "elementwise: 1.0e9}\nthread_scaling: {1: 1.0}\nmemory_bandwidth: 1.0e10\nreduce_rate: 2.0e9\n"
        "links: {intra: {latency_s: 1.0e-6, bandwidth_bytes_per_s: 5.0e9}, "
        "inter: {latency_s: 5.0e-5, bandwidth_bytes_per_s: 1.25e8}}\n")
    m = load(tmp_path / "n.yaml")
    assert m.rates["gemm"] == 1e10 and m.links["inter"].bandwidth_bytes_per_s == 1.25e8 and m.reduce_rate == 2e9


def _with(**changes):
    data = to_dict(machine())
    for key, value in changes.items():
        target = data
        *path, last = key.split("__")
        for part in path:
            target = target[part]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return data


BAD_MACHINES = [
    (_with(cores=0), ["cores", "0", "integer >= 1"]),
    (_with(cores="two"), ["cores", "'two'", "integer >= 1"]),
    (_with(processes_per_node=1.5), ["processes_per_node", "1.5", "integer"]),
    (_with(name=""), ["name", "non-empty string"]),
    (_with(rates__gemm=-1.0), ["rates['gemm']", "-1.0", "> 0", "FLOP/s"]),
    (_with(rates__depthwise=KeyError), ["rates lacks 'depthwise'", "gemm, direct3x3, depthwise, elementwise"]),
    (_with(rates=[1, 2]), ["rates", "[1, 2]", "mapping"]),
    (_with(thread_scaling={2: 1.8}), ["thread_scaling", "1: 1.0"]),
    (_with(thread_scaling={1: 1.0, 0: 0.5}), ["thread_scaling key 0", "integer >= 1"]),
    (_with(memory_bandwidth=float("inf")), ["memory_bandwidth", "inf", "finite"]),
    (_with(reduce_rate=0), ["reduce_rate", "0", "> 0", "bytes/s"]),
    (_with(links__inter__bandwidth_bytes_per_s=0.0), ["links['inter'].bandwidth_bytes_per_s", "0.0", "> 0"]),
    (_with(links__intra__latency_s=-1e-6), ["links['intra'].latency_s", "-1e-06", ">= 0"]),
    (_with(links__intra__speed=1), ["unknown machine field 'speed' of links['intra']", "latency_s"]),
    (_with(links__inter=KeyError), ["links has levels ['intra']", "intra, inter"]),
    (_with(links__rack={"latency_s": 1.0, "bandwidth_bytes_per_s": 1.0}), ["'rack'", "intra, inter"]),
    (_with(memory_bandwidth=KeyError), ["memory_bandwidth missing", "expected all of"]),
    (_with(flops=1), ["unknown machine field 'flops'", "expected only"]),
    (_with(overheads__step_s=-1e-3), ["overheads.step_s", "-0.001", ">= 0", "seconds"]),
    (_with(overheads__layer_s=1e-5), ["unknown machine field 'layer_s' of overheads", "layer_forward_s"]),
    (_with(overheads=[1]), ["overheads", "[1]", "mapping"]),
    (_with(thread_scaling_by_class={"conv": {1: 1.0}}), ["thread_scaling_by_class", "'conv'", "gemm, direct3x3"]),
    (_with(thread_scaling_by_class={"gemm": {2: 1.5}}), ["thread_scaling_by_class['gemm']", "1: 1.0"]),
    (_with(links__intra__collectives={"allgathr": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}}),
     ["links['intra'].collectives", "'allgathr'", "allreduce, allgather, reduce_scatter"]),
    (_with(links__intra__collectives={"allgather": {"latency_s": 1e-5}}),
     ["bandwidth_bytes_per_s", "links['intra'].collectives['allgather']"]),
    (_with(links__intra__collectives={"allgather": {"latency_s": 1e-5, "bandwidth_bytes_per_s": -1.0}}),
     ["links['intra'].collectives['allgather'].bandwidth_bytes_per_s", "-1.0", "> 0"]),
    (_with(overheads__oversubscribed_collective_s=-1.0), ["overheads.oversubscribed_collective_s", ">= 0"]),
    (_with(overheads__layer_calls={"ReLU": {"forward_s": 1e-6}}), ["backward_s", "overheads.layer_calls['ReLU']"]),
    (_with(overheads__layer_calls={"ReLU": {"forward_s": 1e-6, "backward_s": -1.0}}),
     ["overheads.layer_calls['ReLU'].backward_s", "-1.0", ">= 0"]),
    ([1, 2], ["is list", "mapping of fields"]),
]


@pytest.mark.parametrize("data,words", BAD_MACHINES, ids=[", ".join(w[:1]) for _, w in BAD_MACHINES])
def test_bad_machine_fields_name_field_value_and_expectation(data, words):
    with pytest.raises(ConfigError) as e:
        from_dict(data, source="machine file m.yaml")
    message = str(e.value)
    assert message.startswith("machine file m.yaml: ")
    for word in words:
        assert word in message, message


def test_bad_machine_files(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    (tmp_path / "bad.json").write_text("{\"name\": }")
    for name, words in [("bad.yaml", ["not valid YAML", "line"]), ("bad.json", ["not valid JSON", "line 1"]),
                        ("absent.yaml", ["does not exist", "calibrate"])]:
        with pytest.raises(ConfigError) as e:
            load(tmp_path / name)
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ConfigError, match="is a directory"):
        load(tmp_path)


# A machine file nested 100,000 levels deep (recursive parsers fail on it), 40 levels deep (parses, yet no
# machine nests past 5), and YAML aliases standing for a million values (10 lists of 10, six times over).
LAUGHS = "".join(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}' if k else '0'] * 10)}]\n" for k in range(6)) + "name: *l5\n"
NESTED_FILES = [
    ("deep.json", "[" * 100_000 + "]" * 100_000, "deeper than 32 levels"),
    ("deep.yaml", "[" * 100_000 + "]" * 100_000, "deeper than 32 levels"),
    ("dicts.json", '{"a": ' * 100_000 + "1" + "}" * 100_000, "deeper than 32 levels"),
    ("forty.json", "[" * 40 + "]" * 40, "deeper than 32 levels"),
    ("laughs.yaml", LAUGHS, "more than 100,000 values"),
    ("cycle.yaml", "name: &a [*a]\n", "deeper than 32 levels"),
]


@pytest.mark.parametrize("name,text,words", NESTED_FILES, ids=[n for n, _, _ in NESTED_FILES])
def test_a_deeply_nested_machine_file_is_one_line_and_exit_2(tmp_path, capsys, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    assert main(["collective", "--op", "allreduce", "--algorithm", "ring", "--bytes", "8", "--np", "2",
                 "--machine", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pydtnn-perfmodel: error: machine file {path}"), err[:300]
    assert words in err, err[:300]


# --- pydtnn-perfmodel collective -----------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pydtnn.perfmodel.cli", *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_cli_json_schema(tmp_path):
    path = tmp_path / "m.yaml"
    save(machine(ppn=1), path)
    r = run_cli("collective", "--op", "allreduce", "--algorithm", "ring", "--bytes", "1e6", "--np", 4,
                "--machine", path, "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"seconds", "op", "algorithm", "bytes", "np"}
    assert out["op"] == "allreduce" and out["algorithm"] == "ring" and out["bytes"] == 1_000_000 and out["np"] == 4
    assert isinstance(out["bytes"], int) and isinstance(out["np"], int)
    assert out["seconds"] == pytest.approx(HAND_P4["allreduce", "ring"], rel=1e-12)


def test_cli_line_and_level(tmp_path, capsys):
    path = tmp_path / "m.json"
    save(machine(ppn=4, intra=(1e-6, 1e10)), path)
    assert main(["collective", "--op", "broadcast", "--algorithm", "binomial_tree", "--bytes", "1000000", "--np", "4",
                 "--machine", str(path), "--level", "inter"]) == 0
    line = capsys.readouterr().out.strip()
    assert len(line.splitlines()) == 1
    assert "broadcast binomial_tree" in line and "1,000,000 bytes" in line and "inter link" in line
    assert f"{HAND_P4['broadcast', 'binomial_tree'] * 1e3:.6g} ms" in line
    assert main(["collective", "--op", "allreduce", "--algorithm", "hierarchical", "--inner", "rabenseifner",
                 "--bytes", "8", "--np", "8", "--machine", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["algorithm"] == "hierarchical"


def _bad_file(tmp_path):
    data = to_dict(machine())
    data["links"]["inter"]["bandwidth_bytes_per_s"] = -5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


CLI_ERRORS = [
    (["--op", "broadcast", "--algorithm", "rabenseifner"], ["'rabenseifner' does not model broadcast"]),
    (["--op", "allreduc", "--algorithm", "ring"], ["--op", "did you mean 'allreduce'"]),
    (["--op", "allreduce", "--algorithm", "ring", "--level", "rack"], ["--level", "'rack'"]),
    (["--op", "allreduce", "--algorithm", "hierarchical", "--level", "intra"], ["leave the level out"]),
    (["--op", "allreduce", "--algorithm", "hierarchical", "--inner", "tree"], ["inner algorithm 'tree'"]),
    (["--op", "allreduce", "--algorithm", "ring", "--machine", "BAD"],
     ["links['inter'].bandwidth_bytes_per_s = -5", "> 0"]),
    (["--op", "allreduce", "--algorithm", "ring", "--machine", "ABSENT"], ["does not exist"]),
]


@pytest.mark.parametrize("flags,words", CLI_ERRORS, ids=[w[0] for _, w in CLI_ERRORS])
def test_cli_user_errors_exit_2_with_one_line(tmp_path, flags, words):
    flags = [str(_bad_file(tmp_path)) if f == "BAD" else str(tmp_path / "absent.yaml") if f == "ABSENT" else f
             for f in flags]
    r = run_cli("collective", "--bytes", "1e6", "--np", 4, *flags)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pydtnn-perfmodel: error: "), r.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("argv,words", [
    ([], ["required", "COMMAND"]),
    (["collective", "--op", "allreduce", "--algorithm", "ring", "--bytes", "-1", "--np", "4"], ["--bytes", "'-1'"]),
    (["collective", "--op", "allreduce", "--algorithm", "ring", "--bytes", "1.5", "--np", "4"], ["--bytes", "'1.5'"]),
    (["collective", "--op", "allreduce", "--algorithm", "ring", "--bytes", "8", "--np", "0"], ["--np", "'0'"]),
    (["collective", "--op", "allreduce", "--algorithm", "ring", "--bytes", "8"], ["--np"]),
    (["simulate"], ["invalid choice: 'simulate'"]),
])
def test_cli_flag_errors(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pydtnn-perfmodel: error: ")
    for word in words:
        assert word in err[0], err[0]
