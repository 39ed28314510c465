"""The IDX format of MNIST and Fashion-MNIST, gzipped or not.

Header: two zero bytes, a type code, the number of dimensions, then each dimension as a big-endian
uint32, then the data in C order (big-endian for multi-byte types).

Reading trusts nothing: the header is read first, and no more is read (or, gzipped, decompressed)
than the array it declares plus one byte to detect trailing data, so a small file that claims or
inflates to gigabytes fails at once.
"""

import gzip
import math
import os
import struct
import zlib

import numpy as np

from pydtnn.errors import DataError
from pydtnn.files import open_regular

_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODES = {np.dtype(v).newbyteorder("="): k for k, v in _TYPES.items()}
GZIP_MAGIC = b"\x1f\x8b"
DEFLATE_MAX_RATIO = 1032  # deflate emits at most 258 bytes per 2 bits read
CHUNK = 1 << 20


class _Plain:
    """Bytes of an uncompressed file object, in a bytearray (so the array read stays writable)."""

    def __init__(self, f):
        self.f = f

    def read(self, n):
        buf = bytearray(n)
        del buf[self.f.readinto(buf):]
        return buf


class _Gunzip:
    """Decompressed bytes of a gzip file object (one or more members), inflated only as far as read."""

    def __init__(self, f, path):
        self.f, self.path = f, path
        self.z = zlib.decompressobj(wbits=31)
        self.input = b""  # compressed bytes read from the file, not yet given to the decompressor

    def read(self, n):
        """Up to n bytes; fewer only at the end of the data. DataError if the gzip data is corrupt."""
        out = bytearray()
        while len(out) < n:
            if not self.input:
                self.input = self.f.read(CHUNK)
                if not self.input:
                    if not self.z.eof:
                        raise DataError(f"{self.path}: corrupt gzip data (the file ends inside a compressed stream)")
                    break
            if self.z.eof:  # gzip allows members one after another; zero bytes may pad the end
                self.input = self.input.lstrip(b"\0")
                if not self.input:
                    continue
                self.z = zlib.decompressobj(wbits=31)
            try:
                out += self.z.decompress(self.input, n - len(out))
            except zlib.error as e:
                raise DataError(f"{self.path}: corrupt gzip data ({e})") from None
            self.input = self.z.unused_data if self.z.eof else self.z.unconsumed_tail
        return out


def read_idx(path):
    """Array stored in an IDX file (gzip detected by its magic bytes). Raises DataError if malformed."""
    path = os.fspath(path)
    try:
        f = open_regular(path, "IDX file", DataError)
    except FileNotFoundError:
        raise DataError(f"cannot read IDX file {path}: no such file") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            gz = f.read(2) == GZIP_MAGIC
            f.seek(0)
            return _parse(path, _Gunzip(f, path) if gz else _Plain(f), size, gz)
        except OSError as e:
            raise DataError(f"cannot read IDX file {path}: {e.strerror or e}") from None


def _parse(path, stream, size, gz):
    magic = stream.read(4)
    if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] not in _TYPES or magic[3] == 0:
        raise DataError(
            f"{path}: bad IDX magic number {magic.hex() or '(empty file)'}; expected 0000TTNN "
            f"(type TT in {sorted(hex(t) for t in _TYPES)}, NN dimensions)"
        )
    dtype, ndim = np.dtype(_TYPES[magic[2]]), magic[3]
    dims = stream.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise DataError(f"{path}: truncated IDX header ({4 + len(dims)} bytes for {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", dims)
    header = 4 + 4 * ndim
    nbytes = math.prod(shape) * dtype.itemsize  # a Python int: 4 dimensions of 2^32 - 1 overflow int64
    expected = header + nbytes
    if not gz and size != expected:
        raise DataError(f"{path}: wrong length {size} bytes for an IDX array of shape {shape}; expected {expected}")
    if gz and nbytes > DEFLATE_MAX_RATIO * size:
        raise DataError(f"{path}: truncated or corrupt gzip data: the IDX header claims an array of shape {shape} "
                        f"({nbytes:,} bytes), more than a gzip file of {size:,} bytes can hold")
    raw = stream.read(nbytes + 1)
    if len(raw) > nbytes:
        raise DataError(f"{path}: wrong length: more than {expected} bytes for an IDX array of shape {shape}; "
                        f"expected {expected}")
    if len(raw) < nbytes:
        raise DataError(f"{path}: wrong length {header + len(raw)} bytes for an IDX array of shape {shape}; "
                        f"expected {expected}")
    try:
        return np.frombuffer(raw, dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=False)
    except ValueError as e:  # an empty array whose other dimensions NumPy cannot represent
        raise DataError(f"{path}: IDX array of shape {shape} cannot be represented ({e})") from None


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
