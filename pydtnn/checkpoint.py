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
"""

import hashlib
import json
import math
import os
import time

import numpy as np

from pydtnn import __version__
from pydtnn.errors import ConfigError, DataError, ShapeError

FORMAT = "pydtnn-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE, OPTIMIZER_FILE, META_FILE = "model.safetensors", "optimizer.safetensors", "meta.json"
TENSOR_FILES = (MODEL_FILE, OPTIMIZER_FILE)
TMP = ".tmp"  # suffix of a file being written (or written but not yet renamed)

_EXPECTED = f"(expected {MODEL_FILE}, {OPTIMIZER_FILE}, {META_FILE})"
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# safetensors dtype -> numpy dtype (little-endian); BF16 is widened to float32 by _decode
_NUMPY_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8",
                 "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?"}
_MAX_HEADER = 100_000_000  # the safetensors limit on the JSON header


# -- saving ------------------------------------------------------------------------------------
def save(directory, model, optimizer=None, meta=None):
    """Write a checkpoint of `model` (and `optimizer`) into `directory`, creating it; crash-safe.

    meta: the caller's JSON-serialisable dict, returned by load() (NumPy scalars and arrays are
    converted to numbers and lists). Raises ConfigError when the directory cannot be written.
    Returns the manifest written as meta.json.
    """
    directory = os.fspath(directory)
    to_numpy = model.backend.to_numpy
    blobs = {
        MODEL_FILE: _serialize(model.state_dict(), to_numpy),
        OPTIMIZER_FILE: _serialize(optimizer.state_dict()["arrays"] if optimizer is not None else {}, to_numpy),
    }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "pydtnn_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {name: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for name, b in blobs.items()},
        "model": {
            "name": model.name,
            "backend": model.backend.name,
            "dtype": np.dtype(model.backend.dtype).name,
            "input_shape": list(model.input_shape),
            "state": fingerprint(model),
            "params_sha256": model.params_sha256(),
        },
        "optimizer": None if optimizer is None else {"kind": optimizer.kind,
                                                     "scalars": optimizer.state_dict()["scalars"]},
        "meta": {} if meta is None else meta,
    }
    try:  # before anything touches the disk: a bad meta leaves the directory as it was
        text = json.dumps(manifest, indent=1, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from None
    blobs[META_FILE] = text.encode("utf-8")

    try:
        os.makedirs(directory, exist_ok=True)
        _finish_interrupted_save(directory)
    except OSError as e:
        raise ConfigError(f"cannot write checkpoint directory {directory}: {e.strerror or e}") from None
    try:
        for name in (MODEL_FILE, OPTIMIZER_FILE, META_FILE):  # meta.json.tmp last: it completes the set
            _write_synced(os.path.join(directory, name + TMP), blobs[name])
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
    return [[name, list(a.shape), np.dtype(a.dtype).name] for name, a in model.state_dict().items()]


def write_json_atomic(path, obj):
    """Write `obj` as JSON to `path` via a synced temporary file and a rename (creates the folder)."""
    write_atomic(path, (json.dumps(obj, indent=1, default=_json_default) + "\n").encode("utf-8"))


def write_atomic(path, data):
    """Write bytes to `path` via a synced temporary file and a rename: readers never see half a file,
    and a failure leaves neither a temporary file nor a broken one (ConfigError naming the path)."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _write_synced(path + TMP, data)
        os.replace(path + TMP, path)
    except OSError as e:
        _remove(path + TMP)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None


def _serialize(arrays, to_numpy):
    """safetensors bytes of {name: array} (copied to host, C-contiguous, little-endian)."""
    import safetensors.numpy

    host = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(to_numpy(a))
        host[name] = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return safetensors.numpy.save(host)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} {o!r:.60} is not JSON-serialisable")


