"""Data-parallel training: communicators (one contract, communicator.py), gradient reducers (registered in
reducers/), wire compression, sharded sampling, launch helpers.

    comm = launch.init()                       # MPI when started by mpirun/mpiexec/srun, else one process
    reducer = reducers.create("bucketed", comm)
    trainer = Trainer(model, loss, opt, comm=comm, reducer=reducer)

Layers never import this package; it sees a model only through Model.parameters() and the
gradients-ready hook.
"""
