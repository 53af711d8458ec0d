"""Open a GGUF MoE model (one file, or the shards gguf-split wrote) as read-only mappings.

The loader checks what the streaming path relies on (metadata, the four per-layer tensors,
their shapes and types) and records in which shard and where each tensor's bytes lie. It
never copies tensor data: ``raw`` is a view of a shard's mapping.

Metadata follows llama.cpp: ``{arch}.expert_count`` and the two feed-forward lengths may be
one integer or an array with one entry per layer. Layers without experts (the first
``{arch}.leading_dense_block_count`` layers, layers whose expert count is 0, or layers that
hold none of the four MoE tensors) are dense and left out of ``layers``. When
``{arch}.expert_feed_forward_length`` is absent, the expert width is what llama.cpp uses for
the architecture: ``feed_forward_length / expert_used_count`` for the Qwen MoE family
(qwen2moe.cpp, qwen3moe.cpp, qwen3next), ``feed_forward_length`` itself for architectures
whose expert tensors are declared with n_ff (Mixtral as llama, phimoe, olmoe, grok, dbrx);
every other architecture must have the key, as llama.cpp requires it there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, ReaderTensor

from .._closing import Closing
from ..errors import InvalidArgument
from .metadata import Metadata
from .schema import EXPERT_ROLES, ModelError, TensorRole, type_names
from .shards import Shard, ShardedTensor, open_shards

log = logging.getLogger(__name__)

# llama.cpp: n_ff_exp = hparams.n_ff_exp ? hparams.n_ff_exp : n_ff / n_expert_used
FF_PER_USED_EXPERT_ARCHS = frozenset({"qwen2moe", "qwen3moe", "qwen3next", "qwen3vlmoe", "qwen35moe"})
# llama.cpp declares these architectures' expert tensors with n_ff (feed_forward_length).
FF_IS_EXPERT_WIDTH_ARCHS = frozenset({"llama", "phimoe", "olmoe", "flex-olmo", "grok", "dbrx"})
# Per-layer values are expanded to one per block: a block count is refused far above llama.cpp's
# own limit (LLAMA_MAX_LAYERS, 512) before it can size anything.
MAX_BLOCKS = 4096


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives (which shard, at which offset) and what it holds."""

    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    nbytes: int
    offset: int  # absolute byte offset of the data in its shard's file
    shard: int = 0  # index of the file (gguf-split shard) holding the data

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
    index: int  # the block index in the file (dense blocks are not MoeLayers)
    router: TensorInfo
    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo

    @property
    def experts(self) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
        return (self.gate, self.up, self.down)

    @property
    def n_expert(self) -> int:
        return self.gate.ne[2]

    @property
    def n_ff(self) -> int:
        return self.gate.ne[1]


@dataclass(frozen=True)
class _Dims:
    arch: str
    n_layer: int
    top_k: int
    n_embd: int
    n_expert: tuple[int, ...]  # per block; 0 for a dense block
    n_ff: tuple[int, ...]  # expert width per block; 0 for a dense block


