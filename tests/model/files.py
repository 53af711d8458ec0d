"""Write small GGUF files for loader tests: MoE layers of chosen widths, split or not, keys as given."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from expertstream.model import TensorRole, TensorSpec, generate

N_EMBD = 64
Tensors = dict[str, tuple[GGMLQuantizationType, np.ndarray]]
TOP_K = 2


def layer_tensors(layer: int, n_expert: int, n_ff: int, seed: int = 0) -> Tensors:
    """The four MoE tensors of one layer (F32 router, Q8_0 experts) with the writer's seeded weights."""
    out: Tensors = {}
    for role in TensorRole:
        qtype = GGMLQuantizationType.F32 if role is TensorRole.ROUTER else GGMLQuantizationType.Q8_0
        spec = TensorSpec(role.tensor_name(layer), role, layer, qtype, role.ne(N_EMBD, n_ff, n_expert))
        out[spec.name] = (qtype, generate(spec, seed).reshape(spec.byte_shape))
    return out


def model_tensors(widths: Iterable[tuple[int, int]], seed: int = 0) -> Tensors:
    """Tensors of layers given as (n_expert, n_ff); a layer with 0 experts gets none."""
    tensors: Tensors = {}
    for layer, (n_expert, n_ff) in enumerate(widths):
        if n_expert:
            tensors.update(layer_tensors(layer, n_expert, n_ff, seed))
    return tensors


def add_keys(writer: gguf.GGUFWriter, keys: Mapping[str, Any]) -> None:
    """uint32 for ints, int32 arrays for lists, strings for str."""
    for key, value in keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)


def moe_keys(arch: str, n_layer: int, n_expert: Any, n_ff_exp: Any = None, **extra: Any) -> dict[str, Any]:
    keys: dict[str, Any] = {
        f"{arch}.block_count": n_layer,
        f"{arch}.embedding_length": N_EMBD,
        f"{arch}.expert_count": n_expert,
        f"{arch}.expert_used_count": TOP_K,
    }
    if n_ff_exp is not None:
        keys[f"{arch}.expert_feed_forward_length"] = n_ff_exp
    keys.update({f"{arch}.{k}": v for k, v in extra.items()})
    return keys


def write_file(
    path: Path,
    arch: str,
    keys: Mapping[str, Any],
    tensors: Mapping[str, tuple[GGMLQuantizationType, np.ndarray]],
    *,
    split_max_tensors: int = 0,
) -> Path:
    """One file, or gguf-py's split shards when ``split_max_tensors`` is set; returns the first."""
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    add_keys(writer, keys)
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]


def write_shard(
    path: Path,
    arch: str,
    tensors: Mapping[str, tuple[GGMLQuantizationType, np.ndarray]],
    split: tuple[int, int, int],
    keys: Mapping[str, Any] | None = None,
) -> Path:
    """One shard written by hand: ``split`` is (split.no, split.count, split.tensors.count)."""
    writer = gguf.GGUFWriter(path, arch)
    no, count, total = split
    writer.add_uint16("split.no", no)
    writer.add_uint16("split.count", count)
    writer.add_int32("split.tensors.count", total)
    add_keys(writer, keys or {})
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
