"""What the rest of a transformer layer computes around its MoE block, and how a file says so.

The whole forward pass of the architectures this package runs end to end, as llama.cpp
computes them: token embeddings, then per layer an RMS norm, attention (Q/K/V projections with
biases where the file has them, per-head Q/K norm where it has those weights, RoPE, grouped-query
heads, causal mask, sliding window and attention sinks where the architecture has them), the
output projection and the residual add, a second RMS norm, the MoE block (or a dense FFN in a
leading dense layer) and its residual add; at the end an RMS norm and the output head.

``Transformer.read`` takes a file's hyperparameters over the architecture's fixed choices
(``ATTENTION``) and refuses an architecture whose layers this package cannot run yet, naming
what is missing: a file is never run with a stand-in in place of layers it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.dense import Rope
from ..model import ModelError, MoeModel
from .arch import ArchKeys

_DEFAULT_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ArchAttention:
    """One architecture's attention as llama.cpp builds it."""

    arch: str
    neox: bool  # RoPE pairs (i, i + n_rot/2) rather than (2i, 2i + 1)
    ffn_norm: str  # the name of the norm before the FFN
    swa_period: int = 0  # layer il slides its window where il % period < period - 1 (0: no sliding window)


ATTENTION: dict[str, ArchAttention] = {
    a.arch: a
    for a in (
        ArchAttention("qwen3moe", neox=True, ffn_norm="ffn_norm"),
        ArchAttention("qwen2moe", neox=True, ffn_norm="ffn_norm"),
        ArchAttention("llama", neox=False, ffn_norm="ffn_norm"),
        ArchAttention("gpt-oss", neox=True, ffn_norm="post_attention_norm", swa_period=2),
        ArchAttention("glm4moe", neox=True, ffn_norm="post_attention_norm"),
    )
}

# What the architectures this package does not run end to end yet have that it lacks.
NOT_YET: dict[str, str] = {
    "deepseek2": "multi-head latent attention (MLA)",
    "qwen3next": "gated delta-net (linear attention) layers and gated full attention",
}


@dataclass(frozen=True)
class Transformer:
    """A file's attention and normalization hyperparameters."""

    arch: ArchAttention
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    eps: float
    rope: Rope
    sliding_window: int

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: it attends to every earlier position)."""
        period = self.arch.swa_period
        if not period or not self.sliding_window:
            return 0
        return self.sliding_window if layer % period < period - 1 else 0

    @classmethod
    def read(cls, model: MoeModel) -> Transformer:
        """The hyperparameters of ``model``; ModelError names the file and what it lacks."""
        arch = model.arch
        where = str(model.path)
        if arch in NOT_YET:
            raise ModelError(
                f"{where}: architecture {arch!r} is not run end to end yet: its {NOT_YET[arch]} is missing here. "
                "Its expert pipeline alone runs with --experts-only"
            )
        spec = ATTENTION.get(arch)
        if spec is None:
            raise ModelError(
                f"{where}: architecture {arch!r} has no whole-model forward pass here (known: "
                f"{', '.join(sorted(ATTENTION))}); --experts-only runs its expert blocks alone"
            )
        keys = ArchKeys(model.arch, model.metadata, str(model.path))
        n_head = keys.integer("attention.head_count", per_layer=True)
        n_head_kv = keys.integer("attention.head_count_kv", n_head, per_layer=True)
        head_dim = keys.integer("attention.key_length", model.n_embd // max(n_head, 1))
        if n_head < 1 or n_head_kv < 1 or n_head % n_head_kv:
            raise ModelError(f"{where}: {n_head} query heads cannot share {n_head_kv} key-value heads evenly")
        if keys.integer("attention.value_length", head_dim) != head_dim:
            raise ModelError(f"{where}: keys and values of different widths are not supported")
        embd = model.optional_tensor("token_embd.weight")
        if embd is None:
            raise ModelError(f"{where}: no token_embd.weight: the file has no token embeddings")
        _refuse_what_is_not_run(model, keys)
        # GLM-4.5's multi-token-prediction layers come last; llama.cpp skips them, as this does.
        nextn = keys.integer("nextn_predict_layers", 0)
        if not 0 <= nextn < model.n_layer:
            raise keys.error("nextn_predict_layers", nextn, f"0..{model.n_layer - 1}")
        window = keys.integer("attention.sliding_window", 0)
        if spec.swa_period and not window:
            key = f"{arch}.attention.sliding_window"
            raise ModelError(f"{where}: metadata key {key!r} is missing; {arch} needs it")
        return cls(
            arch=spec,
            n_layer=model.n_layer - nextn,
            n_embd=model.n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=embd.ne[1],
            eps=keys.real("attention.layer_norm_rms_epsilon", 1e-6),
            rope=_rope(keys, spec, head_dim),
            sliding_window=window,
        )


def _rope(keys: ArchKeys, spec: ArchAttention, head_dim: int) -> Rope:
    """RoPE as llama.cpp sets it up: YaRN where rope.scaling.type says so, linear scaling otherwise."""
    n_rot = keys.integer("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise keys.error("rope.dimension_count", n_rot, f"an even number up to the head size {head_dim}")
    base = keys.real("rope.freq_base", _DEFAULT_ROPE_BASE)
    scaling = keys.value("rope.scaling.type") or "linear"  # llama.cpp's default type
    factor = keys.real("rope.scaling.factor", keys.real("rope.scale_linear", 0.0))
    freq_scale = 1.0 / factor if factor > 0 and scaling != "none" else 1.0
    if scaling not in ("none", "linear", "yarn"):
        raise keys.error("rope.scaling.type", scaling, "none, linear or yarn")
    yarn = scaling == "yarn"
    return Rope(
        n_rot=n_rot,
        neox=spec.neox,
        freq_base=base,
        freq_scale=freq_scale,
        ext_factor=1.0 if yarn else 0.0,
        attn_factor=keys.real("rope.scaling.attn_factor", 1.0),
        beta_fast=keys.real("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=keys.real("rope.scaling.yarn_beta_slow", 1.0),
        n_ctx_orig=keys.integer("rope.scaling.original_context_length", keys.integer("context_length", 0)),
    )


def _refuse_what_is_not_run(model: MoeModel, keys: ArchKeys) -> None:
    """Settings llama.cpp honours that this forward pass does not compute: refused, never ignored."""
    where = str(model.path)
    if keys.value("rope.dimension_sections") is not None:
        raise ModelError(f"{where}: multi-section RoPE (rope.dimension_sections) is not run here")
    if model.optional_tensor("rope_freqs.weight") is not None:
        raise ModelError(f"{where}: per-dimension RoPE factors (rope_freqs.weight) are not run here")
    base_swa = keys.value("rope.freq_base_swa")
    if base_swa is not None and base_swa != keys.real("rope.freq_base", _DEFAULT_ROPE_BASE):
        raise ModelError(f"{where}: a RoPE base of sliding-window layers of their own (rope.freq_base_swa) is not run")
    pattern = keys.value("attention.sliding_window_pattern")
    if pattern is not None:
        # llama.cpp takes a period n (layer il slides where il % n < n - 1) or one flag per layer
        period = ATTENTION[model.arch].swa_period
        ours = [bool(period) and i % period < period - 1 for i in range(model.n_layer)]
        same = [bool(flag) for flag in pattern] == ours if isinstance(pattern, list) else pattern == period
        if not same:
            raise ModelError(f"{where}: sliding-window layer pattern {pattern!r} is not the one run here")
