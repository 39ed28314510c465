"""Continuing a run: the configuration a checkpoint holds, the checkpoint a run writes, and what a resumed
run checks before it restores anything (a checkpoint's paths and code are never trusted)."""

import os

import numpy as np

from pydtnn import checkpoint, checkpoint_meta
from pydtnn.errors import ConfigError, DataError
from pydtnn.files import inside

# outputs that a resumed run writes again: inside the checkpoint directory, they follow it when it moves
OUTPUTS = ("metrics_file", "history_file", "tracer_output")
# how a run is laid out over its processes, not what it computes: a checkpoint's are taken all together, or
# (any of them given now) none of them, so that any layout resumes any other
LAYOUT = ("parallel", "model_parallel_size", "pipeline_stages", "pipeline_schedule", "stage_boundaries")


def saved_config(directory):
    """The configuration stored in a checkpoint directory by an earlier run."""
    config = checkpoint.read_meta(directory).get("config", {})
    if not isinstance(config, dict):
        raise DataError(f"{os.path.join(directory, checkpoint.META_FILE)} is corrupt: its 'config' is a "
                        f"{type(config).__name__}; expected an object of flag values")
    return config


def resumed_config(directory, given=None, notes=None):
    """The saved configuration of the checkpoint in `directory`, continued in `directory` itself.

    The run goes on writing checkpoints into `directory` (wherever the checkpoint was first written,
    and wherever it has been moved since), or into the checkpoint_dir given now (a fork). A path from
    a checkpoint is never trusted as a place to write: an output file that was inside the old
    checkpoint directory moves with it (unless a link in the checkpoint leads it out), any other goes
    back to its default, and `notes` (a list, when given) receives a line saying so. `given` ({flag:
    value} set now) are left out, as the caller sets them; where it names any LAYOUT flag, the saved
    layout is left out whole (a pipeline resumed on one process takes none of its stage flags). An evaluation (evaluate_only given) inherits
    no output file: it would replace the run's own metrics with its one record. A model file is never
    taken from a checkpoint: without --model_file given, its checkpoint is refused (ConfigError).
    """
    given = given or {}
    config = saved_config(directory)
    if any(k in given for k in LAYOUT):
        for k in LAYOUT:
            config.pop(k, None)
    saved_file = config.pop("model_file", None)
    if isinstance(saved_file, str) and "model_file" not in given:  # code to run never comes from a checkpoint
        raise ConfigError(f"checkpoint {directory} was trained on the model of --model_file {saved_file[:300]}; a "
                          f"checkpoint never runs code by itself: give --model_file {saved_file[:300]} again to "
                          f"resume it")
    old = config.get("checkpoint_dir")
    here = os.path.abspath(given.get("checkpoint_dir") or directory)
    if "checkpoint_dir" not in given:
        config["checkpoint_dir"] = here
    for key in OUTPUTS:
        path = config.pop(key, None)  # absent: the flag's default, as for any flag not saved
        if key in given or not isinstance(path, str):
            continue
        if given.get("evaluate_only") and key != "tracer_output":
            config[key] = None
            continue
        old_abs, moved = os.path.abspath(old) if isinstance(old, str) else None, None
        if old_abs is not None and os.path.commonpath([os.path.abspath(path), old_abs]) == old_abs:
            moved = os.path.join(here, os.path.relpath(os.path.abspath(path), old_abs))
            if not inside(moved, here):  # a symbolic link in the checkpoint directory leads out of it
                moved = None
        if moved is not None:
            config[key] = moved
        elif notes is not None and key == "tracer_output" and config.get("tracing"):
            notes.append(f"pydtnn: the checkpoint's --tracer_output {path[:200]} lies outside it: the trace goes to "
                         f"the default (give --tracer_output to choose)")
        elif notes is not None and key != "tracer_output":
            notes.append(f"pydtnn: the checkpoint's --{key} {path[:200]} lies outside it and is not written "
                         f"again; give --{key} to write one")
    return config