def _write_synced(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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
        _remove(os.path.join(directory, name + TMP))


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


# -- loading -----------------------------------------------------------------------------------
def load(directory, model, optimizer=None):
    """Restore `model` (parameters and buffers) and `optimizer` from a checkpoint; return its meta.

    Everything is validated before anything is copied, so on error the model and optimizer are as
    they were: ConfigError if `directory` is not a checkpoint or the optimizer is of another kind or
    configuration; DataError if a file is corrupt or truncated (SHA-256 mismatch); ShapeError if the
    checkpoint is of another architecture (names the first differing state-dict entry). A dtype
    difference (float32 checkpoint, float64 model) is allowed: values are converted.
    The backend RNG is not touched: restore it from the meta with set_rng_state().
    """
    directory = os.fspath(directory)
    _, manifest, files = _find_complete(directory)
    where = os.path.join(directory, MODEL_FILE)
    state = _tensors(files[MODEL_FILE][1], where)
    _check_architecture(state, model, where)
    if optimizer is not None:
        saved = manifest["optimizer"]
        if saved is None:
            raise ConfigError(f"checkpoint {directory} has no optimizer state (it was saved without an optimizer)")
        if saved.get("kind") != optimizer.kind:
            raise ConfigError(f"checkpoint {directory} holds {saved.get('kind')} optimizer state, "
                              f"this run uses {optimizer.kind}; resume with the same optimizer")
        arrays = _tensors(files[OPTIMIZER_FILE][1], os.path.join(directory, OPTIMIZER_FILE))
        optimizer.load_state_dict({"arrays": arrays, "scalars": saved.get("scalars", {})})  # all or nothing
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
    if not os.path.exists(directory):
        raise ConfigError(f"{directory} is not a pydtnn checkpoint directory: it does not exist {_EXPECTED}")
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory} is not a pydtnn checkpoint directory: it is a file {_EXPECTED}")
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
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        if not committed:
            return None
        raise ConfigError(f"{os.path.dirname(path)} is not a pydtnn checkpoint directory: "
                          f"{path} is not a pydtnn manifest {_EXPECTED}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(f"{path}: checkpoint format version {version!r}; this pydtnn ({__version__}) reads "
                          f"versions up to {FORMAT_VERSION}: upgrade pydtnn")
    for key, kind in (("files", dict), ("model", dict), ("meta", dict)):
        if not isinstance(manifest.get(key), kind):
            raise DataError(f"{path} is corrupt: {key!r} is missing or not a {kind.__name__}")
    if manifest.get("optimizer") is not None and not isinstance(manifest["optimizer"], dict):
        raise DataError(f"{path} is corrupt: 'optimizer' is not an object")
    return manifest


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
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise DataError(f"cannot read {path}: {e.strerror or e}") from None
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


def _check_architecture(state, model, where):
    """ShapeError naming the first state-dict entry where `state` and the model differ."""
    own = model.state_dict()
    for name, a in own.items():
        if name not in state:
            raise ShapeError(f"{where} is from another architecture: it has no {name!r}, which model "
                             f"{model.name!r} has with shape {tuple(a.shape)}")
        if tuple(state[name].shape) != tuple(a.shape):
            raise ShapeError(f"{where} is from another architecture: {name!r} has shape {tuple(state[name].shape)}, "
                             f"model {model.name!r} has {tuple(a.shape)}")
    extra = [k for k in state if k not in own]
    if extra:
        raise ShapeError(f"{where} is from another architecture: it has {extra[0]!r} {tuple(state[extra[0]].shape)}, "
                         f"which model {model.name!r} lacks ({len(extra)} such entries)")


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
        tensors = _tensors(_find_complete(path)[2][MODEL_FILE][1], where)
    else:
        where = path
        tensors = _tensors(_read_weights_file(path), where)
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
        if t.dtype.kind != "f":
            raise DataError(f"{where}: {name!r} is {t.dtype.name}; expected float16, bfloat16, float32 or float64")
    extra = [k for k in tensors if k not in own]
    if extra:
        raise ShapeError(f"{where}: unexpected {extra[0]!r} {tuple(tensors[extra[0]].shape)}, which model "
                         f"{model.name!r} does not have ({len(extra)} unexpected in all; is it the same architecture?)")
    model.load_state_dict(tensors, strict=False)  # missing names are only buffers allowed by strict=False
    return [name for name in own if name in tensors]


