"""Per-tensor types of llama.cpp's quantization mixes, for the tensors of an MoE model.

A mix (``Q4_K_M``, ``IQ2_XXS``, ...) has a default type and rules that change some
tensors, as llama-quant.cpp chooses them. Tensors are sorted into llama.cpp's categories
by name (output, token_embd, attn_v-like: attn_v, attn_qkv and attn_kv_b; attn_k, attn_q,
attn_output, ffn_up, ffn_gate, ffn_down). The rules that apply to MoE files:

- output.weight: Q8_0 where its rows do not fit the default type's blocks or the mix is
  MXFP4_MOE; Q5_K for IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M and IQ3_XXS; else Q6_K
  unless the default is Q8_0.
- MXFP4_MOE: 3-D expert tensors MXFP4, every other matrix Q8_0.
- token_embd: Q2_K for IQ1_S, IQ1_M, IQ2_XXS and IQ2_XS; IQ3_S for IQ2_S, IQ2_M and IQ3_XXS.
- The 1- and 2-bit i-quant mixes (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M): attn_v Q4_K
  (any model with 4 or more experts); attn_k Q4_K in 8-expert models; the first n_layer / 8
  ffn_down tensors, counted in file order, Q2_K (IQ3_S for IQ2_S and IQ2_M); attn_output
  Q5_K in 8-expert models, else IQ2_XXS for IQ1_S/IQ1_M and IQ3_S for IQ2_S/IQ2_M.
- Every other mix: attn_v Q6_K by ``use_more_bits`` for Q4_K_M and Q5_K_M, Q4_K with a GQA
  ratio of 4 or more for IQ3_XXS, IQ3_XS, IQ3_S, always for IQ3_M, Q5_K for IQ4_XS with a
  GQA ratio of 4 or more, Q8_0 in 8-expert models; attn_k Q8_0 in 8-expert models, else
  IQ3_XXS for IQ3_XS and IQ2_S for IQ3_XXS; attn_q IQ3_XXS for IQ3_XS and IQ2_S for
  IQ3_XXS; ffn_down (layer from the name) Q6_K by ``use_more_bits`` for Q4_K_M and Q5_K_M,
  Q4_K for IQ3_M in the first eighth of the layers; attn_output Q5_K in 8-expert models
  (Q4_K_M, IQ4_XS, the IQ3 mixes), else IQ3_S for IQ3_XXS and Q4_K for IQ3_M; ffn_gate and
  ffn_up IQ3_XXS for IQ3_XS outside the first and last eighth of the layers.
- A row length that is not a multiple of the chosen type's block falls back: the
  i-quants to IQ4_NL, Q2_K and Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0; F16
  where that does not fit either.
- 1-D tensors, the router (ffn_gate_inp), convolution weights (ssm_conv1d) and biases stay F32.
- Linear attention's attn_qkv counts as attn_v; attn_gate, ssm_ba and ssm_out take the default.

The files are taken as quantized with an importance matrix, as llama.cpp requires for the
1- and 2-bit i-quants and as published i-quant files are made (IQ3_XXS keeps IQ3_XXS in
attn_v and ffn_down then).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as T

MIX_DEFAULTS: dict[str, T] = {
    "Q4_K_M": T.Q4_K,
    "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K,
    "Q8_0": T.Q8_0,
    "MXFP4_MOE": T.MXFP4,
    "IQ4_XS": T.IQ4_XS,
    "IQ1_S": T.IQ1_S,
    "IQ1_M": T.IQ1_M,
    "IQ2_XXS": T.IQ2_XXS,
    "IQ2_XS": T.IQ2_XS,
    "IQ2_S": T.IQ2_XS,  # llama.cpp's IQ2_S mix stores IQ2_XS by default
    "IQ2_M": T.IQ2_S,
    "IQ3_XXS": T.IQ3_XXS,
    "IQ3_XS": T.IQ3_S,
    "IQ3_S": T.IQ3_S,
    "IQ3_M": T.IQ3_S,
}
MIX_FILE_TYPES: dict[str, LlamaFileType] = {mix: LlamaFileType[f"MOSTLY_{mix}"] for mix in MIX_DEFAULTS}

_LOW_BIT_MIXES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M"})
_FALLBACK = {
    **dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS), T.IQ4_NL),
    T.Q2_K: T.Q4_0,
    T.Q3_K: T.Q4_0,
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}
_LAYER = re.compile(r"blk\.(\d+)\.")


class Category(enum.Enum):
    """llama.cpp's tensor categories for type choices, from the tensor name."""

    OUTPUT = enum.auto()
    TOKEN_EMBD = enum.auto()
    ATTN_V = enum.auto()  # attn_v, attn_qkv and attn_kv_b
    ATTN_K = enum.auto()
    ATTN_Q = enum.auto()
    ATTN_OUTPUT = enum.auto()
    FFN_UP = enum.auto()
    FFN_GATE = enum.auto()
    FFN_DOWN = enum.auto()
    OTHER = enum.auto()


