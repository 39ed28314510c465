"""The IDX format of MNIST and Fashion-MNIST, gzipped or not.

Header: two zero bytes, a type code, the number of dimensions, then each dimension as a big-endian
uint32, then the data in C order (big-endian for multi-byte types).
"""

import gzip
import os
import struct
import zlib

import numpy as np

from pydtnn.errors import DataError

_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODES = {np.dtype(v).newbyteorder("="): k for k, v in _TYPES.items()}


def read_idx(path):
    """Array stored in an IDX file (gzip detected by its magic bytes). Raises DataError if malformed."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read IDX file {path}: {e.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: corrupt gzip data ({e})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _TYPES or raw[3] == 0:
        raise DataError(
            f"{path}: bad IDX magic number {raw[:4].hex() or '(empty file)'}; expected 0000TTNN "
            f"(type TT in {sorted(hex(t) for t in _TYPES)}, NN dimensions)"
        )
    dtype, ndim = np.dtype(_TYPES[raw[2]]), raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes for {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    expected = 4 + 4 * ndim + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"{path}: wrong length {len(raw)} bytes for an IDX array of shape {shape}; expected {expected}")
    return np.frombuffer(raw, dtype, offset=4 + 4 * ndim).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path, array, compress=None):
    """Write `array` as IDX (gzipped when compress is true or the path ends in .gz)."""
    a = np.asarray(array)
    code = _CODES.get(a.dtype)
    if code is None:
        raise ValueError(f"IDX cannot store dtype {a.dtype}; expected one of {sorted(str(d) for d in _CODES)}")
    data = struct.pack(">BBBB", 0, 0, code, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape)
    data += a.astype(_TYPES[code], copy=False).tobytes()
    if compress or (compress is None and os.fspath(path).endswith(".gz")):
        data = gzip.compress(data, mtime=0)
    with open(path, "wb") as f:
        f.write(data)
