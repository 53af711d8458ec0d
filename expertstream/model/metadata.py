"""Read GGUF files and their metadata keys, turning every malformed file into a ModelError.

``read_gguf`` checks a file's structure (model/structure.py) before gguf.GGUFReader parses
it, so that a truncated or corrupt file is a ModelError naming the file and the damage, never
an unbounded loop or allocation inside the reader. ``Metadata`` reads typed keys the way llama.cpp
does: an integer key, or for per-layer values an integer key or an array with one entry per
layer (llama.cpp's ``get_key_or_arr``), each missing or malformed key named with the file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, ReaderField

from .schema import ModelError
from .structure import check_structure

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
# bad UTF-8, duplicates). check_structure refuses all of these first; this is the last guard.
_READER_ERRORS = (
    OSError,
    ValueError,
    IndexError,
    KeyError,
    TypeError,
    OverflowError,
    struct.error,
)


def read_gguf(path: Path) -> GGUFReader:
    """Map ``path`` read-only and parse its header; ModelError names the file if it cannot."""
    check_structure(path)
    try:
        return GGUFReader(path)
    except _READER_ERRORS as exc:
        raise ModelError(f"{path}: cannot read as GGUF: {type(exc).__name__}: {exc}") from exc


class Metadata:
    """Typed access to the key-value metadata of one GGUF file."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader

    def has(self, key: str) -> bool:
        return self._reader.get_field(key) is not None

    def value(self, key: str) -> Any:
        """The value of ``key`` as gguf decodes it (a number, string or list), or None when absent."""
        field = self._reader.get_field(key)
        return None if field is None else self._contents(key, field)

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
