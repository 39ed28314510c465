"""Alpha-beta-gamma costs of collective operations, named by algorithm.

A message of m bytes between two processes costs alpha + m*beta seconds, and adding m bytes of one
buffer into another costs m*gamma (Hockney's model with a reduction term, as in Chan, Heimlich,
Purkayastha and van de Geijn 2007; the algorithms and their costs follow Thakur, Rabenseifner and
Gropp 2005). alpha: latency (s); beta: s per byte (1/bandwidth); gamma: s per byte reduced
(1/Machine.reduce_rate). Every cost is in seconds; p = 1 costs 0.

n is the size in bytes of the whole vector:
  allreduce       each process's buffer (reduced in place)
  allgather       the gathered result (each process contributes n/p)
  reduce_scatter  each process's input (each keeps n/p of the reduced sum)
  broadcast       the root's buffer

Notation: lg p = ceil(log2 p) for trees; for recursive doubling and halving, L = floor(log2 p),
p2 = 2**L and r = p - p2. When p is not a power of two (r > 0) those algorithms run on p2 processes
after r of them fold into a partner, and unfold at the end (Thakur et al., section 4): one exchange
before and one after, whose cost is added to the power-of-two formula on p2:
  allreduce       fold alpha + n*beta + n*gamma,   unfold alpha + n*beta
  reduce_scatter  fold alpha + n*beta + n*gamma,   unfold alpha + (n/p)*beta
  allgather       fold alpha + (n/p)*beta,         unfold alpha + n*beta
This is why recursive doubling costs more on 5 processes than on 8.

Flat algorithms pay one link for every step: `level` ("intra" or "inter"; by default "intra" when all
p processes fit on one node, "inter" otherwise). The hierarchical algorithm uses both (see hierarchical()).
Where the machine's MPI library composes its collectives over the nodes (Machine.node_aware_collectives), an
allreduce or broadcast over processes on more than one node, at the default level, is that composition with
the named algorithm among the nodes (see node_aware()).
Where the machine's link has a fit of its own for the operation (Link.collectives, measured by
calibrate's MPI probe on that operation), alpha and beta are that fit's: the formula is the same, the
link is the one that operation was seen to pay.
"""

import math
import numbers

from pydtnn.errors import ConfigError

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast")
HIERARCHICAL = "hierarchical"
NODE_AWARE_OPS = ("allreduce", "broadcast")  # what MPICH composes over the nodes (its SMP collectives)


def _fold(p):
    """(L, p2, r): L = floor(log2 p), p2 = 2**L, r = p - p2."""
    L = p.bit_length() - 1
    return L, 1 << L, p - (1 << L)


def _lg(p):
    """ceil(log2 p): the depth of a binomial tree over p processes."""
    return (p - 1).bit_length()


# --- allreduce -----------------------------------------------------------------------------------------

def allreduce_ring(n, p, alpha, beta, gamma):
    """Ring reduce-scatter, then ring allgather: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma."""
    f = (p - 1) / p
    return 2 * (p - 1) * alpha + 2 * f * n * beta + f * n * gamma


def allreduce_recursive_doubling(n, p, alpha, beta, gamma):
    """Whole vectors exchanged with partners at distance 1, 2, 4, ...: L (alpha + n beta + n gamma),
    plus the fold and unfold (2 alpha + 2 n beta + n gamma) when p is not a power of two."""
    L, _, r = _fold(p)
    cost = L * (alpha + n * beta + n * gamma)
    if r:
        cost += (alpha + n * beta + n * gamma) + (alpha + n * beta)
    return cost


def allreduce_rabenseifner(n, p, alpha, beta, gamma):
    """Reduce-scatter by recursive halving, then allgather by recursive doubling, on p2 processes:
    2 L alpha + 2(p2-1)/p2 n beta + (p2-1)/p2 n gamma, plus the fold and unfold
    (2 alpha + 2 n beta + n gamma) when p is not a power of two."""
    L, p2, r = _fold(p)
    f = (p2 - 1) / p2
    cost = 2 * L * alpha + 2 * f * n * beta + f * n * gamma
    if r:
        cost += (alpha + n * beta + n * gamma) + (alpha + n * beta)
    return cost


def allreduce_binomial_tree(n, p, alpha, beta, gamma):
    """Binomial-tree reduce to a root, then binomial-tree broadcast:
    lg p (alpha + n beta + n gamma) + lg p (alpha + n beta) = lg p (2 alpha + 2 n beta + n gamma)."""
    return _lg(p) * (2 * alpha + 2 * n * beta + n * gamma)


