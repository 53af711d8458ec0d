"""Open a GGUF MoE model through gguf.GGUFReader (a read-only mapping of the file).

The loader checks what the streaming path relies on (metadata, the four per-layer tensors,
their shapes and types) and records where each tensor's bytes lie in the file. It never
copies tensor data: ``raw`` is a view of the mapping.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from .._closing import Closing
from .layout import EXPERT_ROLES, ModelError, TensorRole, type_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and what it holds."""

    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    nbytes: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def ne0(self) -> int:
        return self.ne[0]

    @property
    def slice_nbytes(self) -> int:
        """Bytes of one slice along the last dimension (one expert of an expert tensor)."""
        return self.nbytes // self.ne[-1]


@dataclass(frozen=True)
class MoeLayer:
    index: int
    router: TensorInfo
    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo

    @property
    def experts(self) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
        return (self.gate, self.up, self.down)


@dataclass(frozen=True)
class _Dims:
    arch: str
    n_layer: int
    n_expert: int
    top_k: int
    n_embd: int
    n_ff: int


class MoeModel(Closing):
    """A GGUF MoE model mapped read-only; use as a context manager or call close()."""

    def __init__(self, path: Path, reader: GGUFReader, dims: _Dims, layers: tuple[MoeLayer, ...]) -> None:
        self.path = path
        self.arch = dims.arch
        self.n_layer = dims.n_layer
        self.n_expert = dims.n_expert
        self.top_k = dims.top_k
        self.n_embd = dims.n_embd
        self.n_ff = dims.n_ff
        self.layers = layers
        self.tensors: Mapping[str, TensorInfo] = {t.name: t for layer in layers for t in (layer.router, *layer.experts)}
        self._reader: GGUFReader | None = reader

    @classmethod
    def open(cls, path: str | Path) -> MoeModel:
        """Map ``path`` and check it; ModelError names the file and what is wrong."""
        path = Path(path)
        try:
            reader = GGUFReader(path)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path}: cannot read as GGUF: {exc}") from exc
        dims = _read_dims(path, reader)
        found = {t.name: t for t in reader.tensors}
        layers = tuple(_read_layer(path, found, dims, i) for i in range(dims.n_layer))
        log.debug("opened %s: %s, %d layers, %d experts", path, dims.arch, dims.n_layer, dims.n_expert)
        return cls(path, reader, dims, layers)

    @property
    def mapping(self) -> np.ndarray:
        """The whole file as a flat read-only uint8 array (the mapping itself, no copy)."""
        if self._reader is None:
            raise ModelError(f"{self.path}: the model is closed")
        return self._reader.data.view(np.ndarray)

    @property
    def expert_tensors(self) -> tuple[TensorInfo, ...]:
        return tuple(t for layer in self.layers for t in layer.experts)

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description of the model's MoE shape."""
        return {
            "path": str(self.path),
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "top_k": self.top_k,
            "n_embd": self.n_embd,
            "n_ff": self.n_ff,
            "expert_type": self.layers[0].gate.qtype.name,
            "expert_bytes": sum(t.nbytes for t in self.expert_tensors),
        }

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: no tensor {name!r} in this model") from None

    def metadata(self, key: str) -> Any:
        """The value of metadata ``key``, or None when the file lacks it."""
        if self._reader is None:
            raise ModelError(f"{self.path}: the model is closed")
        field = self._reader.get_field(key)
        return None if field is None else field.contents()

    def optional_tensor(self, name: str) -> TensorInfo | None:
        """Any tensor of the file by name (not only the MoE layers' four), or None."""
        if self._reader is None:
            raise ModelError(f"{self.path}: the model is closed")
        for tensor in self._reader.tensors:
            if tensor.name == name:
                qtype = GGMLQuantizationType(tensor.tensor_type)
                ne = tuple(int(d) for d in tensor.shape)
                return TensorInfo(name, qtype, ne, int(tensor.n_bytes), int(tensor.data_offset))
        return None

    def raw(self, tensor: str | TensorInfo) -> np.ndarray:
        """The bytes of a tensor as a read-only view of the mapping."""
        info = self.tensor(tensor) if isinstance(tensor, str) else tensor
        return self.mapping[info.offset : info.end]

    def close(self) -> None:
        """Drop this model's reference to the mapping; views handed out keep it alive."""
        self._reader = None

    def __repr__(self) -> str:
        return (
            f"MoeModel({str(self.path)!r}, {self.arch}, {self.n_layer} layers, {self.n_expert} experts, "
            f"top-{self.top_k}, n_embd {self.n_embd}, n_ff {self.n_ff})"
        )


def _field(path: Path, reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ModelError(f"{path}: metadata key {key!r} is missing")
    return field.contents()


def _read_dims(path: Path, reader: GGUFReader) -> _Dims:
    arch = str(_field(path, reader, "general.architecture"))
    # Some converters write only feed_forward_length for the expert width.
    ff_key = f"{arch}.expert_feed_forward_length"
    if reader.get_field(ff_key) is None and reader.get_field(f"{arch}.feed_forward_length") is not None:
        ff_key = f"{arch}.feed_forward_length"
    dims = _Dims(
        arch=arch,
        n_layer=int(_field(path, reader, f"{arch}.block_count")),
        n_expert=int(_field(path, reader, f"{arch}.expert_count")),
        top_k=int(_field(path, reader, f"{arch}.expert_used_count")),
        n_embd=int(_field(path, reader, f"{arch}.embedding_length")),
        n_ff=int(_field(path, reader, ff_key)),
    )
    if min(dims.n_layer, dims.n_expert, dims.top_k, dims.n_embd, dims.n_ff) < 1 or dims.top_k > dims.n_expert:
        raise ModelError(f"{path}: inconsistent MoE metadata {dims}")
    return dims


def _read_layer(path: Path, found: Mapping[str, ReaderTensor], dims: _Dims, index: int) -> MoeLayer:
    router, gate, up, down = (
        _read_tensor(path, found, dims, role, index) for role in (TensorRole.ROUTER, *EXPERT_ROLES)
    )
    return MoeLayer(index, router, gate, up, down)


def _read_tensor(
    path: Path, found: Mapping[str, ReaderTensor], dims: _Dims, role: TensorRole, layer: int
) -> TensorInfo:
    name = role.tensor_name(layer)
    tensor = found.get(name)
    if tensor is None:
        raise ModelError(f"{path}: tensor {name} is missing")
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in role.allowed_types:
        kind = "router" if role is TensorRole.ROUTER else "expert"
        raise ModelError(f"{path}: {name} is {qtype.name}; supported {kind} types are {type_names(role.allowed_types)}")
    ne = tuple(int(d) for d in tensor.shape)
    expected = role.ne(dims.n_embd, dims.n_ff, dims.n_expert)
    if ne != expected:
        raise ModelError(f"{path}: {name} has shape {ne}; expected {expected} (ggml order) from the metadata")
    # GGUFReader already refused a file too short for its tensors.
    return TensorInfo(name, qtype, ne, int(tensor.n_bytes), int(tensor.data_offset))
