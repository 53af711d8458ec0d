"""Per-tensor types of llama.cpp's quantization mixes, for the tensors of an MoE model.

A mix (``Q4_K_M``, ``Q5_K_M``, ``Q6_K``, ``Q8_0``, ``MXFP4_MOE``, ``IQ4_XS``) has a default
type and rules that raise some tensors, as llama-quant.cpp chooses them:

- ffn_down tensors (routed, shared and dense alike, counted together): Q4_K_M and Q5_K_M
  use Q6_K where ``use_more_bits`` (the first and last eighth of them, and every third in
  between);
- attn_v: Q6_K by the same rule for Q4_K_M and Q5_K_M, Q5_K for IQ4_XS with a GQA ratio
  of 4 or more; attn_k and attn_v Q8_0 in 8-expert models; attn_output Q5_K in 8-expert
  models for Q4_K_M and IQ4_XS;
- output.weight: Q6_K unless the mix is Q8_0;
- MXFP4_MOE: 3-D expert tensors MXFP4, every other matrix Q8_0;
- a row length that is not a multiple of 256 falls back from the k-quants: Q4_K to Q5_0,
  Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to IQ4_NL;
- 1-D tensors, the router (ffn_gate_inp) and biases stay F32.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

MIX_DEFAULTS: dict[str, T] = {
    "Q4_K_M": T.Q4_K,
    "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K,
    "Q8_0": T.Q8_0,
    "MXFP4_MOE": T.MXFP4,
    "IQ4_XS": T.IQ4_XS,
}
MIX_FILE_TYPES: dict[str, LlamaFileType] = {
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "MXFP4_MOE": LlamaFileType.MOSTLY_MXFP4_MOE,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
}
_K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}
_LAYER = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


@dataclass(frozen=True)
class TensorShape:
    name: str
    ne: tuple[int, ...]


def is_quantizable(t: TensorShape) -> bool:
    return len(t.ne) >= 2 and "ffn_gate_inp" not in t.name and not t.name.endswith(".bias")


def mix_types(mix: str, tensors: Sequence[TensorShape], n_expert: int, n_gqa: int) -> dict[str, T]:
    """The type llama.cpp's ``mix`` gives each tensor (F32 where it keeps floats)."""
    default = MIX_DEFAULTS[mix]
    n_down = sum("ffn_down" in t.name for t in tensors)
    n_attn_v = sum("attn_v.weight" in t.name for t in tensors)
    i_down = i_attn_v = 0
    types: dict[str, T] = {}
    for t in tensors:
        if not is_quantizable(t):
            types[t.name] = T.F32
            continue
        qtype = default
        if mix == "MXFP4_MOE":
            qtype = T.MXFP4 if len(t.ne) == 3 else T.Q8_0
        elif t.name == "output.weight":
            qtype = default if default is T.Q8_0 else T.Q6_K
        elif "attn_v.weight" in t.name:
            if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_attn_v, n_attn_v):
                qtype = T.Q6_K
            elif mix == "IQ4_XS" and n_gqa >= 4:
                qtype = T.Q5_K
            if n_expert == 8:
                qtype = T.Q8_0
            i_attn_v += 1
        elif "attn_k.weight" in t.name and n_expert == 8:
            qtype = T.Q8_0
        elif "attn_output.weight" in t.name and n_expert == 8 and mix in ("Q4_K_M", "IQ4_XS"):
            qtype = T.Q5_K
        elif "ffn_down" in t.name:
            # with experts, llama.cpp takes the layer from the name and counts every ffn_down tensor
            match = _LAYER.match(t.name)
            i_layer = int(match.group(1)) if match and n_expert > 1 else i_down
            if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, n_down):
                qtype = T.Q6_K
            i_down += 1
        if t.ne[0] % 256 and qtype in _K_FALLBACK:
            qtype = _K_FALLBACK[qtype]
        types[t.name] = qtype
    return types