# --- allgather -----------------------------------------------------------------------------------------

def allgather_ring(n, p, alpha, beta, gamma=0.0):
    """Each process passes one block of n/p bytes on, p-1 times: (p-1) alpha + (p-1)/p n beta."""
    return (p - 1) * alpha + (p - 1) / p * n * beta


def allgather_recursive_doubling(n, p, alpha, beta, gamma=0.0):
    """Blocks doubling in size with partners at distance 1, 2, 4, ...: L alpha + (p2-1)/p2 n beta,
    plus the fold (alpha + n/p beta) and unfold (alpha + n beta) when p is not a power of two."""
    L, p2, r = _fold(p)
    cost = L * alpha + (p2 - 1) / p2 * n * beta
    if r:
        cost += (alpha + n / p * beta) + (alpha + n * beta)
    return cost


def allgather_binomial_tree(n, p, alpha, beta, gamma=0.0):
    """Binomial-tree gather to a root, then binomial-tree broadcast:
    lg p alpha + (p-1)/p n beta + lg p (alpha + n beta)."""
    return _lg(p) * alpha + (p - 1) / p * n * beta + broadcast_binomial_tree(n, p, alpha, beta)


# --- reduce-scatter ------------------------------------------------------------------------------------

def reduce_scatter_ring(n, p, alpha, beta, gamma):
    """Each process passes a partial sum of n/p bytes on, p-1 times: (p-1) alpha + (p-1)/p n (beta + gamma)."""
    return (p - 1) * alpha + (p - 1) / p * n * (beta + gamma)


def reduce_scatter_recursive_halving(n, p, alpha, beta, gamma):
    """Halves exchanged and reduced with partners at distance p/2, p/4, ... (commutative operations):
    L alpha + (p2-1)/p2 n (beta + gamma), plus the fold (alpha + n beta + n gamma) and unfold
    (alpha + n/p beta) when p is not a power of two."""
    L, p2, r = _fold(p)
    cost = L * alpha + (p2 - 1) / p2 * n * (beta + gamma)
    if r:
        cost += (alpha + n * beta + n * gamma) + (alpha + n / p * beta)
    return cost


def reduce_scatter_recursive_doubling(n, p, alpha, beta, gamma):
    """Partners at distance 1, 2, 4, ..., exchanging all data but what the pair already shares (the form
    for non-commutative operations): L alpha + (L - (p2-1)/p2) n (beta + gamma), plus the fold and
    unfold as for recursive halving when p is not a power of two."""
    L, p2, r = _fold(p)
    cost = L * alpha + (L - (p2 - 1) / p2) * n * (beta + gamma)
    if r:
        cost += (alpha + n * beta + n * gamma) + (alpha + n / p * beta)
    return cost


def reduce_scatter_binomial_tree(n, p, alpha, beta, gamma):
    """Binomial-tree reduce to a root, then binomial-tree scatter:
    lg p (alpha + n beta + n gamma) + lg p alpha + (p-1)/p n beta."""
    return _lg(p) * (alpha + n * beta + n * gamma) + _lg(p) * alpha + (p - 1) / p * n * beta


# --- broadcast -----------------------------------------------------------------------------------------

def broadcast_binomial_tree(n, p, alpha, beta, gamma=0.0):
    """The whole buffer down a binomial tree: lg p (alpha + n beta)."""
    return _lg(p) * (alpha + n * beta)


def broadcast_ring(n, p, alpha, beta, gamma=0.0):
    """Van de Geijn's: binomial-tree scatter, then ring allgather (MPICH's long-message broadcast):
    lg p alpha + (p-1)/p n beta + (p-1) alpha + (p-1)/p n beta = (lg p + p - 1) alpha + 2(p-1)/p n beta."""
    return _lg(p) * alpha + (p - 1) / p * n * beta + allgather_ring(n, p, alpha, beta)


def broadcast_recursive_doubling(n, p, alpha, beta, gamma=0.0):
    """Binomial-tree scatter, then recursive-doubling allgather (MPICH's medium-message broadcast):
    lg p alpha + (p-1)/p n beta + allgather_recursive_doubling(n, p); 2 L alpha + 2(p-1)/p n beta
    when p is a power of two."""
    return _lg(p) * alpha + (p - 1) / p * n * beta + allgather_recursive_doubling(n, p, alpha, beta)


