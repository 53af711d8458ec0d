"""GGUF MoE models: presets of real shapes, a synthetic writer and a mapping loader."""

from __future__ import annotations

from .loader import MoeLayer, MoeModel, TensorInfo
from .presets import PRESETS, ModelPreset, get_preset
from .schema import EXPERT_TYPES, ModelError, TensorRole, parse_expert_type
from .writer import TensorSpec, file_specs, generate, make_model, start_model_file, tensor_specs

__all__ = [
    "EXPERT_TYPES",
    "PRESETS",
    "ModelError",
    "ModelPreset",
    "MoeLayer",
    "MoeModel",
    "TensorInfo",
    "TensorRole",
    "TensorSpec",
    "file_specs",
    "generate",
    "get_preset",
    "make_model",
    "parse_expert_type",
    "start_model_file",
    "tensor_specs",
]
