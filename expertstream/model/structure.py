"""Check a GGUF file's structure against its size before gguf.GGUFReader takes it apart.

GGUFReader trusts what a file declares: a metadata array whose count runs past the end of
the file makes it append an empty view per element for as long as the count says, nested
arrays recurse without bound, and tensor offsets are taken as they are. ``check_structure``
walks the header, the metadata and the tensor infos the way llama.cpp's gguf reader does,
with every count, length, type, shape and offset checked against the bytes that are there,
so that any malformed file becomes one ModelError naming the file, the part and the byte
offset, in time and memory bounded by the file's size. It reads nothing past the tensor
infos: the tensor data is only checked to lie inside the file, aligned and not overlapping.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from .schema import ModelError

GGUF_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4  # llama.cpp refuses tensors of more dimensions
GGML_MAX_NAME = 64  # and tensor names of this many bytes or more
_HEADER_SIZE = 24  # magic, version, tensor count, metadata key count
_MIN_KV_SIZE = 8 + 4 + 1  # name length, value type, the smallest value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
_STRING_LENGTH_SIZE = 8
_ADDRESSABLE = 2**63  # ggml counts elements and bytes in int64


@dataclass(frozen=True)
class _TensorExtent:
    name: str
    offset: int  # relative to the start of the data section
    nbytes: int


def check_structure(path: Path) -> None:
    """Raise ModelError, naming ``path`` and what is wrong, unless it is a well-formed GGUF file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < _HEADER_SIZE:
                f.seek(0)
                raise ModelError(_short_file(path, size, f.read()))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _Walk(path, data, size).run()
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _short_file(path: Path, size: int, data: bytes) -> str:
    if data[:4] == b"GGUF":
        return f"{path}: truncated: {size} bytes, shorter than a GGUF header ({_HEADER_SIZE} bytes)"
    return f"{path}: not a GGUF file: {size} bytes, shorter than a GGUF header"


