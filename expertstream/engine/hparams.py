"""What the rest of a transformer layer computes around its MoE block, and how a file says so.

The whole forward pass of the architectures this package runs end to end, as llama.cpp
computes them: token embeddings, then per layer an RMS norm, attention (Q/K/V projections with
biases where the file has them, per-head Q/K norm where it has those weights, RoPE, grouped-query
heads, causal mask, sliding window and attention sinks where the architecture has them), the
output projection and the residual add, a second RMS norm, the MoE block (or a dense FFN in a
leading dense layer) and its residual add; at the end an RMS norm and the output head.

qwen3next's layers are hybrid (``DeltaNet``): most are a gated delta net (a causal convolution
of the projected q, k and v, then the gated delta rule's recurrent state per value head, a gated
RMS norm and ``ssm_out``), every ``full_attention_interval``-th one gated full attention (the
query projection also gives each head a sigmoid gate on its output).

deepseek2's multi-head latent attention (``Mla``) runs as llama.cpp runs files that store
``attn_k_b`` and ``attn_v_b``: each head's query is absorbed into the latent space (``attn_k_b``),
so every head attends to one shared key-value head whose row is the normed latent followed by its
rotated part (``kv_lora_rank + n_rot`` wide; the value is the latent, the row's first
``kv_lora_rank``), and each head's output leaves the latent space through ``attn_v_b``.

``Transformer.read`` takes a file's hyperparameters over the architecture's fixed choices
(``ATTENTION``) and refuses an architecture whose layers this package cannot run yet, naming
what is missing: a file is never run with a stand-in in place of layers it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.attention import HEAD_DIMS, WIDE_DIMS
from ..kernels.dense import Rope
from ..kernels.recurrent import CONV_KERNELS, STATE_DIMS
from ..model import ModelError, MoeModel
from ..model.presets import DeltaNetShape
from .arch import ArchKeys

_DEFAULT_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ArchAttention:
    """One architecture's attention as llama.cpp builds it."""

    arch: str
    neox: bool  # RoPE pairs (i, i + n_rot/2) rather than (2i, 2i + 1)
    ffn_norm: str  # the name of the norm before the FFN
    swa_period: int = 0  # layer il slides its window where il % period < period - 1 (0: no sliding window)
    gated: bool = False  # the query projection also gives each head a sigmoid gate on its output


ATTENTION: dict[str, ArchAttention] = {
    a.arch: a
    for a in (
        ArchAttention("qwen3moe", neox=True, ffn_norm="ffn_norm"),
        ArchAttention("qwen2moe", neox=True, ffn_norm="ffn_norm"),
        ArchAttention("llama", neox=False, ffn_norm="ffn_norm"),
        ArchAttention("gpt-oss", neox=True, ffn_norm="post_attention_norm", swa_period=2),
        ArchAttention("glm4moe", neox=True, ffn_norm="post_attention_norm"),
        ArchAttention("deepseek2", neox=False, ffn_norm="ffn_norm"),
        ArchAttention("qwen3next", neox=True, ffn_norm="post_attention_norm", gated=True),
    )
}


@dataclass(frozen=True)
class DeltaNet(DeltaNetShape):
    """qwen3next's recurrent layers as a file says them: the delta net's widths and which layers have it."""

    recurrent: tuple[bool, ...]  # per layer: a delta net (else gated full attention)


