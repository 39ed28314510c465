"""Checkpoints: tensors as safetensors, everything else as JSON; crash-safe, resumable, never pickled.

    checkpoint.save("ckpt", model, optimizer, meta={"epoch": 3, "rng": checkpoint.rng_state(model.backend.rng)})
    meta = checkpoint.load("ckpt", model, optimizer)     # validates all, restores both, returns the meta
    checkpoint.set_rng_state(model.backend.rng, meta["rng"])
    checkpoint.load_weights("net.safetensors", model)    # weights only: ours, or a PyTorch state dict

A checkpoint directory holds three files:

    model.safetensors      model.state_dict(): parameters and buffers under their state-dict names;
                           the file to load into another tool, or into PyTorch for the same architecture
    optimizer.safetensors  optimizer.state_dict()["arrays"] (no tensors when saved without an optimizer)
    meta.json              the manifest: format and versions, the SHA-256 of the two files, the
                           architecture fingerprint, the optimizer's kind and scalars, and the caller's
                           `meta` (epoch, configuration, RNG and schedule state, history...)

Crash safety. `save` writes every file to NAME.tmp and fsyncs it, meta.json.tmp last, and only then
renames model, optimizer and finally meta.json into place. A crash before the first rename leaves the
previous checkpoint untouched; a crash during the renames leaves the new one complete, spread over
NAME and NAME.tmp files that its manifest names by SHA-256. So a reader takes the first of meta.json,
meta.json.tmp whose files are all found, under NAME or NAME.tmp, with the recorded SHA-256; anything
else is ignored, and the next `save` finishes or discards what a crash left. One process writes a
directory at a time (rank 0 in a parallel run).

The safetensors encoding and decoding is pydtnn.safetensors_io; the RNG snapshots and the checks of
the trainer's meta are pydtnn.checkpoint_meta, whose rng_state and set_rng_state this module re-exports.
"""

import hashlib
import json
import os
import time

import numpy as np

from pydtnn import __version__, files, safetensors_io
from pydtnn.checkpoint_meta import finite, is_count, json_default, rng_state, set_rng_state
from pydtnn.errors import ConfigError, DataError, ShapeError

__all__ = ["ALL_FILES", "CONFIG_FILE", "EXTRA", "FORMAT", "FORMAT_VERSION", "META_FILE", "MODEL_FILE", "OPTIMIZER_FILE",
           "TENSOR_FILES", "TMP", "fingerprint", "load", "load_weights", "read_manifest", "read_meta", "rng_state",
           "save", "set_rng_state", "write_json_atomic"]  # rng_state, set_rng_state: from pydtnn.checkpoint_meta

FORMAT = "pydtnn-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE, OPTIMIZER_FILE, META_FILE = "model.safetensors", "optimizer.safetensors", "meta.json"
TENSOR_FILES = (MODEL_FILE, OPTIMIZER_FILE)
CONFIG_FILE = "config.json"  # the run's configuration, written beside a checkpoint by pydtnn.resume (not part of one)
ALL_FILES = (*TENSOR_FILES, META_FILE, CONFIG_FILE)  # what a checkpoint directory holds, each also as NAME.tmp
TMP = files.TMP  # NAME.tmp: written but not yet renamed; a crash's leftovers are finished or discarded

_EXPECTED = f"(expected {MODEL_FILE}, {OPTIMIZER_FILE}, {META_FILE})"
_MAX_META = 64 << 20  # meta.json holds numbers and names, never tensors: a bigger one is not ours
_MAX_DEPTH = 100  # JSON nesting in meta.json; ours is under 10, and deeper ones exhaust the recursion limit
_GENERIC_NAME = "model"  # Model's default name: says nothing about the architecture, so it matches any


# -- saving ------------------------------------------------------------------------------------
EXTRA = "@"  # optimizer-file names of state beside the optimizer's (a reducer's residuals): "@reducer.residual"


