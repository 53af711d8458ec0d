"""Mutated GGUF files: a map of a valid file's structure, and mutations aimed at each part of it.

A seed is a small file (or the shards of a split model) that the project's writer made. Its
map comes from gguf.GGUFReader on the valid bytes: where the header, each metadata entry, each
tensor info and each tensor's data lie, and which fields hold counts, lengths, types, shapes
and offsets. Each mutation class turns a seed into one damaged file set, deterministically
from a numpy Generator, and says what it did.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
HUGE = (2**64 - 1, 2**63, 2**63 - 1, 2**62, 2**32, 2**32 - 1, 2**31, 2**31 - 1, 2**16)


@dataclass(frozen=True)
class Part:
    """One field of the file: ``kind`` says what its value means."""

    at: int
    size: int
    kind: str  # magic, version, count, length, type, ndims, dim, offset, bytes
    label: str


@dataclass(frozen=True)
class Entry:
    """One metadata entry or tensor info: its byte range and its fields."""

    name: str
    start: int
    end: int
    parts: tuple[Part, ...]
    value_type: GGUFValueType | None = None  # metadata entries only
    value_at: int = 0  # where the value (after the type) starts


@dataclass(frozen=True)
class TensorData:
    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]
    offset_part: Part  # the info field holding its offset
    dims: tuple[Part, ...]
    type_part: Part
    start: int  # absolute
    nbytes: int


@dataclass
class FileMap:
    """Where everything lies in one valid GGUF file."""

    data: bytes
    header: tuple[Part, ...]
    metadata: list[Entry]
    tensor_infos: list[Entry]
    tensors: list[TensorData]
    infos_end: int
    data_start: int
    alignment: int
    boundaries: list[int] = field(default_factory=list)

    @property
    def parts(self) -> list[Part]:
        return [
            *self.header,
            *(p for e in self.metadata for p in e.parts),
            *(p for e in self.tensor_infos for p in e.parts),
        ]


def map_file(path: Path) -> FileMap:
    data = path.read_bytes()
    reader = GGUFReader(path)
    header = (
        Part(0, 4, "magic", "magic"),
        Part(4, 4, "version", "version"),
        Part(8, 8, "count", "tensor count"),
        Part(16, 8, "count", "metadata key count"),
    )
    metadata = [_metadata_entry(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    infos = [_info_entry(t.field) for t in reader.tensors]
    tensors = []
    for tensor, info in zip(reader.tensors, infos, strict=True):
        dims = tuple(p for p in info.parts if p.kind == "dim")
        tensors.append(
            TensorData(
                tensor.name,
                GGMLQuantizationType(tensor.tensor_type),
                tuple(int(d) for d in tensor.shape),
                next(p for p in info.parts if p.kind == "offset"),
                dims,
                next(p for p in info.parts if p.kind == "type"),
                int(tensor.data_offset),
                int(tensor.n_bytes),
            )
        )
    infos_end = infos[-1].end if infos else metadata[-1].end
    fmap = FileMap(data, header, metadata, infos, tensors, infos_end, int(reader.data_offset), int(reader.alignment))
    edges = {0, len(data), infos_end, fmap.data_start}
    for part in fmap.parts:
        edges.update((part.at, part.at + part.size))
    for tensor in tensors:
        edges.update((tensor.start, tensor.start + tensor.nbytes))
    fmap.boundaries = sorted(edges)
    return fmap


def _sequential(start: int, arrays: list[np.ndarray], kinds: list[tuple[str, str]]) -> list[Part]:
    parts, at = [], start
    for array, (kind, label) in zip(arrays, kinds, strict=True):
        parts.append(Part(at, int(array.nbytes), kind, label))
        at += int(array.nbytes)
    return parts


def _metadata_entry(f) -> Entry:  # type: ignore[no-untyped-def]
    value_type = f.types[0] if f.types else None
    kinds = [("length", f"{f.name}: key length"), ("bytes", f"{f.name}: key"), ("type", f"{f.name}: value type")]
    rest = f.parts[3:]
    if value_type is GGUFValueType.STRING:
        kinds += [("length", f"{f.name}: string length"), ("bytes", f"{f.name}: string")]
    elif value_type is GGUFValueType.ARRAY:
        kinds += [("type", f"{f.name}: element type"), ("count", f"{f.name}: element count")]
        if f.types[-1] is GGUFValueType.STRING:
            for i in range((len(rest) - 2) // 2):
                kinds += [("length", f"{f.name}[{i}]: string length"), ("bytes", f"{f.name}[{i}]")]
        else:
            kinds += [("bytes", f"{f.name}[{i}]") for i in range(len(rest) - 2)]
    else:
        kinds += [("bytes", f"{f.name}: value")]
    parts = _sequential(f.offset, list(f.parts), kinds)
    return Entry(f.name, f.offset, parts[-1].at + parts[-1].size, tuple(parts), value_type, parts[2].at + 4)


def _info_entry(f) -> Entry:  # type: ignore[no-untyped-def]
    name_len, name, n_dims, _dims, _dtype, _offset = f.parts
    parts = _sequential(
        f.offset, [name_len, name], [("length", f"{f.name}: name length"), ("bytes", f"{f.name}: name")]
    )
    at = parts[-1].at + parts[-1].size
    parts.append(Part(at, 4, "ndims", f"{f.name}: dimension count"))
    at += 4
    for i in range(int(n_dims[0])):
        parts.append(Part(at, 8, "dim", f"{f.name}: ne[{i}]"))
        at += 8
    parts += [Part(at, 4, "type", f"{f.name}: type"), Part(at + 4, 8, "offset", f"{f.name}: offset")]
    return Entry(f.name, f.offset, at + 12, tuple(parts))


def shorten_arrays(path: Path, max_items: int) -> None:
    """Keep only the first ``max_items`` elements of every metadata array of the file at ``path``.

    The writer's vocabulary has hundreds of entries; parsing them dominates the cost of a case,
    and a few elements exercise the same structure.
    """
    fmap = map_file(path)
    head = fmap.data[: fmap.infos_end]
    for entry in reversed(fmap.metadata):
        if entry.value_type is not GGUFValueType.ARRAY:
            continue
        per_item = 2 if fmap.data[entry.value_at : entry.value_at + 4] == struct.pack("<I", GGUFValueType.STRING) else 1
        elements = entry.parts[5:]
        if len(elements) <= per_item * max_items:
            continue
        kept_end = elements[per_item * max_items].at
        value = (
            head[entry.value_at : entry.value_at + 4] + struct.pack("<Q", max_items) + head[elements[0].at : kept_end]
        )
        head = replace(head, entry.value_at, entry.end, value)
    path.write_bytes(rebuild(fmap, head))


# -- building blocks ---------------------------------------------------------------------------
def put(data: bytes, part: Part, value: int) -> bytes:
    """``data`` with the little-endian integer field ``part`` set to ``value`` (wrapped to its size)."""
    out = bytearray(data)
    out[part.at : part.at + part.size] = (value % 2 ** (8 * part.size)).to_bytes(part.size, "little")
    return bytes(out)


def get(data: bytes, part: Part) -> int:
    return int.from_bytes(data[part.at : part.at + part.size], "little")


def pack_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def pack_value(value_type: GGUFValueType, value: object, item_type: GGUFValueType | None = None) -> bytes:
    """A metadata value (after its key), type first."""
    out = struct.pack("<I", value_type)
    if value_type is GGUFValueType.STRING:
        return out + pack_string(str(value))
    if value_type is GGUFValueType.ARRAY:
        assert item_type is not None and isinstance(value, list)
        out += struct.pack("<IQ", item_type, len(value))
        for item in value:
            out += pack_value(item_type, item, GGUFValueType.UINT32)[4:]
        return out
    return out + struct.pack("<" + _SCALAR_FORMATS[value_type], value)


def rebuild(fmap: FileMap, head: bytes, *, kv_delta: int = 0, tensor_delta: int = 0) -> bytes:
    """``head`` (header, metadata and tensor infos) followed by the original data, re-aligned.

    Tensor offsets are relative to the data section, so the file stays consistent when the
    head grows or shrinks; counts in the header change by the deltas given.
    """
    out = bytearray(head)
    counts = struct.unpack_from("<QQ", out, 8)
    struct.pack_into("<QQ", out, 8, counts[0] + tensor_delta, counts[1] + kv_delta)
    out += bytes(-len(out) % fmap.alignment)
    return bytes(out) + fmap.data[fmap.data_start :]


def replace(data: bytes, start: int, end: int, new: bytes) -> bytes:
    return data[:start] + new + data[end:]


Rng = np.random.Generator
Mutation = Callable[[FileMap, Rng], tuple[bytes, str]]


def _pick(rng: Rng, items: list):  # type: ignore[no-untyped-def,type-arg]
    return items[int(rng.integers(len(items)))]


def _flip_bits(data: bytes, lo: int, hi: int, rng: Rng) -> tuple[bytes, str]:
    out = bytearray(data)
    flips = []
    for _ in range(int(rng.integers(1, 5))):
        at = int(rng.integers(lo, hi))
        bit = int(rng.integers(8))
        out[at] ^= 1 << bit
        flips.append(f"{at}.{bit}")
    return bytes(out), "flipped bits " + ",".join(flips)


# -- the mutation classes ----------------------------------------------------------------------
def truncate(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    """Cut the file at a structural boundary, one byte before or one after."""
    edge = _pick(rng, fmap.boundaries[:-1])
    cut = max(0, min(len(fmap.data) - 1, edge + int(rng.integers(-1, 2))))
    return fmap.data[:cut], f"cut at byte {cut} of {len(fmap.data)}"


def flip_header(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    return _flip_bits(fmap.data, 0, 24, rng)


def flip_metadata(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    entry = _pick(rng, fmap.metadata)
    data, what = _flip_bits(fmap.data, entry.start, entry.end, rng)
    return data, f"{entry.name}: {what}"


def flip_tensor_infos(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    entry = _pick(rng, fmap.tensor_infos)
    data, what = _flip_bits(fmap.data, entry.start, entry.end, rng)
    return data, f"{entry.name}: {what}"


def flip_data(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    tensor = _pick(rng, [t for t in fmap.tensors if t.nbytes])
    data, what = _flip_bits(fmap.data, tensor.start, tensor.start + tensor.nbytes, rng)
    return data, f"{tensor.name} data: {what}"


def huge_counts(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    """A count, length, dimension count or dimension set to an absurd or off-by-some value."""
    part = _pick(rng, [p for p in fmap.parts if p.kind in ("count", "length", "ndims", "dim")])
    old = get(fmap.data, part)
    choices = [*HUGE, len(fmap.data), len(fmap.data) + 1, old + 1, max(old - 1, 0), old * 1024, 0]
    value = _pick(rng, choices)
    return put(fmap.data, part, value), f"{part.label}: {old} -> {value % 2 ** (8 * part.size)}"


def tensor_offsets(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    """Offsets that overlap another tensor, break the alignment or point past the end."""
    tensor = _pick(rng, fmap.tensors)
    other = _pick(rng, fmap.tensors)
    old = get(fmap.data, tensor.offset_part)
    room = len(fmap.data) - fmap.data_start
    choices = [
        get(fmap.data, other.offset_part),  # the same bytes as another tensor
        get(fmap.data, other.offset_part) + fmap.alignment,  # inside another tensor
        old + 1,
        old + fmap.alignment // 2,
        old - fmap.alignment,
        0,
        room,
        room - tensor.nbytes + fmap.alignment,  # ends past the file by one alignment step
        2**63,
        2**64 - fmap.alignment,
    ]
    value = _pick(rng, choices) % 2**64
    return put(fmap.data, tensor.offset_part, value), f"{tensor.name}: offset {old} -> {value}"


def tensor_shapes(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    """Shapes that do not multiply out: a dimension changed, swapped, overflowing, or a new type."""
    tensor = _pick(rng, [t for t in fmap.tensors if t.dims])
    how = int(rng.integers(5))
    if how == 0:  # another type: the same shape now needs a different number of bytes
        qtype = _pick(rng, list(GGML_QUANT_SIZES))
        return put(fmap.data, tensor.type_part, qtype), f"{tensor.name}: type {tensor.qtype.name} -> {qtype.name}"
    dim = _pick(rng, list(tensor.dims))
    old = get(fmap.data, dim)
    if how == 1 and len(tensor.dims) > 1:  # two dimensions swapped
        a, b = tensor.dims[0], tensor.dims[-1]
        data = put(put(fmap.data, a, get(fmap.data, b)), b, get(fmap.data, a))
        return data, f"{tensor.name}: ne[0] and ne[-1] swapped"
    if how == 2:  # every dimension 2**32: the element count overflows 64 bits
        data = fmap.data
        for d in tensor.dims:
            data = put(data, d, 2**32)
        return data, f"{tensor.name}: every dimension 2**32"
    block = GGML_QUANT_SIZES[tensor.qtype][0]
    value = _pick(rng, [old + 1, old - 1, old * 2, old // 2, 0, old + block, old + block // 2 + 1, 1])
    return put(fmap.data, dim, value), f"{dim.label}: {old} -> {value}"


def _typed_values(rng: Rng, old: int | None) -> tuple[GGUFValueType, object, GGUFValueType | None]:
    """Another type for a metadata value: plausible numbers, strings, arrays, negatives."""
    n = old if old is not None else int(rng.integers(0, 300))
    options: list[tuple[GGUFValueType, object, GGUFValueType | None]] = [
        (GGUFValueType.STRING, str(n), None),
        (GGUFValueType.STRING, "\xff\xfe", None),
        (GGUFValueType.FLOAT32, float(n), None),
        (GGUFValueType.FLOAT64, float(n) + 0.5, None),
        (GGUFValueType.BOOL, True, None),
        (GGUFValueType.INT8, -1, None),
        (GGUFValueType.INT32, -n - 1, None),
        (GGUFValueType.INT64, -(2**63), None),
        (GGUFValueType.UINT64, 2**64 - 1, None),
        (GGUFValueType.UINT64, 2**40, None),
        (GGUFValueType.UINT16, n % 2**16, None),
        (GGUFValueType.ARRAY, [], GGUFValueType.UINT32),
        (GGUFValueType.ARRAY, [n] * int(rng.integers(1, 6)), GGUFValueType.UINT32),
        (GGUFValueType.ARRAY, [float(n)] * 2, GGUFValueType.FLOAT32),
        (GGUFValueType.ARRAY, ["a", "b"], GGUFValueType.STRING),
        (GGUFValueType.ARRAY, [-1, n], GGUFValueType.INT32),
    ]
    return _pick(rng, options)


IMPORTANT_KEYS = (
    "general.architecture",
    "general.alignment",
    ".block_count",
    ".embedding_length",
    ".expert_count",
    ".expert_used_count",
    ".expert_feed_forward_length",
    ".feed_forward_length",
    ".leading_dense_block_count",
    ".expert_gating_func",
    ".expert_weights_scale",
    ".expert_weights_norm",
    ".expert_group_count",
    ".expert_group_used_count",
    ".expert_shared_count",
    "split.no",
    "split.count",
    "split.tensors.count",
)


def key_types(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    """A key the loader or the runner reads, given a value of another type (the file re-laid)."""
    important = [e for e in fmap.metadata if e.name.endswith(IMPORTANT_KEYS)]
    entry = _pick(rng, important if important and rng.random() < 0.8 else fmap.metadata)
    old = None
    if entry.value_type in _SCALAR_FORMATS and entry.value_type not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        old = int(struct.unpack_from("<" + _SCALAR_FORMATS[entry.value_type], fmap.data, entry.value_at)[0])
    value_type, value, item_type = _typed_values(rng, old)
    if entry.name == "general.alignment" and rng.random() < 0.5:
        value_type, value, item_type = GGUFValueType.UINT32, _pick(rng, [0, 3, 1, 2**31, 48]), None
    head = replace(fmap.data[: fmap.infos_end], entry.value_at - 4, entry.end, pack_value(value_type, value, item_type))
    return rebuild(fmap, head), f"{entry.name}: now {value_type.name} {value!r}"


def structure_edits(fmap: FileMap, rng: Rng) -> tuple[bytes, str]:
    """Entries dropped or duplicated, unknown value types, nested arrays, duplicated tensors."""
    head = fmap.data[: fmap.infos_end]
    how = int(rng.integers(6))
    entry = _pick(rng, fmap.metadata)
    if how == 0:
        return rebuild(fmap, replace(head, entry.start, entry.end, b""), kv_delta=-1), f"{entry.name}: dropped"
    if how == 1:
        dup = head[entry.start : entry.end]
        end = fmap.metadata[-1].end
        return rebuild(fmap, replace(head, end, end, dup), kv_delta=1), f"{entry.name}: twice"
    if how == 2:
        raw_type = _pick(rng, [13, 99, 2**32 - 1])
        return put(fmap.data, entry.parts[2], raw_type), f"{entry.name}: value type {raw_type}"
    if how == 3:
        nested = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.ARRAY, 2) + b"".join(
            struct.pack("<IQ", GGUFValueType.UINT8, 1) + b"\x01" for _ in range(2)
        )
        return rebuild(fmap, replace(head, entry.value_at - 4, entry.end, nested)), f"{entry.name}: array of arrays"
    info = _pick(rng, fmap.tensor_infos)
    if how == 4:
        dup = head[info.start : info.end]
        return rebuild(fmap, replace(head, fmap.infos_end, fmap.infos_end, dup), tensor_delta=1), f"{info.name}: twice"
    return rebuild(fmap, replace(head, info.start, info.end, b""), tensor_delta=-1), f"{info.name}: info dropped"


MUTATIONS: dict[str, Mutation] = {
    "truncate": truncate,
    "flip_header": flip_header,
    "flip_metadata": flip_metadata,
    "flip_tensor_infos": flip_tensor_infos,
    "flip_data": flip_data,
    "huge_counts": huge_counts,
    "tensor_offsets": tensor_offsets,
    "tensor_shapes": tensor_shapes,
    "key_types": key_types,
    "structure_edits": structure_edits,
}
