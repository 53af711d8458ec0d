"""The tensors of a complete model file per architecture, as llama.cpp's loader creates them.

llama.cpp refuses a file that lacks a required tensor or holds one it does not create, so
each list is exactly what its loader asks for (optional tensors included only where the
real models have them). Shapes are in ggml order.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from .presets import ModelPreset
from .schema import TensorRole

# Magnitudes that keep each token's identity in the residual stream, so that routers deep in
# llama.cpp's forward pass still spread tokens over the experts. An embedding is looked up, not
# multiplied, so its rows get unit RMS rather than 1/sqrt(n_embd). Random attention averages the
# values of many positions, which is nearly the same vector for every token: its output
# projection is a tenth of the fan-in rule, so that this shared part stays small beside the
# token's own embedding and the MoE outputs, which differ per token. Linear attention's state
# mixes earlier positions too: its output projection gets the same gain.
EMBEDDING_RMS = 1.0
ATTN_OUTPUT_GAIN = 0.1
# A file's residual scale (make-model --residual-scale, default 1) multiplies these and the FFN's down
# projections: every matrix that writes into the residual stream. Below 1 the stream is mostly the token's
# embedding, as a trained model's is mostly what came before each layer, and a rounding difference in one
# layer moves the next ones' inputs less: on a 24-layer file of gpt-oss-20b's shape, llama.cpp's CPU
# backend with flash attention on parts from itself with it off by a mean KL of 0.115 nats at scale 1
# and 6.9e-4 at 0.125 (docs/results/model-cpu.md).


class Init(enum.Enum):
    """How the writer fills a tensor."""

    WEIGHT = "weight"  # random, RMS 1/sqrt(fan-in)
    ONES = "ones"  # norm weights
    BIAS = "bias"  # small random
    SELECTION_BIAS = "selection_bias"  # a shared offset plus small noise per expert
    DECAY = "decay"  # negative per-head decay rates of a linear-attention state (gated delta net's A)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]
    layer: int
    role: TensorRole | None = None
    init: Init = Init.WEIGHT
    rms: float | None = None  # of a weight's values; None: 1/sqrt(fan-in)


def file_tensors(p: ModelPreset, n_layer: int, residual_scale: float = 1.0) -> list[TensorPlan]:
    """Every tensor of a file with ``p``'s first ``n_layer`` layers, global ones first; the matrices
    that write into the residual stream at ``residual_scale`` times their RMS."""
    plans = [
        TensorPlan("token_embd.weight", (p.n_embd, p.n_vocab), 0, rms=EMBEDDING_RMS),
        TensorPlan("output_norm.weight", (p.n_embd,), 0, init=Init.ONES),
        TensorPlan("output.weight", (p.n_embd, p.n_vocab), 0),
    ]
    for i in range(n_layer):
        plans += _layer(p, i, residual_scale)
    return plans


def _layer(p: ModelPreset, i: int, residual_scale: float) -> list[TensorPlan]:
    def t(
        part: str, *ne: int, init: Init = Init.WEIGHT, role: TensorRole | None = None, rms: float | None = None
    ) -> TensorPlan:
        return TensorPlan(f"blk.{i}.{part}", tuple(ne), i, role, init, rms)

    def norm(part: str, n: int) -> TensorPlan:
        return t(f"{part}.weight", n, init=Init.ONES)

    def bias(part: str, *ne: int) -> TensorPlan:
        return t(f"{part}.bias", *ne, init=Init.BIAS)

    def down(part: str, n_in: int, *ne: int, role: TensorRole | None = None) -> TensorPlan:
        """A matrix into the residual stream: ``n_in`` inputs, the fan-in rule times the residual scale
        (None at scale 1: the writer's own fan-in rule, the same bytes)."""
        rms = None if residual_scale == 1.0 else residual_scale / math.sqrt(n_in)
        return t(f"{part}.weight", n_in, *ne, role=role, rms=rms)

    def attn_output(n_in: int, part: str = "attn_output") -> TensorPlan:
        return t(f"{part}.weight", n_in, p.n_embd, rms=ATTN_OUTPUT_GAIN * residual_scale / math.sqrt(n_in))

    out = [norm("attn_norm", p.n_embd)]
    out += (
        _linear_attention(p, t, norm, bias, attn_output)
        if p.is_recurrent(i)
        else _attention(p, t, norm, bias, attn_output)
    )
    # the norm before the FFN: gpt-oss, glm4moe and qwen3next call it post_attention_norm
    out.append(norm("post_attention_norm" if p.arch in ("gpt-oss", "glm4moe", "qwen3next") else "ffn_norm", p.n_embd))
    if i < p.n_dense_lead:
        return [
            *out,
            t("ffn_gate.weight", p.n_embd, p.dense_ff),
            t("ffn_up.weight", p.n_embd, p.dense_ff),
            down("ffn_down", p.dense_ff, p.n_embd),
        ]
    out.append(t("ffn_gate_inp.weight", p.n_embd, p.n_expert, role=TensorRole.ROUTER))
    if p.arch == "gpt-oss":
        out.append(bias("ffn_gate_inp", p.n_expert))
    if p.arch == "glm4moe" or (p.arch == "deepseek2" and p.gating == 2):
        out.append(t("exp_probs_b.bias", p.n_expert, init=Init.SELECTION_BIAS))
    out += [
        t("ffn_gate_exps.weight", p.n_embd, p.n_ff_exp, p.n_expert, role=TensorRole.GATE),
        t("ffn_up_exps.weight", p.n_embd, p.n_ff_exp, p.n_expert, role=TensorRole.UP),
        down("ffn_down_exps", p.n_ff_exp, p.n_embd, p.n_expert, role=TensorRole.DOWN),
    ]
    if p.arch == "gpt-oss":
        out += [
            bias("ffn_gate_exps", p.n_ff_exp, p.n_expert),
            bias("ffn_up_exps", p.n_ff_exp, p.n_expert),
            bias("ffn_down_exps", p.n_embd, p.n_expert),
        ]
    if p.n_shared:
        ff = p.shared_ff
        if p.arch in ("qwen2moe", "qwen3next"):
            out.append(t("ffn_gate_inp_shexp.weight", p.n_embd))
        out += [
            t("ffn_gate_shexp.weight", p.n_embd, ff),
            t("ffn_up_shexp.weight", p.n_embd, ff),
            down("ffn_down_shexp", ff, p.n_embd),
        ]
    return out


def _attention(p: ModelPreset, t: Any, norm: Any, bias: Any, attn_output: Any) -> list[TensorPlan]:
    if p.arch == "deepseek2":
        rope = p.rope_dim or p.head_dim
        q_dim = p.n_head * (p.qk_nope_dim + rope)
        if p.q_lora_rank:  # the query through a latent of its own, as the full-size models have it
            query = [
                t("attn_q_a.weight", p.n_embd, p.q_lora_rank),
                norm("attn_q_a_norm", p.q_lora_rank),
                t("attn_q_b.weight", p.q_lora_rank, q_dim),
            ]
        else:
            query = [t("attn_q.weight", p.n_embd, q_dim)]
        return [
            *query,
            t("attn_kv_a_mqa.weight", p.n_embd, p.kv_lora_rank + rope),
            norm("attn_kv_a_norm", p.kv_lora_rank),
            t("attn_k_b.weight", p.qk_nope_dim, p.kv_lora_rank, p.n_head),
            t("attn_v_b.weight", p.kv_lora_rank, p.v_head_dim, p.n_head),
            attn_output(p.n_head * p.v_head_dim),
        ]
    q, kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    # qwen3next's query projection also gives each head a sigmoid gate on its output: twice as wide
    q_out = 2 * q if p.arch == "qwen3next" else q
    out = [t("attn_q.weight", p.n_embd, q_out), t("attn_k.weight", p.n_embd, kv), t("attn_v.weight", p.n_embd, kv)]
    if p.arch in ("qwen2moe", "gpt-oss", "glm4moe"):
        out += [bias("attn_q", q), bias("attn_k", kv), bias("attn_v", kv)]
    out.append(attn_output(q))
    if p.arch == "gpt-oss":
        out += [bias("attn_output", p.n_embd), t("attn_sinks.weight", p.n_head, init=Init.BIAS)]
    if p.arch in ("qwen3moe", "qwen3next"):
        out += [norm("attn_q_norm", p.head_dim), norm("attn_k_norm", p.head_dim)]
    return out


def _linear_attention(p: ModelPreset, t: Any, norm: Any, bias: Any, attn_output: Any) -> list[TensorPlan]:
    """A gated delta net layer as qwen3next.cpp builds it, in the fused layout (attn_qkv and attn_gate).

    The convolution weights stay F32 (llama.cpp never quantizes ssm_conv1d); beta and the
    decay's time step come from ssm_ba, the decay rates from ssm_a (negative), and the output
    is RMS-normed per value head (ssm_norm), gated by silu of attn_gate's projection.
    """
    lin = p.linear
    assert lin is not None
    return [
        t("attn_qkv.weight", p.n_embd, lin.conv_dim),
        t("attn_gate.weight", p.n_embd, lin.value_dim),
        t("ssm_conv1d.weight", lin.conv_kernel, lin.conv_dim),
        bias("ssm_dt", lin.v_heads),
        t("ssm_a", lin.v_heads, init=Init.DECAY),
        t("ssm_ba.weight", p.n_embd, 2 * lin.v_heads),
        norm("ssm_norm", lin.head_dim),
        attn_output(lin.value_dim, part="ssm_out"),
    ]
