"""Read GGUF files and their metadata keys, turning every malformed file into a ModelError.

``read_gguf`` wraps gguf.GGUFReader: whatever a truncated or corrupt file makes the reader
raise becomes a ModelError naming the file. ``Metadata`` reads typed keys the way llama.cpp
does: an integer key, or for per-layer values an integer key or an array with one entry per
layer (llama.cpp's ``get_key_or_arr``), each missing or malformed key named with the file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from .layout import ModelError

_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)

# What gguf.GGUFReader raises on a file it cannot parse (short reads, unknown enum values,
# absurd counts that run past the end, bad UTF-8 names, duplicated tensors).
_READER_ERRORS = (
    OSError,
    ValueError,
    IndexError,
    KeyError,
    TypeError,
    OverflowError,
    MemoryError,
    struct.error,
)


def read_gguf(path: Path) -> GGUFReader:
    """Map ``path`` read-only and parse its header; ModelError names the file if it cannot."""
    try:
        return GGUFReader(path)
    except _READER_ERRORS as exc:
        raise ModelError(_damage(path, exc)) from exc


class Metadata:
    """Typed access to the key-value metadata of one GGUF file."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader

    def has(self, key: str) -> bool:
        return self._reader.get_field(key) is not None

    def string(self, key: str) -> str:
        field = self._require(key)
        if field.types != [GGUFValueType.STRING]:
            raise self._malformed(key, field, "a string")
        return str(self._contents(key, field))

    def integer(self, key: str, default: int | None = None) -> int:
        """A scalar integer key; ``default`` when absent (ModelError when absent without one)."""
        field = self._reader.get_field(key)
        if field is None:
            if default is None:
                raise ModelError(f"{self.path}: metadata key {key!r} is missing")
            return default
        if len(field.types) != 1 or field.types[0] not in _INT_TYPES:
            raise self._malformed(key, field, "an integer")
        return self._non_negative(key, int(self._contents(key, field)))

    def per_layer(self, key: str, n_layer: int) -> tuple[int, ...] | None:
        """An integer key or an array of ``n_layer`` integers, as one value per layer; None if absent."""
        field = self._reader.get_field(key)
        if field is None:
            return None
        if len(field.types) == 1 and field.types[0] in _INT_TYPES:
            return (self._non_negative(key, int(self._contents(key, field))),) * n_layer
        if len(field.types) == 2 and field.types[0] is GGUFValueType.ARRAY and field.types[1] in _INT_TYPES:
            values = [self._non_negative(key, int(v)) for v in self._contents(key, field)]
            if len(values) != n_layer:
                raise ModelError(
                    f"{self.path}: metadata key {key!r} has {len(values)} entries; expected one per layer ({n_layer})"
                )
            return tuple(values)
        if len(field.types) == 1 and field.types[0] is GGUFValueType.ARRAY:
            raise ModelError(f"{self.path}: metadata key {key!r} is an empty array; expected {n_layer} integers")
        raise self._malformed(key, field, "an integer or an array of integers")

    def _require(self, key: str) -> ReaderField:
        field = self._reader.get_field(key)
        if field is None:
            raise ModelError(f"{self.path}: metadata key {key!r} is missing")
        return field

    def _contents(self, key: str, field: ReaderField) -> Any:
        try:
            return field.contents()
        except (*_READER_ERRORS, UnicodeDecodeError) as exc:
            raise ModelError(f"{self.path}: metadata key {key!r} cannot be decoded: {exc}") from exc

    def _non_negative(self, key: str, value: int) -> int:
        if value < 0:
            raise ModelError(f"{self.path}: metadata key {key!r} is {value}; expected a non-negative integer")
        return value

    def _malformed(self, key: str, field: ReaderField, expected: str) -> ModelError:
        kinds = "/".join(t.name for t in field.types) or "no value"
        return ModelError(f"{self.path}: metadata key {key!r} holds {kinds}; expected {expected}")


_GGUF_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key count


def _damage(path: Path, exc: BaseException) -> str:
    """What is wrong with a file GGUFReader could not take apart, as precisely as can be said."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            magic, version, n_tensors, n_kv = _GGUF_HEADER.unpack(f.read(_GGUF_HEADER.size))
    except struct.error:
        return f"{path}: not a GGUF file: {size} bytes, shorter than a GGUF header"
    if magic != b"GGUF":
        return f"{path}: not a GGUF file (starts with {magic!r})"
    # Each tensor info and metadata entry takes at least 8 bytes (a length or a count).
    if 8 * (n_tensors + n_kv) > size:
        return (
            f"{path}: corrupt GGUF header: it declares {n_tensors} tensors and {n_kv} metadata keys, "
            f"more than a file of {size} bytes can describe"
        )
    expected = _data_end(path)
    if expected is not None and expected > size:
        return f"{path}: truncated: its header describes {expected} bytes of file, the file has {size}"
    return f"{path}: cannot read as GGUF ({size} bytes): {type(exc).__name__}: {exc}"


class _LayoutOnly(GGUFReader):
    """A reader that only adds up where the tensor data ends, without viewing it."""

    data_end = 0

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            _, _, _, dims, raw_dtype, offset = field.parts
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            n_bytes = int(np.prod(dims)) * type_size // block
            self.data_end = max(self.data_end, start_offs + int(offset[0]) + n_bytes)
        self.tensors = []


def _data_end(path: Path) -> int | None:
    try:
        return _LayoutOnly(path).data_end
    except Exception:  # the header itself is damaged: no size to compare against
        return None
