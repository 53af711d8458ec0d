"""Causal attention in float64, straight from its definition: what the attention kernels are tested against."""

from __future__ import annotations

import numpy as np


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    *,
    kv_len: int,
    scale: float,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """out [n_tokens, n_head, head_dim] in float64 for q [n_tokens, n_head, head_dim] and caches
    [rows, n_head_kv, head_dim]: each query i attends to the rows j < kv_len with j <= positions[i]
    and, where window > 0, positions[i] - j < window; head h reads KV head h // (n_head // n_head_kv);
    a sink logit joins the softmax's denominator. A query that sees no row gets zeros."""
    n_tokens, n_head, head_dim = q.shape
    group = n_head // k_cache.shape[1]
    kv_head = np.arange(n_head) // group
    out = np.zeros((n_tokens, n_head, head_dim))
    for i, pos in enumerate(np.asarray(positions, np.int64)):
        rows = np.arange(min(int(pos), kv_len - 1) + 1)
        if window > 0:
            rows = rows[pos - rows < window]
        if rows.size == 0:
            continue
        keys = k_cache[rows][:, kv_head].astype(np.float64)  # [rows, n_head, head_dim]
        values = v_cache[rows][:, kv_head].astype(np.float64)
        logits = scale * np.einsum("hd,jhd->hj", q[i].astype(np.float64), keys)
        top = logits.max(axis=1)
        if sinks is not None:
            top = np.maximum(top, sinks.astype(np.float64))
        weights = np.exp(logits - top[:, None])
        denominator = weights.sum(axis=1)
        if sinks is not None:
            denominator += np.exp(sinks.astype(np.float64) - top)
        out[i] = np.einsum("hj,jhd->hd", weights, values) / denominator[:, None]
    return out
