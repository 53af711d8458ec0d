"""The weights make-model writes: centred, scaled as planned, and routing tokens over every expert.

A forward pass through a written file, as llama.cpp computes a qwen3moe layer (embedding
lookup, RMS norms, causal attention with normed queries and keys, softmax router, top-k,
SwiGLU experts, residual adds; rope left out) or a qwen3next one (the same with gated
attention, a gated delta net in three layers of four, and a gated shared expert), must send
the tokens of one ubatch to nearly every expert in every layer. Weights with a shared offset, or a residual stream
that attention's average of all positions swamps, send them all to the same few.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from expertstream.model import ModelPreset, file_specs, generate, get_preset, tensor_specs
from expertstream.model.presets import LinearAttention
from expertstream.model.writer import WRITABLE_TYPES, TensorSpec

TINY = get_preset("tiny")
# qwen3moe with 64 experts, small enough for a numpy forward pass
MANY_EXPERTS = ModelPreset("many", "qwen3moe", n_layer=6, n_expert=64, top_k=4, n_embd=256, n_ff_exp=64)
# qwen3next likewise: layers 0, 1, 3 and 4 linear attention, 2 and 5 full attention, a shared expert
MANY_EXPERTS_NEXT = ModelPreset(
    "many-next",
    "qwen3next",
    n_layer=6,
    n_expert=64,
    top_k=4,
    n_embd=256,
    n_ff_exp=64,
    n_shared=1,
    linear=LinearAttention(k_heads=2, v_heads=4, head_dim=32, conv_kernel=4, full_attention_interval=3),
)


def _values(spec: TensorSpec, seed: int = 0) -> np.ndarray:
    raw = generate(spec, seed).reshape(spec.byte_shape)
    return np.asarray(dequantize(raw, spec.qtype), np.float64)


@pytest.mark.parametrize("qtype", WRITABLE_TYPES, ids=lambda t: t.name)
def test_every_type_is_centred_and_scaled_to_fan_in(qtype: GGMLQuantizationType) -> None:
    spec = next(s for s in tensor_specs(TINY, qtype, 1) if s.name == "blk.0.ffn_up_exps.weight")
    rows = _values(spec).reshape(-1, spec.ne[0])  # 1536 rows of 256
    rms = float(np.sqrt(np.mean(rows**2)))
    target = 1 / math.sqrt(spec.ne[0])
    assert 2**-0.5 < rms / target < 2**0.5, rms / target  # float and MXFP4 scales are powers of two
    # what all rows share (the mean row) and what each row shares (its mean) are at the noise level
    # of independent zero-mean values, 1/sqrt(count); a shared offset of the quants is far above it
    shared_by_rows = float(np.sqrt(np.mean(rows.mean(axis=0) ** 2))) / rms
    shared_in_row = float(np.sqrt(np.mean(rows.mean(axis=1) ** 2))) / rms
    assert shared_by_rows < 3 / math.sqrt(rows.shape[0]), shared_by_rows
    assert shared_in_row < 3 / math.sqrt(rows.shape[1]), shared_in_row


def test_small_k_quant_weights_keep_their_rms() -> None:
    # attn_output's planned RMS asks a Q4_K d below f16's normal range, Q6_K's sub-scales do too
    specs = {s.name: s for s in file_specs(get_preset("qwen3-30b-a3b"), "Q4_K_M", 1)}
    for name, qtype in [
        ("blk.0.attn_output.weight", GGMLQuantizationType.Q4_K),
        ("blk.0.attn_v.weight", GGMLQuantizationType.Q6_K),
        ("token_embd.weight", GGMLQuantizationType.Q4_K),
    ]:
        spec = specs[name]
        assert spec.qtype is qtype
        target = spec.rms if spec.rms is not None else 1 / math.sqrt(spec.ne[0])
        rms = float(np.sqrt(np.mean(_values(spec) ** 2)))
        assert 0.8 < rms / target < 1.25, (name, rms, target)


def test_token_embeddings_have_unit_rms_and_attention_output_is_small() -> None:
    specs = {s.name: s for s in file_specs(TINY, "Q8_0", 1)}
    assert specs["token_embd.weight"].rms == 1.0
    attn_output = specs["blk.0.attn_output.weight"]
    assert attn_output.rms is not None and attn_output.rms < 0.5 / math.sqrt(attn_output.ne[0])


def _rms_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)


def _forward_expert_use(p: ModelPreset, qtype: str, tokens: np.ndarray, residual_scale: float = 1.0) -> list[int]:
    """Distinct experts each MoE layer's router picks for ``tokens`` in a forward pass of ``p``'s architecture."""
    w = {s.name: _values(s).reshape(*reversed(s.ne)) for s in file_specs(p, qtype, p.n_layer, residual_scale)}
    x = w["token_embd.weight"][tokens]
    ffn_norm = "post_attention_norm" if p.arch == "qwen3next" else "ffn_norm"
    used = []
    for i in range(p.n_layer):
        h = _rms_norm(x) * w[f"blk.{i}.attn_norm.weight"]
        x = x + (_linear_attention(p, w, i, h) if p.is_recurrent(i) else _attention(p, w, i, h))
        h = _rms_norm(x) * w[f"blk.{i}.{ffn_norm}.weight"]
        top, out = _moe(p, w, i, h)
        used.append(np.unique(top).size)
        x = x + out
    return used


def _attention(p: ModelPreset, w: dict[str, np.ndarray], i: int, h: np.ndarray) -> np.ndarray:
    """Causal attention with normed queries and keys (rope left out); qwen3next gates each head by its query."""
    n = len(h)
    q = (h @ w[f"blk.{i}.attn_q.weight"].T).reshape(n, p.n_head, -1)
    q, gate = q[..., : p.head_dim], q[..., p.head_dim :]  # qwen3next: [query, gate] per head
    q = _rms_norm(q)
    k = _rms_norm((h @ w[f"blk.{i}.attn_k.weight"].T).reshape(n, p.n_head_kv, p.head_dim))
    v = (h @ w[f"blk.{i}.attn_v.weight"].T).reshape(n, p.n_head_kv, p.head_dim)
    group = p.n_head // p.n_head_kv
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(p.head_dim) + np.triu(np.full((n, n), -np.inf), k=1)
    attn = np.exp(scores - scores.max(axis=-1, keepdims=True))
    attn /= attn.sum(axis=-1, keepdims=True)
    heads = np.einsum("hqk,khd->qhd", attn, v)
    if gate.size:
        heads = heads * _sigmoid(gate)
    return heads.reshape(n, -1) @ w[f"blk.{i}.attn_output.weight"].T


def _linear_attention(p: ModelPreset, w: dict[str, np.ndarray], i: int, h: np.ndarray) -> np.ndarray:
    """qwen3next's gated delta net as llama.cpp computes it, one token at a time."""
    lin = p.linear
    assert lin is not None
    n, d, per_key = len(h), lin.head_dim, lin.v_heads // lin.k_heads
    qkv = h @ w[f"blk.{i}.attn_qkv.weight"].T
    kernel = w[f"blk.{i}.ssm_conv1d.weight"]  # [channels, conv_kernel], oldest token first
    padded = np.concatenate([np.zeros((lin.conv_kernel - 1, qkv.shape[1])), qkv])
    conv = sum(padded[j : j + n] * kernel[:, j] for j in range(lin.conv_kernel))
    conv = conv / (1 + np.exp(-conv))
    q = conv[:, : lin.key_dim].reshape(n, lin.k_heads, d)
    k = conv[:, lin.key_dim : 2 * lin.key_dim].reshape(n, lin.k_heads, d)
    v = conv[:, 2 * lin.key_dim :].reshape(n, lin.v_heads, d)
    q, k = (np.repeat(t / np.linalg.norm(t, axis=-1, keepdims=True), per_key, axis=1) for t in (q, k))
    ba = (h @ w[f"blk.{i}.ssm_ba.weight"].T).reshape(n, lin.k_heads, 2, per_key)
    beta = _sigmoid(ba[:, :, 0].reshape(n, lin.v_heads))
    decay = np.exp(
        np.log1p(np.exp(ba[:, :, 1].reshape(n, lin.v_heads) + w[f"blk.{i}.ssm_dt.bias"])) * w[f"blk.{i}.ssm_a"]
    )
    state = np.zeros((lin.v_heads, d, d))  # [head, key, value]
    out = np.empty_like(v)
    for t in range(n):
        state *= decay[t, :, None, None]
        delta = beta[t, :, None] * (v[t] - np.einsum("hkv,hk->hv", state, k[t]))
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t]) / math.sqrt(d)
    z = (h @ w[f"blk.{i}.attn_gate.weight"].T).reshape(n, lin.v_heads, d)
    out = _rms_norm(out) * w[f"blk.{i}.ssm_norm.weight"] * z * _sigmoid(z)
    return out.reshape(n, -1) @ w[f"blk.{i}.ssm_out.weight"].T


