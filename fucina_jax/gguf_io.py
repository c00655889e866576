"""Reading GGUF files: metadata as plain Python values, tensors as float32 NumPy arrays.

Everything that touches the `gguf` package's reader lives here, so the rest of the package sees a dict of metadata and
a name -> array mapping. Malformed files are turned into `GGUFError` with a message that names the file.
"""

from __future__ import annotations

import os
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
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(
            f"{path!r} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}); "
            "convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    return path


def _field_value(field) -> Any:
    """A reader field as a plain Python value (str, int, float, bool, or list of those)."""
    try:
        return field.contents()
    except Exception as e:  # noqa: BLE001 - the reader raises assorted errors on corrupt fields
        raise GGUFError(f"metadata field {field.name!r} is corrupt: {e}") from e


@dataclass
class GGUFFile:
    """An opened GGUF file: `metadata` (key -> value) and `tensors` (name -> gguf ReaderTensor)."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path!r} has no general.architecture key")
        return arch

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in NumPy (row-major) order: GGUF `ne` reversed, e.g. a {n_in, n_out} weight is (n_out, n_in)."""
        t = self.tensors[name]
        return tuple(int(d) for d in reversed(list(t.shape)))

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def load(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32 in NumPy order."""
        from fucina_jax.quants import dequantize

        t = self.tensors[name]
        shape = self.tensor_shape(name)
        try:
            raw = np.asarray(t.data)
        except Exception as e:  # noqa: BLE001 - memmap past the end of a truncated file
            raise GGUFError(f"tensor {name!r} in {self.path!r} cannot be read ({e}); the file may be truncated") from e
        try:
            return dequantize(raw, t.tensor_type, shape)
        except UnsupportedTensorTypeError as e:
            raise UnsupportedTensorTypeError(f"tensor {name!r} in {self.path!r}: {e}") from e


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (memory-mapped) and read its metadata; tensors are read lazily by `GGUFFile.load`."""
    import gguf

    path = _check_path(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/IndexError/struct errors on bad files
        size = os.path.getsize(path)
        raise GGUFError(
            f"cannot read GGUF file {path!r} ({size} bytes): {type(e).__name__}: {e}. "
            "The file is probably truncated or corrupt: download or convert it again."
        ) from e
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    # A truncated file can still parse its header; check that every tensor's bytes are inside the file.
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(
                f"GGUF file {path!r} is truncated: tensor {t.name!r} ends at byte {end} but the file has {size} bytes. "
                "Download or convert it again."
            )
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Only the metadata of a GGUF file (key -> plain Python value); no tensor is touched."""
    return open_gguf(path).metadata
