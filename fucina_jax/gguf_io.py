"""Reading GGUF files: metadata as plain Python values, tensors as float32 NumPy arrays.

Everything that touches the `gguf` package's reader lives here, so the rest of the package sees a dict of metadata and
a name -> array mapping. Malformed files are turned into `GGUFError` with a message that names the file.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from fucina_jax.errors import GGUFError, UnsupportedTensorTypeError

__all__ = ["GGUFFile", "open_gguf", "read_metadata"]

GGUF_MAGIC = b"GGUF"


def _check_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {path!r} (pass the path of a .gguf file)")
    if os.path.isdir(path):
        raise GGUFError(f"{path!r} is a directory, not a GGUF file")
    if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would hang or fail to map: GGUF files are read at offsets
        raise GGUFError(f"{path!r} is not a regular file (a pipe, socket or device): save the model to a file "
                        "and pass its path")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(
            f"{path!r} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}); "
            "convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    return path


# GGUF value types (gguf spec): scalar little-endian dtypes; 8 = string, 9 = array.
_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32
_MAX_ARRAY_DEPTH = 8  # arrays of arrays nest this deep at most (real files: 1-2); deeper is a corrupt file


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order (GGUF ne reversed)
    qtype: Any  # gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


class _Header:
    """A bounds-checked little-endian reader over the mapped file. gguf.GGUFReader builds one NumPy view per array
    element (15 s for Gemma 3's 262k-token vocabulary); this reads the same header in a fraction of a second."""

    def __init__(self, buf, path: str):
        self.buf, self.mv, self.pos, self.path = buf, memoryview(buf), 0, path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"GGUF file {self.path!r} is truncated or corrupt: its header needs {n} bytes at offset {self.pos} "
                f"but the file has {len(self.buf)}. Download or convert it again."
            )

    def scalar(self, t: int):
        if t not in _SCALAR:
            raise GGUFError(f"GGUF file {self.path!r} is corrupt: unknown value type {t} at offset {self.pos}")
        dt = np.dtype(_SCALAR[t])
        self.need(dt.itemsize)
        v = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.pos)[0].item()
        self.pos += dt.itemsize
        return v

    def string(self) -> str:
        n = self.scalar(10)
        self.need(n)
        try:
            s = str(self.mv[self.pos : self.pos + n], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"GGUF file {self.path!r} is corrupt: a string at offset {self.pos} is not UTF-8") from e
        self.pos += n
        return s

    def strings(self, n: int) -> list[str]:
        """An array of n strings in one pass: a vocabulary of 262k tokens in ~20 ms in C (gguf_strings.c), ~0.17 s
        in Python where that is not built (_strings_py), ~1 s through `string`. Anything odd (a length past the
        end, bad UTF-8) reruns the array through `string`, which raises the precise error."""
        if 8 * n > len(self.buf) - self.pos:  # each string takes >= 8 bytes: the per-item walk names the one cut off
            return [self.string() for _ in range(n)]
        try:
            from fucina_jax._gguf_strings import strings as c_strings
        except ImportError:  # not built: the same walk in Python below
            pass
        else:
            got = c_strings(self.buf, self.pos, n)
            if got is None:  # odd: the per-item parser raises the precise error
                return [self.string() for _ in range(n)]
            out, self.pos = got
            return out
        return self._strings_py(n)

    def _strings_py(self, n: int) -> list[str]:
        """strings() in Python: one tight pass (length, slice), then one decode per string."""
        start, buf, unpack = self.pos, self.buf, _U64.unpack_from
        pieces = []
        append = pieces.append
        pos = start
        try:
            for _ in range(n):
                (k,) = unpack(buf, pos)
                pos += 8 + k
                append(buf[pos - k : pos])  # a slice past the end is cut short: caught by the check below
            if pos <= len(buf):
                out = [str(b, "utf-8") for b in pieces]
                self.pos = pos
                return out
        except (struct.error, UnicodeDecodeError, OverflowError):
            pass
        self.pos = start
        return [self.string() for _ in range(n)]

    def value(self, t: int, depth: int = 0):
        if t == _STRING:
            return self.string()
        if t == _ARRAY:
            et, n = self.scalar(4), self.scalar(10)
            if et == _STRING:
                return self.strings(n)
            if et == _ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:
                    raise GGUFError(f"GGUF file {self.path!r} is corrupt: arrays nested more than {_MAX_ARRAY_DEPTH} "
                                    f"deep at offset {self.pos}")
                return [self.value(_ARRAY, depth + 1) for _ in range(n)]
            if et not in _SCALAR:
                raise GGUFError(f"GGUF file {self.path!r} is corrupt: unknown array type {et}")
            dt = np.dtype(_SCALAR[et])
            self.need(n * dt.itemsize)
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
            self.pos += n * dt.itemsize
            return arr.tolist()
        return self.scalar(t)