@dataclass(frozen=True)
class Mla:
    """deepseek2's multi-head latent attention: the widths of its parts (llama.cpp's names)."""

    kv_lora_rank: int  # the latent a token's keys and values are made from (n_lora_kv)
    q_lora_rank: int  # 0: one attn_q; else attn_q_a, its norm, then attn_q_b
    nope: int  # dimensions of a head's query that are not rotated
    rope: int  # dimensions of a head's query and of the shared key that are (n_rot)
    v_head_dim: int  # a head's value after attn_v_b

    @property
    def q_head(self) -> int:
        """A head's query as attn_q (or attn_q_b) gives it: its unrotated part, then its rotated one."""
        return self.nope + self.rope

    @property
    def key_width(self) -> int:
        """The shared key's row, and a head's query after absorption: the latent, then the rotated part."""
        return self.kv_lora_rank + self.rope


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
    mla: Mla | None = None  # deepseek2: head_dim is then the shared key's width, n_head_kv 1
    kq_scale: float | None = None  # the softmax's scale where it is not 1 / sqrt(head_dim)
    delta_net: DeltaNet | None = None  # qwen3next: its recurrent layers, the others gated attention

    def is_recurrent(self, layer: int) -> bool:
        return self.delta_net is not None and self.delta_net.recurrent[layer]

    @property
    def gated_attention(self) -> bool:
        return self.arch.gated

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def scale(self) -> float:
        return self.kq_scale if self.kq_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def out_width(self) -> int:
        """What the output projection reads: the heads' values side by side."""
        return self.n_head * self.mla.v_head_dim if self.mla is not None else self.q_width

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
        mla = _mla(model, keys) if arch == "deepseek2" else None
        if mla is not None:
            n_head_kv, head_dim = 1, mla.key_width  # one shared key-value head after absorption
        if n_head < 1 or n_head_kv < 1 or n_head % n_head_kv:
            raise ModelError(f"{where}: {n_head} query heads cannot share {n_head_kv} key-value heads evenly")
        if mla is None and keys.integer("attention.value_length", head_dim) != head_dim:
            raise ModelError(f"{where}: keys and values of different widths are not supported")
        if head_dim not in HEAD_DIMS + WIDE_DIMS:
            what = f"deepseek2's latent attention reads keys {head_dim} wide" if mla else f"heads are {head_dim} wide"
            raise ModelError(
                f"{where}: {what}; the attention kernels take head sizes "
                f"{', '.join(map(str, HEAD_DIMS + WIDE_DIMS))}. "
                "Its expert pipeline alone runs with --experts-only"
            )
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
        rope = _rope(keys, spec, mla.rope if mla is not None else head_dim)
        delta_net = _delta_net(model, keys) if arch == "qwen3next" else None
        return cls(
            arch=spec,
            n_layer=model.n_layer - nextn,
            n_embd=model.n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=embd.ne[1],
            eps=keys.real("attention.layer_norm_rms_epsilon", 1e-6),
            rope=rope,
            sliding_window=window,
            mla=mla,
            kq_scale=_mla_kq_scale(keys, rope, mla) if mla is not None else None,
            delta_net=delta_net,
        )


def _delta_net(model: MoeModel, keys: ArchKeys) -> DeltaNet:
    """qwen3next's ssm.* keys and its layers' kinds; ModelError names what does not fit the kernels."""
    where = str(model.path)
    k_heads = keys.integer("ssm.group_count")
    v_heads = keys.integer("ssm.time_step_rank")
    head_dim = keys.integer("ssm.state_size")
    inner = keys.integer("ssm.inner_size")
    conv_kernel = keys.integer("ssm.conv_kernel")
    if k_heads < 1 or v_heads % k_heads:
        raise keys.error("ssm.time_step_rank", v_heads, f"a multiple of ssm.group_count ({k_heads})")
    if inner != v_heads * head_dim:
        raise ModelError(f"{where}: value heads {inner // max(v_heads, 1)} wide and keys {head_dim} wide differ")
    if head_dim not in STATE_DIMS:
        raise ModelError(f"{where}: delta-net heads {head_dim} wide have no kernel here (widths: {STATE_DIMS})")
    if conv_kernel not in CONV_KERNELS:
        raise ModelError(f"{where}: a convolution over {conv_kernel} tokens has no kernel here ({CONV_KERNELS})")
    flags = keys.value("attention.recurrent_layers")
    if isinstance(flags, list):  # one flag per layer, as llama.cpp reads the key's array
        if len(flags) < model.n_layer:
            raise keys.error("attention.recurrent_layers", flags, f"a flag for each of the {model.n_layer} layers")
        recurrent = tuple(bool(f) for f in flags[: model.n_layer])
    elif flags is not None:  # one value for every layer
        recurrent = (bool(flags),) * model.n_layer
    else:
        interval = keys.integer("full_attention_interval", 4)
        if interval < 1:
            raise keys.error("full_attention_interval", interval, "a positive integer")
        recurrent = tuple((i + 1) % interval != 0 for i in range(model.n_layer))
    return DeltaNet(k_heads, v_heads, head_dim, conv_kernel, recurrent)


