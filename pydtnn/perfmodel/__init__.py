"""The performance model: predicted training time from a model, a machine and a parallel scheme.

costs.py        FLOPs and bytes moved per layer and phase of a training step on the CPU backend
machine.py      Machine, Link: a machine description (rates, bandwidths, links), read and written as YAML/JSON
collectives.py  alpha-beta-gamma costs of allreduce, allgather, reduce-scatter and broadcast, by algorithm
cli.py          the pydtnn-perfmodel command (`collective`)

Importing this package imports nothing else; each module is imported where it is used.
"""
