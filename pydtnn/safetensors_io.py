"""safetensors files: written from NumPy arrays, read back with every header entry checked, bfloat16 widened.

    data = serialize({"weight": array}, backend.to_numpy)   # the bytes of a safetensors file
    arrays = tensors(data, where)          # {name: numpy array}; DataError naming `where` if malformed
    data = read_weights_file(path)         # a user's weights file; ConfigError for a pickle, .npy, .npz...

Only safetensors is read, and nothing is unpickled: a header entry whose dtype, shape or byte range
does not fit the file is refused before any tensor is built.
"""

import json
import math

import numpy as np

from pydtnn import files
from pydtnn.checkpoint_meta import is_count
from pydtnn.errors import ConfigError, DataError

# safetensors dtype -> numpy dtype (little-endian); BF16 is widened to float32 by _decode
_NUMPY_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8",
                 "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?"}
_MAX_HEADER = 100_000_000  # the safetensors limit on the JSON header


def serialize(arrays, to_numpy):
    """safetensors bytes of {name: array} (copied to host, C-contiguous, little-endian)."""
    import safetensors.numpy

    host = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(to_numpy(a))
        host[name] = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return safetensors.numpy.save(host)


def read_weights_file(path):
    """The bytes of a safetensors file; ConfigError for a missing file, a FIFO or device, or any other format."""
    try:
        data = files.read_bytes(path, "weights file", None, ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"weights file {path} does not exist; "
                          "expected a .safetensors file or a checkpoint directory") from None
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


def tensors(data, where):
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
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise DataError(f"{where} is corrupt: its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise DataError(f"{where} is corrupt: its safetensors header is not an object")
    header.pop("__metadata__", None)
    size = len(data) - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            itemsize = 2 if dtype == "BF16" else np.dtype(_NUMPY_DTYPES[dtype]).itemsize
            if not (isinstance(shape, list) and all(is_count(s) for s in shape)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{where} is corrupt: bad header entry for {name!r}: {info!r:.200}") from None
        if not (is_count(start) and is_count(end) and start <= end <= size
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
