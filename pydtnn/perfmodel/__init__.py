"""The performance model: predicted training time from a model, a machine and a parallel scheme.

costs.py        FLOPs and bytes moved per layer and phase of a training step on the CPU backend
machine.py      Machine, Link: a machine description (rates, bandwidths, links), read and written as YAML/JSON
collectives.py  alpha-beta-gamma costs of allreduce, allgather, reduce-scatter and broadcast, by algorithm
predict.py      one training step predicted: the layers' costs on a machine plus the reducer's messages
simulate.py     pydtnn-train --simulate
sweep.py        the five axes of Castello et al. (PDP 2021), as PNGs
calibrate.py    the machine description measured on this machine (mpi_probe.py: the MPI part, under mpiexec)
cli.py          the pydtnn-perfmodel command (collective, predict, sweep, calibrate)

Importing this package imports nothing else; each module is imported where it is used.
"""