def _moe(p: ModelPreset, w: dict[str, np.ndarray], i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of a softmax router, renormalized, SwiGLU experts; plus the sigmoid-gated shared expert if any."""
    logits = h @ w[f"blk.{i}.ffn_gate_inp.weight"].T
    top = np.argsort(-logits, axis=1)[:, : p.top_k]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights = np.take_along_axis(probs, top, axis=1)
    weights /= weights.sum(axis=1, keepdims=True)
    out = np.zeros_like(h)
    for e in np.unique(top):
        rows, slot = np.nonzero(top == e)
        down = _swiglu(h[rows], w[f"blk.{i}.ffn_gate_exps.weight"][e], w[f"blk.{i}.ffn_up_exps.weight"][e])
        out[rows] += weights[rows, slot, None] * (down @ w[f"blk.{i}.ffn_down_exps.weight"][e].T)
    if p.n_shared:
        shared = _swiglu(h, w[f"blk.{i}.ffn_gate_shexp.weight"], w[f"blk.{i}.ffn_up_shexp.weight"])
        out += (
            shared
            @ w[f"blk.{i}.ffn_down_shexp.weight"].T
            * _sigmoid(h @ w[f"blk.{i}.ffn_gate_inp_shexp.weight"])[:, None]
        )
    return top, out


def _swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = h @ gate.T
    return g * _sigmoid(g) * (h @ up.T)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("preset", [MANY_EXPERTS, MANY_EXPERTS_NEXT], ids=lambda p: p.arch)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K_M"])
def test_a_forward_pass_spreads_tokens_over_the_experts_in_every_layer(preset: ModelPreset, qtype: str) -> None:
    tokens = np.random.default_rng(0).integers(0, preset.n_vocab, 256)
    used = _forward_expert_use(preset, qtype, tokens)
    assert min(used) >= 0.99 * preset.n_expert, used


def test_a_small_residual_scale_still_spreads_tokens_over_the_experts() -> None:
    # the residual stream is then mostly each token's own embedding, which the routers tell apart
    tokens = np.random.default_rng(0).integers(0, MANY_EXPERTS.n_vocab, 256)
    used = _forward_expert_use(MANY_EXPERTS, "Q4_K_M", tokens, residual_scale=0.125)
    assert min(used) >= 0.99 * MANY_EXPERTS.n_expert, used


# The matrices that write into the residual stream, by the end of their names
RESIDUAL_WRITERS = (
    "attn_output.weight",
    "ssm_out.weight",
    "ffn_down.weight",
    "ffn_down_exps.weight",
    "ffn_down_shexp.weight",
)


@pytest.mark.parametrize(
    ("preset", "qtype"),
    [
        ("tiny-gpt-oss", "MXFP4_MOE"),
        ("tiny-qwen2moe", "Q8_0"),
        ("tiny-deepseek2", "Q4_K_M"),
        ("tiny-qwen3next", "Q8_0"),
    ],
)
def test_the_residual_scale_scales_exactly_the_matrices_into_the_residual_stream(preset: str, qtype: str) -> None:
    p = get_preset(preset)
    plain = file_specs(p, qtype, p.n_layer)
    scaled = file_specs(p, qtype, p.n_layer, residual_scale=0.25)
    writers = 0
    for a, b in zip(plain, scaled, strict=True):
        assert (a.name, a.qtype, a.ne) == (b.name, b.qtype, b.ne)
        if not a.name.endswith(RESIDUAL_WRITERS):
            assert np.array_equal(generate(a, 0), generate(b, 0)), a.name
            continue
        writers += 1
        ratio = math.sqrt(np.mean(_values(b) ** 2) / np.mean(_values(a) ** 2))
        assert 0.25 / 1.25 < ratio < 0.25 * 1.25, (a.name, ratio)  # scales are powers of two for some types
    assert writers >= 2 * p.n_layer  # attention's (or the delta net's) output and the FFN's down, each layer
