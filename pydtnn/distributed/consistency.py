"""Start every rank from rank 0's state: never rely on equal seeds."""


def broadcast_state(comm, model, optimizer=None):
    """Copy rank 0's parameters, buffers and optimizer state (arrays, step, hyperparameters) to all ranks."""
    if comm.size == 1:
        return
    for _, arr in model.named_state():
        comm.bcast(arr, root=0)
    if optimizer is not None:
        state = optimizer.state_dict()
        for name in sorted(state["arrays"]):
            comm.bcast(state["arrays"][name], root=0)
        scalars = comm.bcast_obj(state["scalars"], root=0)
        optimizer.load_state_dict({"arrays": state["arrays"], "scalars": scalars})
