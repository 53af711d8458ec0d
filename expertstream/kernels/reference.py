"""Float64 references for the MoE kernels, and random test tensors in every weight type.

Weights are dequantized with ``gguf.quants.dequantize`` (llama.cpp's own Python decoder,
float32 values) and multiplied in float64, so the only differences from a kernel are the
kernel's own float32 roundings. The error bounds below are what the
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


_T = GGMLQuantizationType

# Byte offsets of the f16 scales in each block: random bytes there could be NaN or huge.
F16_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    _T.Q4_0: (0,),
    _T.Q4_1: (0, 2),
    _T.Q5_0: (0,),
    _T.Q5_1: (0, 2),
    _T.Q8_0: (0,),
    _T.Q2_K: (80, 82),
    _T.Q3_K: (108,),
    _T.Q4_K: (0, 2),
    _T.Q5_K: (0, 2),
    _T.Q6_K: (208,),
    _T.IQ4_NL: (0,),
    _T.IQ4_XS: (0,),
}


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int) -> np.ndarray:
    """uint8 [n_blocks, block_bytes] of random quants with finite scales of magnitude ~1.

    Random bytes cover every quant value and bit pattern, much faster than quantizing
    random floats; only the scale fields are made sane.
    """
    fmt = weight_format(qtype)
    blocks = rng.integers(0, 256, (n_blocks, fmt.block_bytes), dtype=np.uint8)
    if fmt.qtype is _T.MXFP4:
        blocks[:, 0] = rng.integers(126, 130, n_blocks)  # E8M0 exponents around 2^0
        return blocks
    for at in F16_SCALE_FIELDS[fmt.qtype]:
        blocks[:, at : at + 2] = rng.uniform(0.5, 1.5, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks


def _scaled(blocks: np.ndarray, qtype: GGMLQuantizationType, factor: float) -> np.ndarray:
    """``blocks`` with every decoded value multiplied by about ``factor`` (through the scales)."""
    scaled = blocks.copy()
    if qtype is _T.MXFP4:
        step = int(np.clip(round(np.log2(factor)), -100, 100))
        scaled[:, 0] = np.clip(blocks[:, 0].astype(np.int32) + step, 2, 254)
        return scaled
    for at in F16_SCALE_FIELDS[qtype]:
        field = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float64)
        scaled[:, at : at + 2] = (field * factor).astype(np.float16).view(np.uint8)
    return scaled


def random_weights(rng: np.random.Generator, w_type: RowType, n_rows: int, n_in: int, scale: float = 1.0) -> np.ndarray:
    """Random valid rows of ``w_type``: uint8 [n_rows, row_bytes], values of RMS ~scale."""
    fmt = weight_format(w_type)
    if not fmt.quantized:
        values = rng.standard_normal((n_rows, n_in)) * scale
        if fmt.qtype is _T.BF16:
            bits = values.astype(np.float32).view(np.uint32)
            return (bits >> 16).astype(np.uint16).view(np.uint8)
        dtype = np.float16 if fmt.qtype is _T.F16 else np.float32
        return values.astype(dtype).view(np.uint8)
    blocks = random_blocks(rng, fmt.qtype, n_rows * (n_in // fmt.block_elements))
    rms = float(np.sqrt(np.mean(np.square(dequantize(blocks, fmt.qtype), dtype=np.float64))))
    return _scaled(blocks, fmt.qtype, scale / rms).reshape(n_rows, fmt.row_bytes(n_in))


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