def _read_weights_file(path):
    """The bytes of a safetensors file; ConfigError for a missing file or any other format."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"weights file {path} does not exist; "
                          "expected a .safetensors file or a checkpoint directory") from None
    except OSError as e:
        raise ConfigError(f"cannot read weights file {path}: {e.strerror or e}") from None
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    if not (2 <= n <= _MAX_HEADER and data[8:9] == b"{"):
        raise ConfigError(f"weights file {path} is {_looks_like(data)}; only safetensors is supported "
                          f"(from PyTorch: safetensors.torch.save_file(module.state_dict(), 'weights.safetensors'))")
    return data


def _looks_like(head):
    if head[:4] == b"PK\x03\x04":
        return "a zip archive (NumPy .npz or torch.save)"
    if head[:6] == b"\x93NUMPY":
        return "a NumPy .npy file"
    if head[:1] == b"\x80":
        return "a Python pickle (torch.save or pickle.dump)"
    if head[:8] == b"\x89HDF\r\n\x1a\n":
        return "an HDF5 file"
    return "not a safetensors file"


# -- safetensors decoding ------------------------------------------------------------------------
def _tensors(data, where):
    """{name: numpy array} from the bytes of a safetensors file; DataError if truncated or malformed."""
    header, base = _header(data, where)
    if not any(info["dtype"] == "BF16" for info in header.values()):
        import safetensors.numpy

        try:
            return safetensors.numpy.load(data)
        except Exception as e:  # SafetensorError (and dtype errors) from the Rust parser
            raise DataError(f"{where} is corrupt: {e}") from None
    return _decode(data, header, base, where)  # NumPy has no bfloat16: widen it ourselves


def _header(data, where):
    """({name: {"dtype", "shape", "data_offsets"}}, offset of the data) after checking every entry."""
    if len(data) < 8:
        raise DataError(f"{where} is truncated: {len(data)} bytes, less than the 8-byte safetensors header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, _MAX_HEADER):
        raise DataError(f"{where} is truncated or not safetensors: header of {n} bytes, file of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{where} is corrupt: its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise DataError(f"{where} is corrupt: its safetensors header is not an object")
    header.pop("__metadata__", None)
    size = len(data) - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
            itemsize = 2 if dtype == "BF16" else np.dtype(_NUMPY_DTYPES[dtype]).itemsize
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{where} is corrupt: bad header entry for {name!r}: {info!r:.200}") from None
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size
                and end - start == math.prod(shape) * itemsize):
            raise DataError(f"{where} is corrupt or truncated: {name!r} {dtype}{tuple(shape)} at bytes "
                            f"{start}..{end} of a {size}-byte data section")
    return header, 8 + n


def _decode(data, header, base, where):
    out = {}
    for name, info in header.items():
        shape, (start, end) = tuple(info["shape"]), info["data_offsets"]
        if info["dtype"] == "BF16":  # the top 16 bits of a float32
            raw = np.frombuffer(data, "<u2", (end - start) // 2, base + start)
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        else:
            dt = np.dtype(_NUMPY_DTYPES[info["dtype"]])
            out[name] = np.frombuffer(data, dt, (end - start) // dt.itemsize, base + start).reshape(shape).copy()
    return out


# -- random generators ---------------------------------------------------------------------------
def rng_state(generator):
    """JSON-serialisable snapshot of a numpy Generator (its bit generator's state)."""
    return json.loads(json.dumps(generator.bit_generator.state, default=_json_default))


def set_rng_state(generator, state):
    """Restore a snapshot from rng_state() into `generator` (same bit generator kind), in place."""
    kind = type(generator.bit_generator).__name__
    if not isinstance(state, dict) or state.get("bit_generator") != kind:
        got = state.get("bit_generator") if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"RNG state is for {got!r}; this generator is {kind}")
    inner = state.get("state")
    if kind == "MT19937" and isinstance(inner, dict) and isinstance(inner.get("key"), list):
        state = {**state, "state": {**inner, "key": np.asarray(inner["key"], np.uint32)}}
    try:
        generator.bit_generator.state = state
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"invalid {kind} RNG state: {e}") from None