class _Walk:
    """One pass over a file's header, metadata and tensor infos."""

    def __init__(self, path: Path, data: mmap.mmap, size: int) -> None:
        self.path = path
        self.data = data
        self.size = size
        self.at = 0
        self.order = "<"
        self.alignment = GGUF_DEFAULT_ALIGNMENT

    def run(self) -> None:
        magic = bytes(self.data[:4])
        if magic != b"GGUF":
            self.fail(f"not a GGUF file (starts with {magic!r})")
        (version,) = struct.unpack_from("<I", self.data, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in GGUF_VERSIONS:
            self.fail(f"GGUF version {version} is not supported (versions {', '.join(map(str, GGUF_VERSIONS))} are)")
        self.at = 8
        n_tensors, n_kv = self.unpack("QQ", "the header")
        if _MIN_TENSOR_INFO_SIZE * n_tensors + _MIN_KV_SIZE * n_kv > self.size - _HEADER_SIZE:
            self.fail(
                f"corrupt GGUF header: it declares {n_tensors} tensors and {n_kv} metadata keys, "
                f"more than a file of {self.size} bytes can describe"
            )
        keys: set[str] = set()
        for index in range(n_kv):
            self.metadata_entry(index, keys)
        extents = [self.tensor_info(index) for index in range(n_tensors)]
        self.check_data(extents)

    # -- metadata --------------------------------------------------------------------------
    def metadata_entry(self, index: int, seen: set[str]) -> None:
        start = self.at
        key = self.name(f"the name of metadata key {index + 1}")
        if key in seen:
            self.fail(f"metadata key {key!r} appears twice (the second at byte {start})")
        seen.add(key)
        (raw_type,) = self.unpack("I", f"the type of metadata key {key!r}")
        value_type = self.value_type(raw_type, f"metadata key {key!r}")
        if key == "general.alignment":
            self.alignment_value(value_type)
            return
        self.value(value_type, key)

    def value(self, value_type: GGUFValueType, key: str) -> None:
        if value_type is GGUFValueType.STRING:
            self.string(f"the value of metadata key {key!r}")
        elif value_type is GGUFValueType.ARRAY:
            self.array(key)
        else:
            self.take(_SCALAR_SIZES[value_type], f"the value of metadata key {key!r}")

    def array(self, key: str) -> None:
        (raw_type,) = self.unpack("I", f"the element type of metadata key {key!r}")
        item_type = self.value_type(raw_type, f"the elements of metadata key {key!r}")
        if item_type is GGUFValueType.ARRAY:
            self.fail(f"metadata key {key!r} is an array of arrays, which GGUF readers do not support")
        (count,) = self.unpack("Q", f"the length of metadata key {key!r}")
        item_size = _STRING_LENGTH_SIZE if item_type is GGUFValueType.STRING else _SCALAR_SIZES[item_type]
        if count * item_size > self.size - self.at:
            self.fail(
                f"metadata key {key!r} declares {count} elements of {item_type.name} at byte {self.at}, "
                f"more than the {self.size - self.at} bytes left in the file can hold"
            )
        if item_type is GGUFValueType.STRING:
            for element in range(count):
                self.string(f"element {element} of metadata key {key!r}")
        else:
            self.take(count * item_size, f"the elements of metadata key {key!r}")

    def alignment_value(self, value_type: GGUFValueType) -> None:
        if value_type is not GGUFValueType.UINT32:
            self.fail(f"metadata key 'general.alignment' holds {value_type.name}; expected UINT32")
        (alignment,) = self.unpack("I", "the value of metadata key 'general.alignment'")
        if alignment == 0 or alignment & (alignment - 1):
            self.fail(f"metadata key 'general.alignment' is {alignment}; expected a power of two")
        self.alignment = alignment

    def value_type(self, raw: int, what: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            self.fail(f"{what} has unknown value type {raw} (at byte {self.at - 4})")

    # -- tensor infos ----------------------------------------------------------------------
    def tensor_info(self, index: int) -> _TensorExtent:
        name = self.name(f"the name of tensor {index + 1}", max_bytes=GGML_MAX_NAME - 1)
        (n_dims,) = self.unpack("I", f"the dimension count of tensor {name}")
        if n_dims > GGML_MAX_DIMS:
            self.fail(f"tensor {name} has {n_dims} dimensions; ggml allows at most {GGML_MAX_DIMS}")
        ne = self.unpack(f"{n_dims}Q", f"the shape of tensor {name}")
        (raw_type,) = self.unpack("I", f"the type of tensor {name}")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self.fail(f"tensor {name} has unknown type {raw_type} (at byte {self.at - 4})")
        (offset,) = self.unpack("Q", f"the data offset of tensor {name}")
        addressable = 1
        for n in ne:
            addressable *= max(n, 1)
        if addressable >= _ADDRESSABLE:
            self.fail(f"tensor {name} has shape {ne}: more elements than ggml can address")
        if ne and ne[0] % block:
            self.fail(f"tensor {name} has rows of {ne[0]} elements, not a multiple of {qtype.name}'s block ({block})")
        if offset % self.alignment:
            self.fail(f"tensor {name}: its data offset {offset} is not a multiple of the alignment {self.alignment}")
        elements = 1
        for n in ne:
            elements *= n
        return _TensorExtent(name, offset, elements * type_size // block)  # as ggml and gguf count bytes

    def check_data(self, extents: list[_TensorExtent]) -> None:
        data_start = -(-self.at // self.alignment) * self.alignment
        end = max((data_start + t.offset + t.nbytes for t in extents), default=data_start)
        if end > self.size:
            self.fail(f"truncated: its header describes {end} bytes of file, the file has {self.size}")
        previous: _TensorExtent | None = None
        for tensor in sorted((t for t in extents if t.nbytes), key=lambda t: t.offset):
            if previous is not None and tensor.offset < previous.offset + previous.nbytes:
                self.fail(
                    f"the data of tensors {previous.name} (offset {previous.offset}, {previous.nbytes} bytes) "
                    f"and {tensor.name} (offset {tensor.offset}) overlap"
                )
            previous = tensor

    # -- reading ---------------------------------------------------------------------------
    def name(self, what: str, max_bytes: int | None = None) -> str:
        start = self.at
        end = self.string(what)
        length = end - start - _STRING_LENGTH_SIZE
        if max_bytes is not None and length > max_bytes:
            self.fail(f"{what} (at byte {start}) is {length} bytes long; at most {max_bytes} are allowed")
        try:
            return self.data[start + _STRING_LENGTH_SIZE : end].decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} (at byte {start}) is not UTF-8")

    def string(self, what: str) -> int:
        """Step over a string (its length, then its bytes); return where it ends."""
        (length,) = self.unpack("Q", f"the length of {what}")
        self.take(length, what)
        return self.at

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        layout = struct.Struct(self.order + fmt)
        start = self.take(layout.size, what)
        return layout.unpack_from(self.data, start)

    def take(self, nbytes: int, what: str) -> int:
        """Advance over ``nbytes`` and return where they start; ModelError if the file ends first."""
        start = self.at
        if nbytes > self.size - start:
            self.fail(
                f"truncated or corrupt: {what} at byte {start} needs {nbytes} bytes, "
                f"{self.size - start} are left in the file"
            )
        self.at = start + nbytes
        return start

    def fail(self, problem: str) -> NoReturn:
        raise ModelError(f"{self.path}: {problem}")