def check_checkpoint_dir(directory, resume=None, overwrite=False):
    """A fresh run never replaces another run's checkpoint unless asked (--overwrite); resuming
    writes on into the directory it resumed from."""
    from pydtnn.files import check_writable

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"cannot write checkpoint directory {directory}: it exists and is not a directory")
    long = [c for c in os.path.abspath(directory).split(os.sep) if len(os.fsencode(c)) > 255]
    if long:  # made with the first checkpoint: found here, not after an epoch
        raise ConfigError(f"cannot write checkpoint directory {directory[:120]}...: its folder name {long[0][:40]}... "
                          f"is {len(os.fsencode(long[0]))} bytes; expected at most 255")
    check_writable(os.path.join(directory, checkpoint.META_FILE), "checkpoint directory", made=directory)
    for name in checkpoint.ALL_FILES:  # each file a save writes, and its temporary name
        for tmp in ("", checkpoint.TMP):
            check_writable(os.path.join(directory, name + tmp), "checkpoint file", made=directory)
    held = [n for n in (checkpoint.META_FILE, checkpoint.META_FILE + checkpoint.TMP, *checkpoint.TENSOR_FILES)
            if os.path.lexists(os.path.join(directory, n))]
    if not held or overwrite or (resume and _same_dir(directory, resume)):
        return
    try:
        meta = checkpoint.read_manifest(directory)
        what = f"a checkpoint of {meta['model'].get('name')!r} after epoch {meta['meta'].get('epoch')}"
    except Exception:  # any content at all is protected; the description is a courtesy
        what = f"checkpoint files ({', '.join(held)})"
    raise ConfigError(f"checkpoint directory {directory} already holds {what}; pass --resume {directory} to "
                      f"continue it, --overwrite to replace it, or choose another --checkpoint_dir")