_CATEGORY_BY_PART = (
    ("attn_qkv.weight", Category.ATTN_V),
    ("attn_kv_b.weight", Category.ATTN_V),
    ("attn_v.weight", Category.ATTN_V),
    ("attn_k.weight", Category.ATTN_K),
    ("attn_q.weight", Category.ATTN_Q),
    ("attn_output.weight", Category.ATTN_OUTPUT),
    ("ffn_up", Category.FFN_UP),
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
)


def category(name: str) -> Category:
    if name == "output.weight":
        return Category.OUTPUT
    if name == "token_embd.weight":
        return Category.TOKEN_EMBD
    return next((c for part, c in _CATEGORY_BY_PART if part in name), Category.OTHER)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


@dataclass(frozen=True)
class TensorShape:
    name: str
    ne: tuple[int, ...]


def is_quantizable(t: TensorShape) -> bool:
    return (
        len(t.ne) >= 2 and "ffn_gate_inp" not in t.name and "ssm_conv1d" not in t.name and not t.name.endswith(".bias")
    )


@dataclass(frozen=True)
class _Model:
    """What the rules read besides the tensor: the model's counts."""

    n_layer: int
    n_expert: int
    n_gqa: int
    n_attn_v: int


@dataclass
class _Counters:
    """Tensors of a category seen so far, in file order, as llama.cpp counts them."""

    attn_v: int = 0
    ffn_down: int = 0
    ffn_gate: int = 0
    ffn_up: int = 0


def mix_types(mix: str, tensors: Sequence[TensorShape], n_expert: int, n_gqa: int, n_layer: int) -> dict[str, T]:
    """The type llama.cpp's ``mix`` gives each tensor (F32 where it keeps floats)."""
    default = MIX_DEFAULTS[mix]
    model = _Model(n_layer, n_expert, n_gqa, sum(category(t.name) is Category.ATTN_V for t in tensors))
    tied_embeddings = all(category(t.name) is not Category.OUTPUT for t in tensors)
    seen = _Counters()
    types: dict[str, T] = {}
    for t in tensors:
        if not is_quantizable(t):
            types[t.name] = T.F32
            continue
        cat = category(t.name)
        if cat is Category.TOKEN_EMBD and tied_embeddings:  # it is the output matrix too
            cat = Category.OUTPUT
        types[t.name] = _fallback(_choose(mix, default, t, cat, model, seen), t.ne[0])
        counter = _COUNTED.get(cat)
        if counter is not None:
            setattr(seen, counter, getattr(seen, counter) + 1)
    return types


_COUNTED = {
    Category.ATTN_V: "attn_v",
    Category.FFN_DOWN: "ffn_down",
    Category.FFN_GATE: "ffn_gate",
    Category.FFN_UP: "ffn_up",
}


def _layer(t: TensorShape, model: _Model, counted: int) -> int:
    """The layer of a per-layer tensor: from its name in MoE models, else the running count."""
    match = _LAYER.match(t.name)
    return int(match.group(1)) if match and model.n_expert > 1 else counted


