"""The weights make-model writes: centred, scaled as planned, and routing tokens over every expert.

A forward pass through a written file, as llama.cpp computes a qwen3moe layer (embedding
lookup, RMS norms, causal attention with normed queries and keys, softmax router, top-k,
SwiGLU experts, residual adds; rope left out), must send the tokens of one ubatch to
nearly every expert in every layer. Weights with a shared offset, or a residual stream
that attention's average of all positions swamps, send them all to the same few.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from expertstream.model import ModelPreset, file_specs, generate, get_preset, tensor_specs
from expertstream.model.writer import WRITABLE_TYPES, TensorSpec

TINY = get_preset("tiny")
# qwen3moe with 64 experts, small enough for a numpy forward pass
MANY_EXPERTS = ModelPreset("many", "qwen3moe", n_layer=6, n_expert=64, top_k=4, n_embd=256, n_ff_exp=64)


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


def _forward_expert_use(p: ModelPreset, qtype: str, tokens: np.ndarray) -> list[int]:
    """Distinct experts each MoE layer's router picks for ``tokens`` in a qwen3moe forward pass."""
    w = {s.name: _values(s).reshape(*reversed(s.ne)) for s in file_specs(p, qtype, p.n_layer)}
    n = len(tokens)
    x = w["token_embd.weight"][tokens]
    causal = np.triu(np.full((n, n), -np.inf), k=1)
    used = []
    for i in range(p.n_layer):
        h = _rms_norm(x)
        q = _rms_norm((h @ w[f"blk.{i}.attn_q.weight"].T).reshape(n, p.n_head, p.head_dim))
        k = _rms_norm((h @ w[f"blk.{i}.attn_k.weight"].T).reshape(n, p.n_head_kv, p.head_dim))
        v = (h @ w[f"blk.{i}.attn_v.weight"].T).reshape(n, p.n_head_kv, p.head_dim)
        group = p.n_head // p.n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(p.head_dim) + causal
        attn = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn /= attn.sum(axis=-1, keepdims=True)
        heads = np.einsum("hqk,khd->qhd", attn, v).reshape(n, -1)
        x = x + heads @ w[f"blk.{i}.attn_output.weight"].T
        h = _rms_norm(x)
        logits = h @ w[f"blk.{i}.ffn_gate_inp.weight"].T
        top = np.argsort(-logits, axis=1)[:, : p.top_k]
        used.append(np.unique(top).size)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        weights = np.take_along_axis(probs, top, axis=1)
        weights /= weights.sum(axis=1, keepdims=True)
        out = np.zeros_like(x)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            gate = h[rows] @ w[f"blk.{i}.ffn_gate_exps.weight"][e].T
            up = h[rows] @ w[f"blk.{i}.ffn_up_exps.weight"][e].T
            act = gate / (1 + np.exp(-gate)) * up
            out[rows] += weights[rows, slot, None] * (act @ w[f"blk.{i}.ffn_down_exps.weight"][e].T)
        x = x + out
    return used


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K_M"])
def test_a_forward_pass_spreads_tokens_over_the_experts_in_every_layer(qtype: str) -> None:
    tokens = np.random.default_rng(0).integers(0, MANY_EXPERTS.n_vocab, 256)
    used = _forward_expert_use(MANY_EXPERTS, qtype, tokens)
    assert min(used) >= 0.99 * MANY_EXPERTS.n_expert, used
