"""Float64 references for the MoE kernels, and random test tensors in every weight type.

Weights are dequantized with ``gguf.quants.dequantize`` (exact: every supported type
decodes to float32 without rounding) and multiplied in float64, so the only differences
from a kernel are the kernel's own float32 roundings. The error bounds below are what the
tests allow for ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..ggml import RowType
from .layout import weight_format

# float32 accumulation over a few thousand terms lands near 1e-6; a wrong block, row or
# scale lands above 1e-2.
MUL_MAT_ID_RTOL = 1e-4
ELEMENTWISE_RTOL = 1e-6
ROUTER_WEIGHTS_RTOL = 1e-6


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN when either holds a NaN)."""
    diff = np.linalg.norm(np.asarray(out, np.float64) - np.asarray(ref, np.float64))
    return float(diff / max(float(np.linalg.norm(np.asarray(ref, np.float64))), np.finfo(np.float64).tiny))


def random_weights(rng: np.random.Generator, w_type: RowType, n_rows: int, n_in: int, scale: float = 1.0) -> np.ndarray:
    """Random valid rows of ``w_type``: uint8 [n_rows, row_bytes], values of magnitude ~scale.

    Quantized blocks get random quants and a random positive f16 scale, which is much faster
    than quantizing random floats and covers every quant value.
    """
    fmt = weight_format(w_type)
    if fmt.qtype is GGMLQuantizationType.F16:
        return (rng.standard_normal((n_rows, n_in)) * scale).astype(np.float16).view(np.uint8)
    if fmt.qtype is GGMLQuantizationType.BF16:
        bits = (rng.standard_normal((n_rows, n_in)) * scale).astype(np.float32).view(np.uint32)
        return (bits >> 16).astype(np.uint16).view(np.uint8)
    n_blocks = n_rows * (n_in // fmt.block_elements)
    if fmt.qtype is GGMLQuantizationType.Q4_0:
        d = rng.uniform(0.5, 1.5, n_blocks) * scale / 8
        quants = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    else:
        d = rng.uniform(0.5, 1.5, n_blocks) * scale / 127
        quants = rng.integers(-127, 128, (n_blocks, 32), dtype=np.int8).view(np.uint8)
    blocks = np.concatenate([d.astype(np.float16).reshape(-1, 1).view(np.uint8), quants], axis=1)
    return blocks.reshape(n_rows, fmt.row_bytes(n_in))


def dequantize_rows(w: np.ndarray, w_type: RowType, n_rows: int, n_in: int) -> np.ndarray:
    """float64 [n_rows, n_in] from the first n_rows * row_bytes bytes of ``w``."""
    fmt = weight_format(w_type)
    rows = np.ascontiguousarray(np.asarray(w, np.uint8).reshape(-1)[: n_rows * fmt.row_bytes(n_in)])
    return np.asarray(dequantize(rows.reshape(n_rows, fmt.row_bytes(n_in)), fmt.qtype), np.float64)


def mul_mat_id(
    w: np.ndarray, w_type: RowType, n_expert: int, n_out: int, n_in: int, x: np.ndarray, ids: np.ndarray
) -> np.ndarray:
    """y [n_tokens, top_k, n_out] = W[ids[t, k]] @ x[t] (x [n_tokens, n_in]) or x[t, k] (3-D x).

    Rows whose id is outside [0, n_expert) are NaN, as the kernel writes them.
    """
    weights = dequantize_rows(w, w_type, n_expert * n_out, n_in).reshape(n_expert, n_out, n_in)
    ids = np.asarray(ids)
    n_tokens, top_k = ids.shape
    xs = np.asarray(x, np.float64)
    per_slot = (
        xs.reshape(n_tokens, top_k, n_in)
        if xs.ndim == 3
        else np.broadcast_to(xs.reshape(n_tokens, 1, n_in), (n_tokens, top_k, n_in))
    )
    y = np.full((n_tokens, top_k, n_out), np.nan)
    for e in np.unique(ids):
        if 0 <= e < n_expert:
            mask = ids == e
            y[mask] = per_slot[mask] @ weights[e].T
    return y


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = np.asarray(gate, np.float64)
    return g / (1.0 + np.exp(-g)) * np.asarray(up, np.float64)


def weighted_sum(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """out [n_tokens, n] from y [n_tokens, top_k, n] and weights [n_tokens, top_k]."""
    return np.einsum("tk,tkn->tn", np.asarray(weights, np.float64), np.asarray(y, np.float64))


def router_topk(x: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids int32 [n_tokens, top_k] by descending logit (ties to the lower id), softmax weights."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    n_expert = logits.shape[1]
    order = np.lexsort((np.broadcast_to(np.arange(n_expert), logits.shape), -logits), axis=1)[:, :top_k]
    selected = np.take_along_axis(logits, order, axis=1)
    exps = np.exp(selected - selected[:, :1])
    return order.astype(np.int32), exps / exps.sum(axis=1, keepdims=True)