def _same_dir(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def save_checkpoint(directory, trainer, epoch, config, effective=None):
    """Everything a resumed run needs to continue bit-identically after `epoch` (0-based) ended.

    Every rank's checkpoint callback calls it. Rank 0 writes; the parameters are identical on every rank, or
    (model parallelism, a pipeline's stages) gathered from every rank of its group, which all take part, as
    every rank does where the reducer keeps state of its own (topk's residuals) or the optimizer's state is
    sharded over the replicas (ZeRO); any other rank has nothing to add and returns.
    """
    model = trainer.model
    if not (trainer.is_root or model.sharding is not None or model.pipeline is not None
            or reducer_keeps_state(trainer.reducer) or trainer.optimizer.sharded):
        return
    meta = {
        "epoch": epoch + 1,
        "config": config,
        "step": trainer.optimizer.t,
        "world_size": trainer.world_size,
        "rng": checkpoint.rng_state(trainer.model.backend.rng),
        "base_lr": trainer.base_lr,
        "schedules": [s.state_dict() for s in trainer.schedules],
        "callbacks": [getattr(c, "state_dict", dict)() for c in trainer.callbacks],
        "history": trainer.history,
    }
    if effective and "tokenizer" in effective:  # a text model's vocabulary: what its ids mean
        meta["tokenizer"] = effective["tokenizer"]
    checkpoint.save(directory, trainer.model, trainer.optimizer, meta, write=trainer.is_root,
                    extra=reducer_state(trainer))
    if not trainer.is_root:
        return
    # a readable copy of the configuration, written with the checkpoint (never before a run has one); it
    # is a valid --config file: load_config_file skips the "effective" values computed from the flags
    checkpoint.write_json_atomic(os.path.join(directory, checkpoint.CONFIG_FILE),
                                 {**config, "effective": effective or {}})


def reducer_keeps_state(reducer):
    """Whether a reducer (None: none) keeps state of its own that a checkpoint holds (topk's residuals)."""
    return reducer is not None and bool(reducer.state_dict())


def reducer_state(trainer):
    """{"@reducer.<name>": every replica's array, stacked (replicas, N)} of a reducer with state of its own (topk's
    residuals), in the whole model's layout (whole_columns), whatever the layout that ran: a collective over the
    replicas, and over the model-parallel group and the pipeline where the model is split, so every rank's
    checkpoint callback calls it. Only the rank that writes gets the arrays."""
    reducer, model = trainer.reducer, trainer.model
    own = reducer.state_dict() if reducer is not None else {}
    out = {}
    for name, a in sorted(own.items()):
        a = np.ascontiguousarray(model.backend.to_numpy(a))
        rows = trainer.comm.size
        every = np.empty((rows,) + a.shape, a.dtype)
        trainer.comm.allgatherv(a.reshape(-1), every.reshape(-1), [a.size] * rows, "reducer state")
        shapes = {n: tuple(g.shape) for n, _, g in model.parameters()}
        pieces = {n: np.moveaxis(every[:, lo:hi].reshape((rows,) + shapes[n]), 0, -1)  # a parameter's rows first
                  for n, (lo, hi) in reducer.param_spans().items()}
        if model.sharding is not None:
            pieces = {n: model.sharding.gather(n, v) for n, v in pieces.items()}
        if model.pipeline is not None:
            pieces = model.pipeline.gather(pieces) or {}
        if pieces and trainer.is_root:
            out[f"{checkpoint.EXTRA}reducer.{name}"] = np.concatenate(
                [np.moveaxis(pieces[n], -1, 0).reshape(rows, -1) for n, _ in whole_columns(model)], axis=1)
    return out


def whole_columns(model):
    """[(parameter name, whole shape)] in the order of a checkpoint's reducer state: the whole model's parameters
    in reverse order, as the gradient buffer of one process lays them out (Model._flatten_grads)."""
    layout = model.state_layout()
    names = model.pipeline.param_names if model.pipeline is not None else [n for n, _, _ in model.parameters()]
    return [(n, tuple(layout[n][0])) for n in reversed(names)]


def own_columns(trainer, whole):
    """This rank's reducer state (flat, as its reducer lays it out) of one row of the whole model's (whole_columns):
    the columns of its own parameters, cut where the model is split over a group."""
    reducer, model = trainer.reducer, trainer.model
    at, off = {}, 0
    for n, shape in whole_columns(model):
        size = int(np.prod(shape, dtype=np.int64))
        at[n], off = whole[off:off + size].reshape(shape), off + size
    spans = reducer.param_spans()
    out = np.zeros(max((hi for _, hi in spans.values()), default=0), whole.dtype)
    for n, (lo, hi) in spans.items():
        piece = at[n] if model.sharding is None else model.sharding.cut(n, at[n])
        out[lo:hi] = piece.reshape(-1)
    return out


def check_reducer_state(trainer, extras, where, saved_ranks=None):
    """ConfigError, before anything is restored, where the checkpoint's reducer state (its extras) is not the kind
    this run's reducer keeps (topk saved with momentum correction, residuals and velocities, resumed without it, or
    the reverse); DataError where an array is not what a reducer saves: floating point, one row per saved rank
    (saved_ranks, the meta's world_size), each row the whole model's gradients (whole_columns)."""
    prefix = f"{checkpoint.EXTRA}reducer."
    saved = {k[len(prefix):]: v for k, v in extras.items() if k.startswith(prefix)}
    own = trainer.reducer.state_dict() if trainer.reducer is not None else {}
    if saved and own and set(saved) != set(own):
        if "q" not in saved and "q" not in own:  # both topk's: with and without momentum correction
            how = ("give --momentum_correction true as the saved run did" if "velocity" in saved else
                   "the saved run had no --momentum_correction: resume without it")
        else:  # another reducer's state (topk's residual and velocity, powersgd's residual and q)
            how = "resume with the --reduction the saved run had"
        raise ConfigError(f"{where}: the checkpoint's reducer state is {', '.join(sorted(saved))}, this run's reducer "
                          f"keeps {', '.join(sorted(own))}; {how}")
    width = sum(int(np.prod(shape, dtype=np.int64)) for _, shape in whole_columns(trainer.model))
    for name, every in saved.items():
        shape = (width,) if name in own else None
        rows = "any" if saved_ranks is None else saved_ranks
        if (every.dtype not in (np.float32, np.float64) or every.ndim < 1
                or (saved_ranks is not None and every.shape[0] != saved_ranks)
                or (shape is not None and tuple(every.shape[1:]) != shape)):
            raise DataError(f"{where}: reducer state {name} is {every.dtype} of shape {tuple(every.shape)}; expected "
                            f"float32 or float64, {rows} rows (one per saved process) of shape {shape or '(its own)'}")


def restore_reducer(trainer, extras):
    """Give each rank its saved reducer state: its own row at the saved process count; at another count rank 0
    takes the sum of the rows (topk: every gradient not yet sent stays in the run) and the others zeros, but
    every rank row 0 of what the reducer keeps the same on every rank (its shared_state). A run
    without such a reducer (one process) has nowhere to put it: it says what is dropped."""
    reducer, prefix = trainer.reducer, f"{checkpoint.EXTRA}reducer."
    state = {k[len(prefix):]: v for k, v in extras.items() if k.startswith(prefix)}
    if state and (reducer is None or not reducer.state_dict()) and any(np.any(v) for v in state.values()):
        rows = next(iter(state.values())).shape[0]
        trainer.log(f"pydtnn: note: the checkpoint's reducer state ({', '.join(sorted(state))} of its {rows} "
                    f"processes: what they had not sent yet) is dropped: this run has no reducer to hold it")
    if reducer is None or not state or not reducer.state_dict():
        return
    rank, size = trainer.comm.rank, trainer.comm.size
    mine = {}
    for name, every in state.items():
        if every.shape[0] == size:
            row = every[rank]
        elif name in reducer.shared_state:  # the same on every rank (powersgd's Q): any row is every rank's
            row = every[0]
        else:
            row = every.sum(axis=0) if rank == 0 else np.zeros_like(every[0])
        mine[name] = own_columns(trainer, row)
    reducer.load_state_dict(mine)


def resume(directory, trainer, lr=None, scaled=False):
    """Restore a checkpoint into a freshly built trainer; returns the epoch to start from.

    lr: a learning rate given on the command line now, which wins over the saved one. scaled: the
    rate follows the process count (linear scaling), so a resume at another count rescales it.
    """
    restorable = {"schedules": [s.state_dict() for s in trainer.schedules],
                  "callbacks": [getattr(c, "state_dict", dict)() if hasattr(c, "load_state_dict") else None
                                for c in trainer.callbacks]}

    def check(meta, where):  # before anything is restored: a refused checkpoint leaves the trainer as it was
        checkpoint_meta.check_training_meta(meta, where, trainer.model.backend.rng, restorable)
        check_reducer_state(trainer, extras, where, meta.get("world_size"))

    extras = {}
    meta = checkpoint.load(directory, trainer.model, trainer.optimizer, check_meta=check, extras=extras)
    restore_reducer(trainer, extras)
    if trainer.reducer is not None:  # a reducer that counts steps (powersgd's start) counts on from the saved one
        trainer.reducer.resume_at(meta["step"])
    checkpoint.set_rng_state(trainer.model.backend.rng, meta["rng"])
    base = meta["base_lr"] * (trainer.world_size / meta.get("world_size", 1) if scaled else 1)
    for s, state in zip(trainer.schedules, meta["schedules"]):
        s.load_state_dict(state)
    for c, state in zip(trainer.callbacks, meta["callbacks"]):
        if hasattr(c, "load_state_dict"):
            c.load_state_dict(state)
    trainer.restore(history=meta["history"], base_lr=lr if lr is not None else base)
    trainer.log(f"pydtnn: resumed {directory} after epoch {meta['epoch']}")
    return meta["epoch"]