class MoeModel(Closing):
    """A GGUF MoE model mapped read-only; use as a context manager or call close()."""

    def __init__(self, path: Path, shards: list[Shard], dims: _Dims, layers: tuple[MoeLayer, ...]) -> None:
        self.path = path
        self.paths = tuple(shard.path for shard in shards)
        self.arch = dims.arch
        self.n_layer = dims.n_layer  # blocks in the file, dense ones included
        self.top_k = dims.top_k
        self.n_embd = dims.n_embd
        # Scratch is sized by the widest layer; each layer knows its own n_expert and n_ff.
        self.n_expert = max(layer.n_expert for layer in layers)
        self.n_ff = max(layer.n_ff for layer in layers)
        self.layers = layers
        self.tensors: Mapping[str, TensorInfo] = {t.name: t for layer in layers for t in (layer.router, *layer.experts)}
        self._shards: list[Shard] | None = shards
        self._dims = dims

    @classmethod
    def open(cls, path: str | Path) -> MoeModel:
        """Map ``path`` (a file, or the first shard of a split model) and check it.

        ModelError names the file and what is wrong, for any file whatever its bytes.
        """
        path = Path(path)
        shards, found = open_shards(path)
        dims = _read_dims(shards[0].metadata)
        layers = tuple(
            layer for i in range(dims.n_layer) if (layer := _read_layer(path, shards, found, dims, i)) is not None
        )
        if not layers:
            raise ModelError(f"{path}: none of the {dims.n_layer} layers has experts; this is not an MoE model")
        log.debug(
            "opened %s: %s, %d of %d layers with experts, %d shard(s)",
            path,
            dims.arch,
            len(layers),
            dims.n_layer,
            len(shards),
        )
        return cls(path, shards, dims, layers)

    def spread_layers(self, count: int) -> MoeModel:
        """``count`` MoE layers spread evenly from the first to the last, as a model of their own over
        the same mappings: a smaller job whose bytes lie across the whole file, as the whole job's
        do. Closing it leaves this model open."""
        n = len(self.layers)
        if not 1 <= count <= n:
            raise InvalidArgument(f"{self.path}: asked for {count} of {n} MoE layers")
        places = [0] if count == 1 else [round(i * (n - 1) / (count - 1)) for i in range(count)]
        return MoeModel(self.path, self._open_shards(), self._dims, tuple(self.layers[i] for i in places))

    @property
    def n_shards(self) -> int:
        return len(self.paths)

    @property
    def mappings(self) -> tuple[np.ndarray, ...]:
        """Each shard's file as a flat read-only uint8 array (the mappings themselves, no copy)."""
        return tuple(shard.reader.data.view(np.ndarray) for shard in self._open_shards())

    @property
    def mapping(self) -> np.ndarray:
        """The whole file of a single-file model as a flat read-only uint8 array."""
        mappings = self.mappings
        if len(mappings) != 1:
            raise ModelError(f"{self.path}: the model is split over {len(mappings)} files; use mappings")
        return mappings[0]

    @property
    def expert_tensors(self) -> tuple[TensorInfo, ...]:
        return tuple(t for layer in self.layers for t in layer.experts)

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description of the model's MoE shape."""
        return {
            "path": str(self.path),
            "shards": self.n_shards,
            "arch": self.arch,
            "n_layer": self.n_layer,
            "moe_layers": len(self.layers),
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
        """The value of metadata ``key`` (from the first shard), or None when the file lacks it."""
        return self._open_shards()[0].metadata.value(key)

    def optional_tensor(self, name: str) -> TensorInfo | None:
        """Any tensor of the model by name (not only the MoE layers' four), or None."""
        for shard in self._open_shards():
            for tensor in shard.reader.tensors:
                if tensor.name == name:
                    qtype = GGMLQuantizationType(tensor.tensor_type)
                    ne = tuple(int(d) for d in tensor.shape)
                    return TensorInfo(name, qtype, ne, int(tensor.n_bytes), int(tensor.data_offset), shard.index)
        return None

    def _open_shards(self) -> list[Shard]:
        if self._shards is None:
            raise ModelError(f"{self.path}: the model is closed")
        return self._shards

    def raw(self, tensor: str | TensorInfo) -> np.ndarray:
        """The bytes of a tensor as a read-only view of its shard's mapping."""
        info = self.tensor(tensor) if isinstance(tensor, str) else tensor
        return self.mappings[info.shard][info.offset : info.end]

    def close(self) -> None:
        """Drop this model's references to the mappings; views handed out keep them alive."""
        self._shards = None

    def __repr__(self) -> str:
        return (
            f"MoeModel({str(self.path)!r}, {self.arch}, {len(self.layers)}/{self.n_layer} MoE layers, "
            f"{self.n_expert} experts, top-{self.top_k}, n_embd {self.n_embd}, n_ff {self.n_ff})"
        )


def _read_dims(meta: Metadata) -> _Dims:
    arch = meta.string("general.architecture")
    n_layer = meta.integer(f"{arch}.block_count")
    if n_layer > MAX_BLOCKS:
        raise ModelError(
            f"{meta.path}: metadata key {f'{arch}.block_count'!r} is {n_layer}; at most {MAX_BLOCKS} blocks are "
            "supported (llama.cpp supports 512)"
        )
    top_k = meta.integer(f"{arch}.expert_used_count")
    n_embd = meta.integer(f"{arch}.embedding_length")
    n_expert = meta.per_layer(f"{arch}.expert_count", n_layer)
    if n_expert is None:
        raise ModelError(f"{meta.path}: metadata key {f'{arch}.expert_count'!r} is missing")
    n_dense = meta.integer(f"{arch}.leading_dense_block_count", default=0)
    if n_dense > n_layer:
        raise ModelError(
            f"{meta.path}: metadata key {f'{arch}.leading_dense_block_count'!r} is {n_dense}, more than the "
            f"{n_layer} blocks"
        )
    n_expert = tuple(0 if i < n_dense else n for i, n in enumerate(n_expert))
    for key, value in ((f"{arch}.block_count", n_layer), (f"{arch}.embedding_length", n_embd)):
        if value < 1:
            raise ModelError(f"{meta.path}: metadata key {key!r} is {value}; expected at least 1")
    if max(n_expert) == 0:
        raise ModelError(f"{meta.path}: no block has experts ({f'{arch}.expert_count'!r}); this is not an MoE model")
    if top_k < 1 or top_k > max(n_expert):
        raise ModelError(
            f"{meta.path}: metadata key {f'{arch}.expert_used_count'!r} is {top_k}; expected 1..{max(n_expert)} "
            "(the expert count)"
        )
    return _Dims(arch, n_layer, top_k, n_embd, n_expert, _expert_widths(meta, arch, n_layer, top_k, n_expert))


def _expert_widths(meta: Metadata, arch: str, n_layer: int, top_k: int, n_expert: tuple[int, ...]) -> tuple[int, ...]:
    """The expert width (n_ff_exp) of each block, with llama.cpp's per-architecture fallback."""
    exp_key, ff_key = f"{arch}.expert_feed_forward_length", f"{arch}.feed_forward_length"
    n_ff_exp = meta.per_layer(exp_key, n_layer) or (0,) * n_layer
    n_ff = meta.per_layer(ff_key, n_layer)
    widths = []
    for i in range(n_layer):
        width = n_ff_exp[i]
        if width == 0 and n_expert[i] > 0:
            width = _fallback_width(meta, arch, exp_key, ff_key, n_ff[i] if n_ff else None, top_k)
        widths.append(width if n_expert[i] > 0 else 0)
    return tuple(widths)


def _fallback_width(meta: Metadata, arch: str, exp_key: str, ff_key: str, n_ff: int | None, top_k: int) -> int:
    if arch not in FF_PER_USED_EXPERT_ARCHS | FF_IS_EXPERT_WIDTH_ARCHS:
        raise ModelError(f"{meta.path}: metadata key {exp_key!r} is missing or 0 (required for {arch})")
    if not n_ff:
        raise ModelError(
            f"{meta.path}: metadata keys {exp_key!r} and {ff_key!r} are both missing or 0; one gives the expert width"
        )
    width = n_ff // top_k if arch in FF_PER_USED_EXPERT_ARCHS else n_ff
    if width < 1:
        raise ModelError(f"{meta.path}: {ff_key!r} / expert_used_count gives an expert width of 0")
    return width


def _read_layer(
    path: Path, shards: list[Shard], found: Mapping[str, ShardedTensor], dims: _Dims, index: int
) -> MoeLayer | None:
    """The layer's MoE tensors, or None for a dense layer (no experts declared, or none present)."""
    roles = (TensorRole.ROUTER, *EXPERT_ROLES)
    present = [role.tensor_name(index) in found for role in roles]
    if dims.n_expert[index] == 0 or not any(present):
        return None
    router, gate, up, down = (_read_tensor(path, shards, found, dims, role, index) for role in roles)
    return MoeLayer(index, router, gate, up, down)


def _read_tensor(
    path: Path, shards: list[Shard], found: Mapping[str, ShardedTensor], dims: _Dims, role: TensorRole, layer: int
) -> TensorInfo:
    name = role.tensor_name(layer)
    entry = found.get(name)
    if entry is None:
        raise ModelError(f"{path}: tensor {name} is missing")
    where = shards[entry.shard].path
    tensor: ReaderTensor = entry.tensor
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in role.allowed_types:
        kind = "router" if role is TensorRole.ROUTER else "expert"
        supported = type_names(role.allowed_types)
        raise ModelError(f"{where}: {name} is {qtype.name}; supported {kind} types are {supported}")
    ne = tuple(int(d) for d in tensor.shape)
    expected = role.ne(dims.n_embd, dims.n_ff[layer], dims.n_expert[layer])
    if ne != expected:
        raise ModelError(f"{where}: {name} has shape {ne}; expected {expected} (ggml order) from the metadata")
    # GGUFReader already refused a file too short for its tensors.
    return TensorInfo(name, qtype, ne, int(tensor.n_bytes), int(tensor.data_offset), entry.shard)