FORMULAS = {
    "allreduce": {"ring": allreduce_ring, "recursive_doubling": allreduce_recursive_doubling,
                  "rabenseifner": allreduce_rabenseifner, "binomial_tree": allreduce_binomial_tree},
    "allgather": {"ring": allgather_ring, "recursive_doubling": allgather_recursive_doubling,
                  "binomial_tree": allgather_binomial_tree},
    "reduce_scatter": {"ring": reduce_scatter_ring, "recursive_halving": reduce_scatter_recursive_halving,
                       "recursive_doubling": reduce_scatter_recursive_doubling,
                       "binomial_tree": reduce_scatter_binomial_tree},
    "broadcast": {"binomial_tree": broadcast_binomial_tree, "ring": broadcast_ring,
                  "recursive_doubling": broadcast_recursive_doubling},
}
ALGORITHMS = tuple(dict.fromkeys(name for table in FORMULAS.values() for name in table)) + (HIERARCHICAL,)


def algorithms(op):
    """The algorithm names that model `op`, flat ones first, then "hierarchical"."""
    _check_op(op)
    return tuple(FORMULAS[op]) + (HIERARCHICAL,)


def default_level(p, machine):
    """The link a flat algorithm over p processes pays: "intra" if they fit on one node, else "inter"."""
    return "intra" if p <= machine.processes_per_node else "inter"