def _mla(model: MoeModel, keys: ArchKeys) -> Mla:
    """deepseek2's latent attention widths; ModelError where the file has the older attn_kv_b layout."""
    where = str(model.path)
    kv_lora_rank = keys.integer("attention.kv_lora_rank")
    rope = keys.integer("rope.dimension_count")
    k_mla = keys.integer("attention.key_length_mla", 0)
    v_mla = keys.integer("attention.value_length_mla", 0)
    # Without both _mla keys llama.cpp runs the file's attn_kv_b, not the latent layout run here
    older = not (k_mla and v_mla) or model.optional_tensor("blk.0.attn_k_b.weight") is None
    if older:
        raise ModelError(
            f"{where}: this deepseek2 file keeps keys and values in one attn_kv_b tensor (an older conversion); "
            "only files with attn_k_b and attn_v_b run here; convert the model again with a current "
            "llama.cpp convert_hf_to_gguf.py"
        )
    if not 0 < rope < k_mla or rope % 2:
        raise keys.error("rope.dimension_count", rope, f"an even number below the key width {k_mla}")
    if kv_lora_rank < 1:
        raise keys.error("attention.kv_lora_rank", kv_lora_rank, "a positive integer")
    return Mla(
        kv_lora_rank=kv_lora_rank,
        # llama.cpp skips q_lora_rank for the Lite models' layer counts; their files have attn_q
        q_lora_rank=0 if model.optional_tensor("blk.0.attn_q.weight") else keys.integer("attention.q_lora_rank", 0),
        nope=k_mla - rope,
        rope=rope,
        v_head_dim=v_mla,
    )


def _yarn_log_mul(keys: ArchKeys) -> float:
    """rope.scaling.yarn_log_multiplier as llama.cpp keeps it for deepseek2: the converter's 0.1 taken off."""
    return keys.real("rope.scaling.yarn_log_multiplier", 0.0) / 0.1


def _mla_kq_scale(keys: ArchKeys, rope: Rope, mla: Mla) -> float:
    """deepseek2's softmax scale: YaRN's magnitude squared over sqrt of a head's query width before
    absorption, as llama.cpp's deepseek2 graph sets it."""
    # the rotation's own attn_factor, with YaRN's 1 + 0.1 ln(1 / freq_scale) put back
    attn_factor = rope.attn_factor * (1.0 + 0.1 * math.log(1.0 / rope.freq_scale))
    mscale = attn_factor * (1.0 + 0.1 * _yarn_log_mul(keys) * math.log(1.0 / rope.freq_scale))
    return mscale * mscale / math.sqrt(mla.q_head)


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
        attn_factor=_yarn_attn_factor(keys, spec, 1.0 / freq_scale) if yarn else _rope_attn_factor(keys),
        beta_fast=keys.real("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=keys.real("rope.scaling.yarn_beta_slow", 1.0),
        n_ctx_orig=keys.integer("rope.scaling.original_context_length", keys.integer("context_length", 0)),
    )


def _rope_attn_factor(keys: ArchKeys) -> float:
    return keys.real("rope.scaling.attn_factor", 1.0)


def _yarn_attn_factor(keys: ArchKeys, spec: ArchAttention, factor: float) -> float:
    """The attn_factor llama.cpp's context hands the rotation under YaRN: YaRN's magnitude
    1 + 0.1 ln(factor), over the same the rotation multiplies in again, times
    rope.scaling.attn_factor. With deepseek2's yarn_log_multiplier (the only architecture here that
    reads it) llama.cpp divides the magnitude of mscale by that of mscale_all_dim, which it takes to
    be equal: 1, and the log multiplier goes into the softmax scale instead (``_mla_kq_scale``)."""
    magnitude = 1.0 if factor <= 1.0 else 1.0 + 0.1 * math.log(factor)
    ratio = 1.0 if spec.arch == "deepseek2" and _yarn_log_mul(keys) else magnitude
    return ratio / (1.0 + 0.1 * math.log(factor)) * _rope_attn_factor(keys)


def _refuse_what_is_not_run(model: MoeModel, keys: ArchKeys) -> None:
    """Settings llama.cpp honours that this forward pass does not compute: refused, never ignored."""
    where = str(model.path)
    if model.arch == "deepseek2" and keys.real("attention.temperature_scale", 0.0):
        raise ModelError(f"{where}: per-position attention temperature (attention.temperature_scale) is not run here")
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