@dataclass
class GGUFFile:
    """An opened GGUF file: `metadata` (key -> plain Python value) and `tensors` (name -> TensorInfo), with the
    tensor data memory-mapped and read on demand by `load`."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _buf: Any = None

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path!r} has no general.architecture key")
        return arch

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in NumPy (row-major) order: GGUF `ne` reversed, e.g. a {n_in, n_out} weight is (n_out, n_in)."""
        return self.tensors[name].shape

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].qtype.name

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor (a typed view for F32/F16/BF16), without copying."""
        import gguf

        t = self.tensors[name]
        typed = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        if t.qtype in typed:
            return np.frombuffer(self._buf, dtype=typed[t.qtype], count=t.n_bytes // np.dtype(typed[t.qtype]).itemsize,
                                 offset=t.offset)
        return np.frombuffer(self._buf, dtype=np.uint8, count=t.n_bytes, offset=t.offset)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop this process's resident pages of bytes [start, stop) of tensor `name` (once they are consumed): the
        mapped file's touched pages count in RSS until then. Views stay valid; a page touched again is re-read from
        the page cache."""
        t = self.tensors[name]
        stop = t.n_bytes if stop is None else stop
        lo = (t.offset + start) // mmap.PAGESIZE * mmap.PAGESIZE
        if self._buf is not None and not self._buf.closed and stop > start and hasattr(mmap, "MADV_DONTNEED"):
            self._buf.madvise(mmap.MADV_DONTNEED, lo, t.offset + stop - lo)

    def close(self) -> None:
        """Unmap the file now rather than when the object is collected (a no-op while NumPy views of it live)."""
        if self._buf is not None and not self._buf.closed:
            try:
                self._buf.close()
            except BufferError:  # exported views: the mapping goes when the last of them does
                pass

    def load(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32 in NumPy order."""
        from fucina_jax.quants import dequantize

        t = self.tensors[name]
        try:
            return dequantize(self.raw(name), t.qtype, t.shape)
        except UnsupportedTensorTypeError as e:
            raise UnsupportedTensorTypeError(f"tensor {name!r} in {self.path!r}: {e}") from e


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (memory-mapped): metadata and tensor directory now, tensor data lazily through `load`."""
    import gguf

    path = _check_path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    h = _Header(buf, path)
    h.pos = 4
    version = h.scalar(4)
    if version not in (2, 3):
        raise GGUFError(f"{path!r} is GGUF version {version}; fucina_jax reads versions 2 and 3 (re-convert the model)")
    n_tensors, n_kv = h.scalar(10), h.scalar(10)
    if n_tensors > size or n_kv > size:
        raise GGUFError(f"GGUF file {path!r} is truncated or corrupt: it claims {n_tensors} tensors and {n_kv} "
                        f"metadata keys in {size} bytes. Download or convert it again.")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string()
        if key in metadata:
            raise GGUFError(f"GGUF file {path!r} is corrupt: metadata key {key!r} appears twice")
        metadata[key] = h.value(h.scalar(4))
    infos = []
    for _ in range(n_tensors):
        name = h.string()
        n_dims = h.scalar(4)
        if n_dims > 8:
            raise GGUFError(f"GGUF file {path!r} is corrupt: tensor {name!r} has {n_dims} dimensions")
        ne = [h.scalar(10) for _ in range(n_dims)]
        type_id, offset = h.scalar(4), h.scalar(10)
        infos.append((name, ne, type_id, offset))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise GGUFError(f"GGUF file {path!r} is corrupt: general.alignment = {align!r} is not a power-of-2 integer")
    data_start = (h.pos + align - 1) // align * align
    tensors: dict[str, TensorInfo] = {}
    expected = 0  # llama.cpp's rule: tensor data is laid out in directory order, each start aligned
    for name, ne, type_id, offset in infos:
        if name in tensors:
            raise GGUFError(f"GGUF file {path!r} is corrupt: tensor {name!r} appears twice")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise UnsupportedTensorTypeError(
                f"tensor {name!r} in {path!r} has tensor type id {type_id}, which this gguf version does not know; "
                "re-quantize the model to a common type (Q8_0, Q4_K, ...)"
            ) from None
        n_el = math.prod(ne)  # Python ints: no wrap-around
        if ne and ne[0] % block:
            raise GGUFError(f"GGUF file {path!r} is corrupt: tensor {name!r} rows of {ne[0]} values are not whole "
                            f"{qtype.name} blocks of {block}")
        n_bytes = n_el // block * type_size
        if offset != expected:
            raise GGUFError(
                f"GGUF file {path!r} is corrupt: tensor {name!r} has data offset {offset}, expected {expected} (the "
                "end of the previous tensor's data, aligned). Download or convert it again."
            )
        expected += (n_bytes + align - 1) // align * align
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(
                f"GGUF file {path!r} is truncated: tensor {name!r} ends at byte {start + n_bytes} but the file has "
                f"{size} bytes. Download or convert it again."
            )
        tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(ne)), qtype, start, n_bytes)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, _buf=buf)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Only the metadata of a GGUF file (key -> plain Python value); no tensor is touched."""
    gf = open_gguf(path)
    gf.close()
    return gf.metadata