def save(directory, model, optimizer=None, meta=None, write=True, extra=None):
    """Write a checkpoint of `model` (and `optimizer`) into `directory`, creating it; crash-safe.

    meta: the caller's JSON-serialisable dict, returned by load() (NumPy scalars and arrays are
    converted to numbers and lists). Raises ConfigError when the directory cannot be written.
    Returns the manifest written as meta.json.

    A model split over ranks (model parallelism, or a pipeline's stages) is saved whole, as one process holds
    it: every rank of its group calls save (the state is gathered), and only the one with `write` writes.
    extra: {name: NumPy array} of training state beside the optimizer's (names starting with EXTRA),
    stored in the optimizer file; load() hands them back through its `extras`.
    """
    directory = os.fspath(directory)
    to_numpy = model.backend.to_numpy
    state = model.whole_state_dict()
    whole = optimizer.state_dict() if optimizer is not None else None  # a collective where it is sharded (ZeRO)
    arrays = whole["arrays"] if optimizer is not None else {}
    if model.sharding is not None:
        arrays = {k: model.sharding.gather(model.sharding.param_of_slot(k), v) for k, v in arrays.items()}
    if model.pipeline is not None:  # every stage's slots, onto the first stage
        arrays = model.pipeline.gather({k: to_numpy(v) for k, v in arrays.items()}) or {}
    for k, v in (extra or {}).items():
        if not k.startswith(EXTRA):
            raise ValueError(f"checkpoint extra state {k!r}: expected a name starting with {EXTRA!r}")
        arrays = {**arrays, k: v}
    if not write:
        return None
    blobs = {
        MODEL_FILE: safetensors_io.serialize(state, to_numpy),
        OPTIMIZER_FILE: safetensors_io.serialize(arrays, to_numpy),
    }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "pydtnn_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {name: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for name, b in blobs.items()},
        "model": {
            "name": model.whole_name,
            "backend": model.backend.name,
            "dtype": np.dtype(model.backend.dtype).name,
            "input_shape": list(model.whole_input_shape),
            "state": fingerprint(model),
            "params_sha256": model.params_sha256(whole=state),
        },
        "optimizer": None if optimizer is None else {"kind": optimizer.kind, "scalars": whole["scalars"]},
        "meta": {} if meta is None else meta,
    }
    try:  # before anything touches the disk: a bad meta leaves the directory as it was
        text = json.dumps(manifest, indent=1, default=json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from None
    blobs[META_FILE] = text.encode("utf-8")

    try:
        os.makedirs(directory, exist_ok=True)
        _finish_interrupted_save(directory)
    except OSError as e:
        raise ConfigError(f"cannot write checkpoint directory {directory}: {e.strerror or e}") from None
    for name in (MODEL_FILE, OPTIMIZER_FILE, META_FILE):  # a device or folder there is never replaced by a file
        try:
            kind = files.kind_of(os.stat(os.path.join(directory, name)).st_mode)
        except OSError:
            kind = None
        if kind is not None:
            raise ConfigError(f"cannot write checkpoint file {os.path.join(directory, name)}: it is {kind}; expected "
                              f"a regular file or none")
    try:
        for name in (MODEL_FILE, OPTIMIZER_FILE, META_FILE):  # meta.json.tmp last: it completes the set
            files.write_synced(os.path.join(directory, name + TMP), blobs[name])
    except BaseException as e:
        _discard_tmp(directory)  # no rename happened yet: the previous checkpoint is intact
        if isinstance(e, OSError):
            raise ConfigError(f"cannot write checkpoint to {directory}: {e.strerror or e}") from None
        raise
    try:
        _commit(directory, (MODEL_FILE, OPTIMIZER_FILE, META_FILE))
    except OSError as e:  # the new checkpoint is complete on disk; the next save or load finds it
        raise ConfigError(f"cannot write checkpoint to {directory}: {e.strerror or e}") from None
    return manifest


def fingerprint(model):
    """[[name, shape, dtype], ...] of the model's state dict, in state-dict order."""
    return [[name, list(shape), dtype.name] for name, (shape, dtype) in model.state_layout().items()]


def write_json_atomic(path, obj):
    """Write `obj` as JSON to `path` via a synced temporary file and a rename (creates the folder)."""
    text = json.dumps(obj, indent=1, default=json_default) + "\n"
    files.write_atomic(path, text.encode("utf-8"), make_folder=True)


def _commit(directory, names):
    """Rename NAME.tmp -> NAME for each name, in order, then make the renames durable."""
    for name in names:
        os.replace(os.path.join(directory, name + TMP), os.path.join(directory, name))
    try:  # a directory fsync makes the renames survive power loss; not every platform allows it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _finish_interrupted_save(directory):
    """Complete the renames of a save that a crash interrupted, or discard its partial files."""
    if not any(os.path.exists(os.path.join(directory, n + TMP)) for n in (*TENSOR_FILES, META_FILE)):
        return
    try:
        meta_name, _, files = _find_complete(directory)
        pending = [n for n in TENSOR_FILES if files[n][0] == n + TMP] + [META_FILE] * (meta_name == META_FILE + TMP)
    except (ConfigError, DataError):
        pending = []  # no complete checkpoint among the leftovers: nothing to finish
    _commit(directory, pending)
    _discard_tmp(directory)


def _discard_tmp(directory):
    for name in (*TENSOR_FILES, META_FILE):
        files.remove_if_present(os.path.join(directory, name + TMP))


# -- loading -----------------------------------------------------------------------------------
def load(directory, model, optimizer=None, check_meta=None, extras=None):
    """Restore `model` (parameters and buffers) and `optimizer` from a checkpoint; return its meta.

    Everything is validated before anything is copied, so on error the model and optimizer are as
    they were: ConfigError if `directory` is not a checkpoint or the optimizer is of another kind or
    configuration; DataError if a file is corrupt, truncated (SHA-256 mismatch) or inconsistent with
    its manifest, or holds non-float or non-finite values; ShapeError if the checkpoint is of another
    model (its name, or the first differing state-dict entry). A dtype difference (float32 checkpoint,
    float64 model) is allowed: values are converted. check_meta(meta, path of the manifest), when
    given, is called after every other check and before anything is copied; it raises to refuse.
    The backend RNG is not touched: restore it from the meta with set_rng_state(). extras: a dict that
    receives the optimizer file's extra state (save()'s `extra`), when given.
    """
    directory = os.fspath(directory)
    meta_name, manifest, found = _find_complete(directory)
    meta_path = os.path.join(directory, meta_name)
    where = os.path.join(directory, MODEL_FILE)
    state = safetensors_io.tensors(found[MODEL_FILE][1], where)
    _check_fingerprint(manifest["model"], state, meta_path, where)
    _check_model(manifest["model"], state, model, meta_path, where)
    own = model.state_layout()
    for name, t in state.items():
        _check_values(name, t, own[name][1], where)
    if optimizer is not None:
        saved = manifest["optimizer"]
        if saved is None:
            raise ConfigError(f"checkpoint {directory} has no optimizer state (it was saved without an optimizer)")
        if saved.get("kind") != optimizer.kind:
            raise ConfigError(f"checkpoint {directory} holds {str(saved.get('kind'))[:60]} optimizer state, "
                              f"this run uses {optimizer.kind}; resume with the same optimizer")
        scalars = _check_scalars(saved.get("scalars"), meta_path)
        opt_where = os.path.join(directory, OPTIMIZER_FILE)
        arrays = safetensors_io.tensors(found[OPTIMIZER_FILE][1], opt_where)
        extra = {k: arrays.pop(k) for k in [k for k in arrays if k.startswith(EXTRA)]}
        for name, t in extra.items():
            _check_values(name, t, t.dtype, opt_where)
        if extras is not None:
            extras.update(extra)
        if model.pipeline is not None:  # whole in the file; this stage takes the slots of its own parameters
            others = set(model.pipeline.param_names) - {name for name, _, _ in model.parameters()}
            arrays = {k: v for k, v in arrays.items() if k.rsplit(".", 1)[0] not in others}
        if model.sharding is not None:  # whole in the file; this rank holds its slices
            arrays = {k: model.sharding.cut(model.sharding.param_of_slot(k), v) for k, v in arrays.items()}
        own_dtypes = optimizer.state_dtypes()
        for name, t in arrays.items():
            if name in own_dtypes:  # names the optimizer lacks: its load_state_dict says which
                _check_values(name, t, own_dtypes[name], opt_where)
    if check_meta is not None:
        check_meta(manifest["meta"], meta_path)
    if optimizer is not None:
        try:  # validates names, shapes and every scalar before it copies anything
            optimizer.load_state_dict({"arrays": arrays, "scalars": scalars})
        except ConfigError as e:
            raise ConfigError(f"{meta_path}: {e}") from None
    model.load_state_dict(state)  # validated above: cannot fail half-way
    return manifest["meta"]


def read_meta(directory):
    """The caller's meta of a checkpoint (what load() returns), without a model: verified like load."""
    return _find_complete(os.fspath(directory))[1]["meta"]


def read_manifest(directory):
    """The whole meta.json document of a checkpoint (format, files, model fingerprint, optimizer, meta)."""
    return _find_complete(os.fspath(directory))[1]


def _find_complete(directory):
    """(meta file name, manifest, {tensor file: (file name found, bytes)}) of the complete checkpoint.

    Tries meta.json, then meta.json.tmp (a save interrupted while renaming); each tensor file is
    looked for under NAME and NAME.tmp and must have the SHA-256 the manifest records.
    """
    try:
        kind = files.kind_of(os.stat(directory).st_mode)
    except FileNotFoundError:
        raise ConfigError(f"{directory} is not a pydtnn checkpoint directory: it does not exist {_EXPECTED}") from None
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint directory {directory}: {e.strerror or e}") from None
    if kind != "a directory":
        raise ConfigError(f"{directory} is not a pydtnn checkpoint directory: it is {kind or 'a file'} {_EXPECTED}")
    committed_error = None
    for meta_name in (META_FILE, META_FILE + TMP):
        manifest = _read_manifest_file(os.path.join(directory, meta_name), committed=meta_name == META_FILE)
        if manifest is None:
            continue
        try:
            return meta_name, manifest, _verified_files(directory, meta_name, manifest)
        except DataError as e:
            if meta_name == META_FILE:
                committed_error = e
    if committed_error is not None:
        raise committed_error
    what = "it is empty" if not os.listdir(directory) else f"it has no {META_FILE}"
    raise ConfigError(f"{directory} is not a pydtnn checkpoint directory: {what} {_EXPECTED}")


def _read_manifest_file(path, committed):
    """The manifest at `path`; None if absent (or, for meta.json.tmp, unreadable: a torn write)."""
    try:
        raw = files.read_bytes(path, "checkpoint manifest", _MAX_META, DataError)
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        manifest = None
    except RecursionError:
        manifest = _TOO_DEEP
    if manifest is _TOO_DEEP or (isinstance(manifest, dict) and _depth(manifest) > _MAX_DEPTH):
        if not committed:
            return None
        raise DataError(f"{path} is corrupt: its JSON nests deeper than {_MAX_DEPTH} levels")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        if not committed:
            return None
        raise ConfigError(f"{os.path.dirname(path)} is not a pydtnn checkpoint directory: "
                          f"{path} is not a pydtnn manifest {_EXPECTED}")
    version = manifest.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise DataError(f"{path} is corrupt: format_version is {version!r:.60}; expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise ConfigError(f"{path}: checkpoint format version {version!r}; this pydtnn ({__version__}) reads "
                          f"versions up to {FORMAT_VERSION}: upgrade pydtnn")
    for key, kind in (("files", dict), ("model", dict), ("meta", dict)):
        if not isinstance(manifest.get(key), kind):
            raise DataError(f"{path} is corrupt: {key!r} is missing or not a {kind.__name__}")
    if manifest.get("optimizer") is not None and not isinstance(manifest["optimizer"], dict):
        raise DataError(f"{path} is corrupt: 'optimizer' is not an object")
    return manifest


_TOO_DEEP = object()


def _depth(doc):
    """Nesting depth of a parsed JSON document (iterative: the point is to refuse what recursion cannot take)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, level)
            if level > _MAX_DEPTH:
                break
            stack.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def _verified_files(directory, meta_name, manifest):
    """{tensor file: (NAME or NAME.tmp, bytes)} with the SHA-256 recorded in the manifest."""
    out = {}
    for name in TENSOR_FILES:
        entry = manifest["files"].get(name)
        want = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(want, str):
            raise DataError(f"{os.path.join(directory, meta_name)} is corrupt: no SHA-256 for {name}")
        seen = []
        for candidate in (name, name + TMP):
            path = os.path.join(directory, candidate)
            try:
                data = files.read_bytes(path, "checkpoint file", None, DataError)
            except FileNotFoundError:
                continue
            if hashlib.sha256(data).hexdigest() == want:
                out[name] = (candidate, data)
                break
            seen.append((path, len(data)))
        else:
            path = os.path.join(directory, name)
            if not seen:
                raise DataError(f"{path} is missing; {meta_name} lists it as part of the checkpoint")
            size = dict(seen).get(path, seen[0][1])
            raise DataError(f"{path} is corrupt or truncated: {size} bytes whose SHA-256 differs from the one in "
                            f"{meta_name} (expected {entry.get('bytes')} bytes, SHA-256 {want[:16]}...)")
    return out


def _check_fingerprint(entry, state, path, where):
    """DataError unless the manifest's model.state lists exactly the tensor file's names, shapes and dtypes.

    A manifest without model.state (not written by save) is not checked: the file is still checked
    against the model.
    """
    fp = entry.get("state")
    if fp is None:
        return
    if not (isinstance(fp, list) and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                                         and isinstance(e[1], list) and all(is_count(s) for s in e[1])
                                         and isinstance(e[2], str) for e in fp)):
        raise DataError(f"{path} is corrupt: model.state is {fp!r:.80}; expected a list of [name, shape, dtype]")
    listed = {name: (tuple(shape), dtype) for name, shape, dtype in fp}
    if len(listed) != len(fp):
        raise DataError(f"{path} is corrupt: model.state lists an entry twice")
    for name, (shape, dtype) in listed.items():
        if name not in state:
            raise DataError(f"{path} does not describe {where}: model.state lists {name!r} {shape}, "
                            f"which the tensor file lacks")
        t = state[name]
        if (tuple(t.shape), t.dtype.name) != (shape, dtype):
            raise DataError(f"{path} does not describe {where}: model.state gives {name!r} shape {shape} {dtype}, "
                            f"the tensor file {tuple(t.shape)} {t.dtype.name}")
    extra = [k for k in state if k not in listed]
    if extra:
        raise DataError(f"{path} does not describe {where}: the tensor file has {extra[0]!r}, "
                        f"which model.state does not list")


def _check_model(entry, state, model, path, where):
    """ShapeError unless the checkpoint is of this model: the same name and the same state names and shapes."""
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise DataError(f"{path} is corrupt: model.name is {name!r:.60}; expected a string")
    difference = _architecture_difference(state, model)
    if name is not None and name != model.whole_name and _GENERIC_NAME not in (name, model.whole_name):
        raise ShapeError(f"{path} is a checkpoint of model {name!r}, this model is {model.whole_name!r}"
                         + (f"; {where}: {difference}" if difference else
                            " (with the same state names and shapes); build the same model to load it"))
    if difference:
        raise ShapeError(f"{where} is from another architecture: {difference}")


def _architecture_difference(state, model):
    """The first state-dict entry where `state` and the model differ, in words; None if they agree."""
    own = {name: shape for name, (shape, _) in model.state_layout().items()}
    for name, shape in own.items():
        if name not in state:
            return f"it has no {name!r}, which model {model.name!r} has with shape {shape}"
        if tuple(state[name].shape) != shape:
            return f"{name!r} has shape {tuple(state[name].shape)}, model {model.name!r} has {shape}"
    extra = [k for k in state if k not in own]
    if extra:
        return (f"it has {extra[0]!r} {tuple(state[extra[0]].shape)}, which model {model.name!r} lacks "
                f"({len(extra)} such entries)")
    return None


def _check_values(name, t, dtype, where):
    """DataError unless tensor `t` can become an array of `dtype`: float for float, finite, in range.

    A NaN or Inf loaded into a model would surface as a diverged run blamed on the learning rate;
    an integer tensor would be converted silently into nonsense weights.
    """
    want = np.dtype(dtype)
    if want.kind != "f":
        if t.dtype.kind != want.kind:
            raise DataError(f"{where}: {name!r} is {t.dtype.name}; expected {want.name}")
        return
    if t.dtype.kind != "f":
        raise DataError(f"{where}: {name!r} is {t.dtype.name}; expected float16, bfloat16, float32 or float64")
    finite = np.isfinite(t)
    if not finite.all():
        nan = int(np.isnan(t).sum())
        raise DataError(f"{where}: {name!r} holds {nan} NaN and {t.size - int(finite.sum()) - nan} Inf values "
                        f"(first at flat index {int(np.argmin(finite.ravel()))}); expected finite values "
                        f"(was it saved from a diverged run?)")
    top = np.finfo(want).max
    if np.finfo(t.dtype).max > top and not (np.abs(t) <= top).all():
        raise DataError(f"{where}: {name!r} has values up to {float(np.abs(t).max()):.3g}, beyond "
                        f"{want.name}'s range (+-{float(top):.3g}) of the model")


def _check_scalars(scalars, path):
    """The manifest's optimizer.scalars if they are JSON numbers and flags with an integer step >= 0.

    Their ranges are the optimizer's to check (its load_state_dict); this refuses what would reach it
    as something other than a number.
    """
    if not isinstance(scalars, dict):
        raise DataError(f"{path} is corrupt: optimizer.scalars is {scalars!r:.60}; expected an object")
    for key, value in scalars.items():
        if not isinstance(value, bool) and finite(value) is None:
            raise DataError(f"{path} is corrupt: optimizer.scalars.{key} is {value!r:.60}; "
                            f"expected a finite number or true/false")
    step = scalars.get("step")
    if step is not None and not is_count(step):
        raise DataError(f"{path} is corrupt: optimizer.scalars.step is {step!r:.60}; expected an integer >= 0")
    return scalars


# -- weights only ------------------------------------------------------------------------------
def load_weights(path, model, strict=True):
    """Copy weights into `model` from a .safetensors state dict or a checkpoint directory.

    The file is our model.safetensors or a PyTorch state dict saved with
    safetensors.torch.save_file(module.state_dict(), path) for the same architecture (same names).
    float16, bfloat16, float32 and float64 tensors are converted to the model's dtype;
    `num_batches_tracked` entries (PyTorch BatchNorm) are ignored. Every parameter must be present;
    so must every buffer (BatchNorm running statistics define what evaluation computes) unless
    strict=False, which leaves missing buffers as they are. Unexpected names and shape mismatches
    raise ShapeError naming the entry. Only safetensors is read: a pickle, .pt, .npy or .npz file
    raises ConfigError, and nothing is unpickled. Validates everything before copying.
    Returns the names loaded, in state-dict order.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        where = os.path.join(path, MODEL_FILE)
        tensors = safetensors_io.tensors(_find_complete(path)[2][MODEL_FILE][1], where)
    else:
        where = path
        tensors = safetensors_io.tensors(safetensors_io.read_weights_file(path), where)
    own = model.state_dict()
    buffers = set(own) - {name for name, _, _ in model.parameters()}
    tensors = {k: v for k, v in tensors.items() if not (k.split(".")[-1] == "num_batches_tracked" and k not in own)}
    for name, a in own.items():
        if name not in tensors:
            if name in buffers and not strict:
                continue
            kind = "buffer" if name in buffers else "parameter"
            raise ShapeError(f"{where} has no {name!r}: model {model.name!r} needs this {kind} of shape "
                             f"{tuple(a.shape)}{'; strict=False skips missing buffers' if kind == 'buffer' else ''}")
        t = tensors[name]
        if tuple(t.shape) != tuple(a.shape):
            raise ShapeError(f"{where}: {name!r} has shape {tuple(t.shape)}, "
                             f"model {model.name!r} expects {tuple(a.shape)}")
        _check_values(name, t, a.dtype, where)
    extra = [k for k in tensors if k not in own]
    if extra:
        raise ShapeError(f"{where}: unexpected {extra[0]!r} {tuple(tensors[extra[0]].shape)}, which model "
                         f"{model.name!r} does not have ({len(extra)} unexpected in all; is it the same architecture?)")
    model.load_state_dict(tensors, strict=False)  # missing names are only buffers allowed by strict=False
    return [name for name in own if name in tensors]
