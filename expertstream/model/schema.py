"""What an MoE layer looks like in a GGUF file: tensor names, shapes and allowed types.

Shared by the writer and the loader so that both agree on one layout. Shapes are in ggml
order (``ne``: the fastest-varying dimension first), as the file stores them.
"""

from __future__ import annotations

import enum

from gguf import GGMLQuantizationType

from ..errors import ExpertStreamError, InvalidArgument
from ..ggml import EXPERT_TYPES

__all__ = [
    "EXPERT_ROLES",
    "EXPERT_TYPES",
    "ROUTER_TYPES",
    "ModelError",
    "TensorRole",
    "parse_expert_type",
    "type_names",
]


class ModelError(ExpertStreamError):
    """A model file lacks something this package needs, or holds something it cannot stream."""


ROUTER_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


class TensorRole(enum.Enum):
    """The per-layer tensors of an MoE feed-forward block, by their gguf name part."""

    ROUTER = "ffn_gate_inp"
    GATE = "ffn_gate_exps"
    UP = "ffn_up_exps"
    DOWN = "ffn_down_exps"

    def tensor_name(self, layer: int) -> str:
        return f"blk.{layer}.{self.value}.weight"

    def ne(self, n_embd: int, n_ff: int, n_expert: int) -> tuple[int, ...]:
        """The shape this tensor must have, in ggml order."""
        if self is TensorRole.ROUTER:
            return (n_embd, n_expert)
        if self is TensorRole.DOWN:
            return (n_ff, n_embd, n_expert)
        return (n_embd, n_ff, n_expert)

    @property
    def allowed_types(self) -> tuple[GGMLQuantizationType, ...]:
        return ROUTER_TYPES if self is TensorRole.ROUTER else EXPERT_TYPES


EXPERT_ROLES = (TensorRole.GATE, TensorRole.UP, TensorRole.DOWN)


def type_names(types: tuple[GGMLQuantizationType, ...]) -> str:
    return ", ".join(t.name for t in types)


def parse_expert_type(qtype: GGMLQuantizationType | str, tensor: str | None = None) -> GGMLQuantizationType:
    """An expert weight type from its gguf name in any case ('Q4_K', 'q4_k') or enum member.

    InvalidArgument otherwise, naming ``tensor`` when given, the type and the supported ones.
    """
    where = f"{tensor}: " if tensor else ""
    hint = f"supported expert types are {type_names(EXPERT_TYPES)}"
    if isinstance(qtype, str):
        member = GGMLQuantizationType.__members__.get(qtype.strip().upper())
        if member is None:
            raise InvalidArgument(f"{where}unknown tensor type {qtype!r}", hint=hint)
        qtype = member
    if qtype not in EXPERT_TYPES:
        raise InvalidArgument(f"{where}{qtype.name} is not a supported expert type", hint=hint)
    return qtype