def _choose(mix: str, default: T, t: TensorShape, cat: Category, model: _Model, seen: _Counters) -> T:
    if cat is Category.OUTPUT:
        return _output(mix, default, t)
    if mix == "MXFP4_MOE":
        return T.MXFP4 if len(t.ne) == 3 else T.Q8_0
    if cat is Category.TOKEN_EMBD:
        if mix in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS"):
            return T.Q2_K
        return T.IQ3_S if mix in ("IQ2_S", "IQ2_M", "IQ3_XXS") else default
    if mix in _LOW_BIT_MIXES:
        return _choose_low_bit(mix, default, cat, model, seen)
    if cat is Category.ATTN_V:
        return _attn_v(mix, default, model, seen)
    if cat in (Category.ATTN_K, Category.ATTN_Q):
        if cat is Category.ATTN_K and model.n_expert == 8:
            return T.Q8_0
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(mix, default)
    if cat is Category.ATTN_OUTPUT:
        return _attn_output(mix, default, model)
    return _ffn(mix, default, t, cat, model, seen)


def _output(mix: str, default: T, t: TensorShape) -> T:
    """The output head."""
    if mix == "MXFP4_MOE" or t.ne[0] % GGML_QUANT_SIZES[default][0]:
        return T.Q8_0
    if mix in _LOW_BIT_MIXES or mix == "IQ3_XXS":
        return T.Q5_K
    return default if default is T.Q8_0 else T.Q6_K


def _attn_output(mix: str, default: T, model: _Model) -> T:
    """attn_output outside the 1- and 2-bit i-quant mixes."""
    if model.n_expert == 8:
        raised = mix in ("Q4_K_M", "IQ4_XS", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M")
        return T.Q5_K if raised else default
    return {"IQ3_XXS": T.IQ3_S, "IQ3_M": T.Q4_K}.get(mix, default)


def _ffn(mix: str, default: T, t: TensorShape, cat: Category, model: _Model, seen: _Counters) -> T:
    """The feed-forward tensors (and anything else) outside the 1- and 2-bit i-quant mixes."""
    if cat is Category.FFN_DOWN:
        i_layer = _layer(t, model, seen.ffn_down)
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, model.n_layer):
            return T.Q6_K
        more_bits = i_layer < model.n_layer // 8 or (model.n_expert == 8 and use_more_bits(i_layer, model.n_layer))
        return T.Q4_K if mix == "IQ3_M" and more_bits else default
    if cat in (Category.FFN_GATE, Category.FFN_UP) and mix == "IQ3_XS":
        i_layer = _layer(t, model, seen.ffn_gate if cat is Category.FFN_GATE else seen.ffn_up)
        if model.n_layer // 8 <= i_layer < 7 * model.n_layer // 8:
            return T.IQ3_XXS
    return default


def _choose_low_bit(mix: str, default: T, cat: Category, model: _Model, seen: _Counters) -> T:
    """The rules of the 1- and 2-bit i-quant mixes."""
    raised = T.IQ3_S if mix in ("IQ2_S", "IQ2_M") else T.Q2_K
    if cat is Category.ATTN_V:
        return T.Q4_K if model.n_gqa >= 4 or model.n_expert >= 4 else raised
    if cat is Category.ATTN_K and model.n_expert == 8:
        return T.Q4_K
    if cat is Category.FFN_DOWN:
        return raised if seen.ffn_down < model.n_layer // 8 else default
    if cat is Category.ATTN_OUTPUT:
        if model.n_expert == 8:
            return T.Q5_K
        return {"IQ1_S": T.IQ2_XXS, "IQ1_M": T.IQ2_XXS, "IQ2_S": T.IQ3_S, "IQ2_M": T.IQ3_S}.get(mix, default)
    return default


def _attn_v(mix: str, default: T, model: _Model, seen: _Counters) -> T:
    """attn_v-like tensors outside the 1- and 2-bit i-quant mixes."""
    if model.n_expert == 8:
        return T.Q8_0
    if (mix in ("IQ3_XXS", "IQ3_XS", "IQ3_S") and model.n_gqa >= 4) or mix == "IQ3_M":
        return T.Q4_K
    if mix == "IQ4_XS" and model.n_gqa >= 4:
        return T.Q5_K
    if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(seen.attn_v, model.n_attn_v):
        return T.Q6_K
    return default


def _fallback(qtype: T, n_cols: int) -> T:
    """llama.cpp's type for rows that do not fit ``qtype``'s blocks."""
    if n_cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = _FALLBACK.get(qtype, qtype)
    return fallback if n_cols % GGML_QUANT_SIZES[fallback][0] == 0 else T.F16
