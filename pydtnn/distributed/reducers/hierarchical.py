"""Buckets reduced in two levels: inside each node, then between nodes, then back inside each node.

A bucket (laid out and started as in bucketed.py) is summed into its node's leader (rank 0 of the node,
MPI_Ireduce over the node's ranks), the leaders allreduce it among themselves over the network, and
each leader broadcasts the result to its node (MPI_Ibcast). Only one rank per node sends over the
network, with the node's whole sum: the traffic between nodes is that of one rank per node, where a
flat allreduce has every rank cross the network. Each bucket moves through its three stages as its
requests complete, checked with test() as layers finish (MPI progresses only inside calls here).

Nodes are the ranks that share memory (MPI_COMM_TYPE_SHARED), or blocks of ranks_per_node
consecutive ranks when given (--ranks_per_node: emulated nodes on one machine, or a launcher whose
placement MPI does not see).
"""

import time

from pydtnn.distributed.reducers.bucketed import BucketedReducer
from pydtnn.errors import ConfigError


def node_comms(comm, ranks_per_node=None):
    """(this rank's node communicator, the communicator of the nodes' leaders, or None off a leader)."""
    if ranks_per_node:
        if comm.size % ranks_per_node:
            raise ConfigError(f"--ranks_per_node {ranks_per_node} does not divide the {comm.size} processes")
        node = comm.split(comm.rank // ranks_per_node, comm.rank)
    else:
        node = comm.split_shared()
    leaders = comm.split(0 if node.rank == 0 else 1, comm.rank)
    return node, leaders if node.rank == 0 else None


class _Chain:
    """One bucket's pieces through reduce-to-leader, allreduce among leaders, broadcast from the leader.

    Collectives must be started in the same order on every rank of a communicator, whenever their
    predecessors complete: a bucket's leader allreduce starts only after every earlier bucket's has
    (the reducer's `next_allreduce`), and the broadcasts start in finish(), in bucket order."""

    def __init__(self, reducer, seq, pieces, label):
        self.reducer, self.seq, self.pieces, self.label = reducer, seq, pieces, label
        self.stage, self.reqs = 0, [reducer.node.ireduce(p, 0, label) for p in pieces]

    def _done(self):
        return all(r.test() for r in self.reqs)

    def to_allreduce(self):
        """Start the leaders' allreduce once this bucket reached its leader and its turn has come."""
        r = self.reducer
        if self.stage == 0 and r.next_allreduce == self.seq and self._done():
            self.stage, r.next_allreduce = 1, r.next_allreduce + 1
            self.reqs = [r.leaders.iallreduce(p, self.label) for p in self.pieces] if r.leaders else []
        return self.stage >= 1

    def wait(self):
        """Finish all three stages (earlier buckets have reached their allreduce: finish() goes in order)."""
        while not self.to_allreduce():
            for q in self.reqs:
                q.wait()
        for q in self.reqs:
            q.wait()
        self.reqs = [self.reducer.node.ibcast(p, 0, self.label) for p in self.pieces]
        for q in self.reqs:
            q.wait()
        self.stage = 3


class HierarchicalReducer(BucketedReducer):
    name = "hierarchical"

    def __init__(self, comm, bucket_mb=25.0, first_bucket_mb=1.0, compression="none", ranks_per_node=None,
                 progress="test"):
        super().__init__(comm, bucket_mb, first_bucket_mb, compression, progress)
        self.node, self.leaders = node_comms(comm, ranks_per_node)
        self.started = self.next_allreduce = 0

    def _start(self, buf, label):
        self.bytes_reduced += buf.nbytes
        chain = _Chain(self, self.started, self._pieces(buf), label)
        self.started += 1
        return chain, label

    @staticmethod
    def _progress(pending):
        pending[0].to_allreduce()  # called for the started buckets in order (grads_ready)

    def _wait(self, pending):
        start = time.perf_counter_ns()
        pending[0].wait()
        if self.tracer is not None:
            self.tracer.add(f"wait {pending[1]}", "wait", start, time.perf_counter_ns(), tid=1)

    def finish(self):
        super().finish()
        self.started = self.next_allreduce = 0