def hierarchical(op, n, p, machine, inner="ring"):
    """Two levels: q = min(processes_per_node, p) processes per node, N = ceil(p / q) nodes (a partly
    filled node costs as much as a full one). Inter-node steps run `inner` among N nodes with each
    local rank taking its own slice at the same time: the node's link carries all slices (n bytes on
    beta) while its q processes reduce in parallel (gamma / q). Intra-node steps run a ring (a binomial
    tree for broadcast) on the intra link.
      allreduce       reduce_scatter_ring(n, q) + inner allreduce(n, N, gamma/q) + allgather_ring(n, q)
      reduce_scatter  reduce_scatter_ring(n, q) + inner reduce_scatter(n, N, gamma/q)
      allgather       inner allgather(n, N) + allgather_ring(n, q)
      broadcast       inner broadcast(n, N) among node leaders + broadcast_binomial_tree(n, q)
    With processes_per_node = 1 this is the inner algorithm on the inter link. Each step pays the link
    of its own operation where the level has a fit for it (Link.for_op)."""
    inner_formula = _inner_formula(op, inner)
    _check_size(n, p)
    p = int(p)
    q = min(machine.processes_per_node, p)
    nodes = -(-p // q)
    intra, inter = machine.link("intra"), machine.link("inter")
    A, B = inter.for_op(op).latency_s, inter.for_op(op).beta
    g = machine.gamma

    def local(step):  # (alpha, beta) of the intra-node step `step` (an operation's name)
        link = intra.for_op(step)
        return link.latency_s, link.beta

    if op == "allreduce":
        return (reduce_scatter_ring(n, q, *local("reduce_scatter"), g) + inner_formula(n, nodes, A, B, g / q)
                + allgather_ring(n, q, *local("allgather")))
    if op == "reduce_scatter":
        return reduce_scatter_ring(n, q, *local("reduce_scatter"), g) + inner_formula(n, nodes, A, B, g / q)
    if op == "allgather":
        return inner_formula(n, nodes, A, B, g) + allgather_ring(n, q, *local("allgather"))
    return inner_formula(n, nodes, A, B, g) + broadcast_binomial_tree(n, q, *local("broadcast"))


def reduce_binomial_tree(n, p, alpha, beta, gamma):
    """The whole buffer up a binomial tree to a root, added at each level: lg p (alpha + n beta + n gamma)."""
    return _lg(p) * (alpha + n * (beta + gamma))


def reduce_scatter_gather(n, p, alpha, beta, gamma):
    """Ring reduce-scatter, then a gather of the p blocks to the root (MPICH's long-message reduce):
    2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma."""
    return reduce_scatter_ring(n, p, alpha, beta, gamma) + (p - 1) * alpha + (p - 1) / p * n * beta


def node_aware_levels(op, p, machine):
    """The links a node-aware MPI's `op` over p processes crosses, where the machine's MPI composes it over the
    nodes (Machine.node_aware_collectives, an op of NODE_AWARE_OPS, processes on more than one node): ("inter",)
    with one process a node (the leaders' step alone), else ("intra", "inter"); None where it runs flat."""
    if not (machine.node_aware_collectives and op in NODE_AWARE_OPS and p > machine.processes_per_node):
        return None
    return ("inter",) if machine.processes_per_node == 1 else ("intra", "inter")


def node_aware(op, n, p, machine, inner="ring"):
    """An MPI library's own two-level allreduce or broadcast (MPICH's SMP collectives): q = min(processes_per_node,
    p) processes per node, N = ceil(p / q) nodes.
      allreduce   reduce to each node's leader + `inner` allreduce among the N leaders + broadcast in the node
      broadcast   `inner` broadcast among the N leaders + broadcast in the node
    Unlike hierarchical(), whose inter-node step has every local rank carry its slice, one leader per node carries
    the whole buffer across. The steps inside a node take the cheaper of their formulas (reduce: binomial tree or
    reduce-scatter and gather; broadcast: every broadcast formula) on the intra link; the step among the nodes
    pays the inter link's fit for `op` where it has one."""
    if op not in NODE_AWARE_OPS:
        raise ConfigError(f"node-aware {op!r}: expected one of {', '.join(NODE_AWARE_OPS)}")
    inner_formula = _formula(op, inner)
    _check_size(n, p)
    p = int(p)
    q = min(machine.processes_per_node, p)
    nodes = -(-p // q)
    intra, inter = machine.link("intra"), machine.link("inter").for_op(op)
    g = machine.gamma
    local = (n, q, intra.latency_s, intra.beta, g)
    across = inner_formula(n, nodes, inter.latency_s, inter.beta, g)
    spread = min(f(*local) for f in FORMULAS["broadcast"].values())
    if op == "broadcast":
        return across + spread
    return min(reduce_binomial_tree(*local), reduce_scatter_gather(*local)) + across + spread


def seconds(op, algorithm, nbytes, p, machine, level=None, inner="ring"):
    """Seconds for `op` over p processes on n = nbytes bytes (see the module's docstring for what n is)
    with `algorithm` on `machine`. level: the link a flat algorithm pays (None: default_level);
    inner: the inter-node algorithm of "hierarchical" (which takes no level). A flat algorithm at the default level
    over processes on more than one node is node_aware() where the machine's MPI composes `op` over the nodes."""
    _check_op(op)
    _check_size(nbytes, p)
    if level is None and algorithm != HIERARCHICAL and node_aware_levels(op, p, machine):
        return node_aware(op, nbytes, p, machine, algorithm)
    if algorithm == HIERARCHICAL:
        if level is not None:
            raise ConfigError(f"level {level!r} applies to flat algorithms; {HIERARCHICAL} uses both the intra "
                              "and the inter link (leave the level out)")
        return hierarchical(op, nbytes, p, machine, inner)
    formula = _formula(op, algorithm)
    _check_size(nbytes, p)
    link = machine.link(default_level(p, machine) if level is None else level).for_op(op)
    return formula(nbytes, int(p), link.latency_s, link.beta, machine.gamma)


def best(op, nbytes, p, machine, level=None, inner="ring"):
    """(algorithm, seconds) of the cheapest algorithm for `op`; "hierarchical" (with `inner`) competes only
    when no level is given. Ties go to the earlier name in algorithms(op)."""
    names = [a for a in algorithms(op) if level is None or a != HIERARCHICAL]
    costs = [(seconds(op, a, nbytes, p, machine, level, inner), i, a) for i, a in enumerate(names)]
    cost, _, name = min(costs)
    return name, cost


def _check_op(op):
    if op not in FORMULAS:
        from pydtnn.suggest import did_you_mean

        raise ConfigError(f"unknown collective operation {op!r}{did_you_mean(op, OPS) or ';'} "
                          f"expected one of {', '.join(OPS)}")


def _formula(op, algorithm):
    if algorithm not in FORMULAS[op]:
        from pydtnn.suggest import did_you_mean

        what = f"{algorithm!r} does not model {op}" if algorithm in ALGORITHMS else f"unknown algorithm {algorithm!r}"
        hint = did_you_mean(algorithm, algorithms(op)) if algorithm not in ALGORITHMS else ""
        raise ConfigError(f"{what}{hint or ';'} expected one of {', '.join(algorithms(op))} for {op}")
    return FORMULAS[op][algorithm]


def _inner_formula(op, inner):
    _check_op(op)
    if inner not in FORMULAS[op]:
        raise ConfigError(f"inner algorithm {inner!r} is not a flat algorithm for {op}; expected one of "
                          f"{', '.join(FORMULAS[op])}")
    return FORMULAS[op][inner]


def _check_size(nbytes, p):
    if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1:
        raise ConfigError(f"number of processes {p!r} is invalid; expected an integer >= 1")
    if (isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not math.isfinite(nbytes)
            or nbytes < 0):
        raise ConfigError(f"message size {nbytes!r} bytes is invalid; expected a finite number >= 0")
