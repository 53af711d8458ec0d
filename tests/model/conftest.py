"""Helpers that write small GGUF files, valid or deliberately broken."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.ggml import row_size
from expertstream.model import ModelPreset, TensorRole, get_preset

TINY = get_preset("tiny")
TensorOverride = tuple[GGMLQuantizationType, tuple[int, ...]]


def _zeros(qtype: GGMLQuantizationType, ne: tuple[int, ...]) -> np.ndarray:
    return np.zeros((*reversed(ne[1:]), row_size(qtype, ne[0])), dtype=np.uint8)


def write_custom(
    path: Path,
    preset: ModelPreset = TINY,
    *,
    expert_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    overrides: dict[str, TensorOverride] | None = None,
    drop_tensors: Iterable[str] = (),
    drop_keys: Iterable[str] = (),
) -> Path:
    """A preset-shaped file with zero weights, some tensors retyped, reshaped or left out."""
    overrides = overrides or {}
    dropped = set(drop_tensors)
    skip = set(drop_keys)
    writer = gguf.GGUFWriter(path, preset.arch)
    values = {
        "block_count": preset.n_layer,
        "embedding_length": preset.n_embd,
        "expert_count": preset.n_expert,
        "expert_used_count": preset.top_k,
        "expert_feed_forward_length": preset.n_ff_exp,
    }
    for key, value in values.items():
        if key not in skip:
            writer.add_uint32(f"{preset.arch}.{key}", value)
    for layer in range(preset.n_layer):
        for role in TensorRole:
            name = role.tensor_name(layer)
            if name in dropped:
                continue
            default_type = GGMLQuantizationType.F32 if role is TensorRole.ROUTER else expert_type
            qtype, ne = overrides.get(name, (default_type, role.ne(preset.n_embd, preset.n_ff_exp, preset.n_expert)))
            writer.add_tensor(name, _zeros(qtype, ne), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def custom_model(tmp_path: Path) -> Callable[..., Path]:
    def make(**kwargs: object) -> Path:
        return write_custom(tmp_path / "custom.gguf", **kwargs)  # type: ignore[arg-type]

    return make
