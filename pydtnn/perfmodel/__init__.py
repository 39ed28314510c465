"""The performance model: predicted training time from a model, a machine and a parallel scheme.

costs.py          FLOPs and bytes moved per layer and phase of a training step on the CPU backend
conv_costs.py     the same for a Conv2D: its algorithm's cost (the entry's, in backends/cpu/conv_*.py) plus bias and dW
transformer_costs.py the same for LayerNorm, GELU and the layers of layers/transformer.py
phase_cost.py     PhaseCost (FLOPs and bytes of one phase)
machine.py        Machine, Link: a machine description (rates, bandwidths, links), read and written as YAML/JSON
collectives.py    alpha-beta-gamma costs of allreduce, allgather, reduce-scatter and broadcast, by algorithm
predict.py        one training step predicted: the layers' costs on a machine plus the reducer's messages
step_parts.py     what a predicted step is made of: Prediction, a layer's phases, micro-batches, the reducer's messages
pipelined.py      a pipeline's step: the trainer's cut, each stage's ops (split where it is), the stages' tails
schedule.py       a pipeline step's timeline, every stage's ops in its schedule's order
split.py          model and hybrid parallelism: one process's split layers and its group's collectives
memory.py         one process's memory at a step's peak, measured on a copy of what it holds
table.py          a prediction as text
simulate.py       pydtnn-train --simulate
sweep.py          the five axes of Castello et al. (PDP 2021), as PNGs
calibrate.py      the machine description measured on this machine, put together from the three below
kernel_timing.py  real layers timed forward plus backward: kernel-class rates, thread scaling, bandwidths
overheads.py      the fixed costs of layer calls, optimizer and step, from the Trainer's trace of a tiny model
layer_profile.py  measured layer times (a layer profile), which predict takes in place of the roofline
layer_timing.py   a layer profile measured: a model's own layers timed on one process
mpi_links.py      mpi_probe.py run under mpiexec, and the links fitted on its times
mpi_probe.py      the MPI timings themselves, under mpiexec
cli.py            the pydtnn-perfmodel command (collective, predict, memory, calibrate, sweep, plan, profile)

Importing this package imports nothing else; each module is imported where it is used.
"""
