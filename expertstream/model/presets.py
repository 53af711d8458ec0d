"""Shapes of the MoE models the synthetic writer can imitate.

Only what decides transfer sizes is kept: layer count, experts, routing width and the two
matrix dimensions of one expert. ``tiny`` is for tests; its ``n_ff_exp`` (192) is not a
multiple of 512, so the down projection's rows need the quantized-row padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument


@dataclass(frozen=True)
class ModelPreset:
    name: str
    arch: str  # gguf's architecture name, which prefixes the metadata keys
    n_layer: int
    n_expert: int
    top_k: int
    n_embd: int
    n_ff_exp: int


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", "qwen3moe", n_layer=2, n_expert=8, top_k=2, n_embd=256, n_ff_exp=192),
        ModelPreset("qwen3-30b-a3b", "qwen3moe", n_layer=48, n_expert=128, top_k=8, n_embd=2048, n_ff_exp=768),
        ModelPreset("gpt-oss-20b", "gpt-oss", n_layer=24, n_expert=32, top_k=4, n_embd=2880, n_ff_exp=2880),
        # 512 experts, top-10, 48 MoE layers: the expert layout of the R9700 measurements in llama.cpp PR #28414.
        ModelPreset("qwen3-next-80b-a3b", "qwen3next", n_layer=48, n_expert=512, top_k=10, n_embd=2048, n_ff_exp=512),
        # The R9700 model of llama.cpp PR #28414: ffn_down has ne0 = 640, and its 891 MB (Q8_0) and 629 MB (Q5_1)
        # sizes give n_embd = 2560. In Q4_0 its experts take 67.9 GB (its mixed quants ~72 GB).
        ModelPreset("qwen3.8-flash-next", "qwen3next", n_layer=48, n_expert=512, top_k=10, n_embd=2560, n_ff_exp=640),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; InvalidArgument lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown model preset {name!r}", hint=f"choose one of {', '.join(PRESETS)}") from None
