"""Float64 references for the MoE kernels, and random test tensors in every weight type.

Weights are dequantized with ``gguf.quants.dequantize`` (llama.cpp's own Python decoder,
float32 values) and multiplied in float64, so the only differences from a kernel are the
kernel's own float32 roundings. The error bounds below are what the
tests allow for ||out - ref|| / ||ref||.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..ggml import RowType, iq1_m_scale_bits, set_iq1_m_scale_bits
from . import quants
from .layout import GEMV_INT8_TYPES, MatrixPath, weight_format
from .routing import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, WEIGHTS_SUM_MIN, Activation, Gating, Routing

# float32 accumulation over a few thousand terms lands near 1e-6; a wrong block, row or
# scale lands above 1e-2.
MUL_MAT_ID_RTOL = 1e-4
# The matrix-core path rounds weights and activations to bf16 (8 significant bits): each
# product is off by ~2.3e-3 relative (rms), and so is a dot product of many of them:
# 2.3e-3..2.7e-3 median over the types on random data. Types with block minimums (Q4_1,
# Q5_1, K-quants) cancel more, so samples of a hundred outputs reach 5e-3..7e-3; a wrong
# block, scale or row lands far above the bound.
MUL_MAT_ID_BF16_RTOL = 1e-2
# The int8 path keeps the weights exact and rounds the activations to 255 levels per 32-element
# block (d = amax / 127): each is off by up to d / 2, rms ~d / sqrt(12), ~5e-3 of the rms of a
# Gaussian block, and so is a dot product of many of them: 5.3e-3..6.0e-3 for Q4_0 and Q4_K on
# random data (ggml's int8 activations move results at the 1e-2 level). A wrong block, scale or
# row lands far above the bound.
MUL_MAT_ID_INT8_RTOL = 2e-2
ELEMENTWISE_RTOL = 1e-6
ROUTER_WEIGHTS_RTOL = 1e-6


def mul_mat_id_rtol(path: MatrixPath) -> float:
    """The bound on ||y - ref|| / ||ref|| that mul_mat_id keeps on ``path``."""
    return {MatrixPath.SIMT: MUL_MAT_ID_RTOL, MatrixPath.MMA: MUL_MAT_ID_BF16_RTOL}.get(path, MUL_MAT_ID_INT8_RTOL)


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
    _T.IQ1_S: (0,),
    _T.IQ2_XXS: (0,),
    _T.IQ2_XS: (0,),
    _T.IQ2_S: (0,),
    _T.IQ3_XXS: (0,),
    _T.IQ3_S: (0,),
    _T.IQ4_NL: (0,),
    _T.IQ4_XS: (0,),
}  # IQ1_M keeps its f16 scale in nibbles (ggml.iq1_m_scale_bits)


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
    if fmt.qtype is _T.IQ1_M:
        set_iq1_m_scale_bits(blocks, rng.uniform(0.5, 1.5, n_blocks).astype(np.float16).view(np.uint16))
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
    if qtype is _T.IQ1_M:
        scale = iq1_m_scale_bits(blocks).view(np.float16).astype(np.float64)
        set_iq1_m_scale_bits(scaled, (scale * factor).astype(np.float16).view(np.uint16))
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
    per_pair = (
        xs.reshape(n_tokens, top_k, n_in)
        if xs.ndim == 3
        else np.broadcast_to(xs.reshape(n_tokens, 1, n_in), (n_tokens, top_k, n_in))
    )
    y = np.full((n_tokens, top_k, n_out), np.nan)
    for e in np.unique(ids):
        if 0 <= e < n_expert:
            mask = ids == e
            y[mask] = per_pair[mask] @ weights[e].T
    return y


def mul_mat_vec_id(
    w: np.ndarray, w_type: RowType, n_expert: int, n_out: int, n_in: int, x: np.ndarray, ids: np.ndarray
) -> np.ndarray:
    """mul_mat_id as the matrix-vector kernels (gemv.cu) compute it, in float64: the types of
    layout.GEMV_INT8_TYPES take their activations on the int8 grid (per 32-element block, Q6_K's
    16, the weights' integer quants times the activations' as moe_quantize_x rounds them, scaled),
    the others the float activations themselves."""
    if weight_format(w_type).qtype not in GEMV_INT8_TYPES:
        return mul_mat_id(w, w_type, n_expert, n_out, n_in, x, ids)
    fmt = weight_format(w_type)
    rows = np.ascontiguousarray(np.asarray(w, np.uint8).reshape(-1)[: n_expert * n_out * fmt.row_bytes(n_in)])
    q_w, d_w, m_w = quants.int8_rows(rows.reshape(n_expert * n_out, -1), fmt.qtype)
    ids = np.asarray(ids)
    n_tokens, top_k = ids.shape
    per_pair = np.asarray(x).ndim == 3  # x [n_tokens, top_k, n_in]: a row of its own per pair
    q_x, d_x, s_x = quants.x_blocks(quants.quantize_x(np.asarray(x, np.float32).reshape(-1, n_in)), q_w.shape[-1])
    y = np.full((n_tokens, top_k, n_out), np.nan)
    for (t, k), e in np.ndenumerate(ids):
        if 0 <= e < n_expert:
            at = t * top_k + k if per_pair else t
            r = slice(e * n_out, (e + 1) * n_out)
            dots = np.einsum("nbk,bk->nb", q_w[r].astype(np.int64), q_x[at].astype(np.int64))
            scaled = d_w[r].astype(np.float64) * d_x[at] * dots
            if m_w is not None:  # the activations' sum term of the types with a min
                scaled = scaled - m_w[r].astype(np.float64) * s_x[at]
            y[t, k] = scaled.sum(axis=1)
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


# -- routing and expert FFN per architecture (see routing.py) -------------------------------


def _top_k(values: np.ndarray, top_k: int) -> np.ndarray:
    index = np.broadcast_to(np.arange(values.shape[1]), values.shape)
    return np.lexsort((index, -values), axis=1)[:, :top_k]


def _softmax(v: np.ndarray) -> np.ndarray:
    exps = np.exp(v - v.max(axis=1, keepdims=True))
    return exps / exps.sum(axis=1, keepdims=True)


def route(
    logits: np.ndarray, routing: Routing, top_k: int, sel_bias: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """ids int32 and float64 weights [n_tokens, top_k] from router logits, as ``routing`` says."""
    logits = np.asarray(logits, np.float64)
    if routing.gating is Gating.SOFTMAX:
        probs = _softmax(logits)
    elif routing.gating is Gating.SIGMOID:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        probs = logits
    sel = probs + np.asarray(sel_bias, np.float64) if sel_bias is not None else probs.copy()
    if routing.n_group > 1:
        n_tokens, n_expert = sel.shape
        groups = sel.reshape(n_tokens, routing.n_group, n_expert // routing.n_group).copy()
        score = -np.sort(-groups, axis=2)[:, :, :2].sum(axis=2)
        dropped = np.ones(score.shape, bool)
        np.put_along_axis(dropped, _top_k(score, routing.n_group_used), False, axis=1)
        groups[dropped] = -np.inf
        sel = groups.reshape(n_tokens, n_expert)
    ids = _top_k(sel, top_k)
    weights = np.take_along_axis(probs, ids, axis=1)
    if routing.gating is Gating.SOFTMAX_WEIGHT:
        weights = _softmax(weights)
    if routing.norm:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), WEIGHTS_SUM_MIN)
    return ids.astype(np.int32), weights * routing.scale


def swiglu_oai(
    gate: np.ndarray, up: np.ndarray, alpha: float = SWIGLU_OAI_ALPHA, limit: float = SWIGLU_OAI_LIMIT
) -> np.ndarray:
    g = np.minimum(np.asarray(gate, np.float64), limit)
    u = np.clip(np.asarray(up, np.float64), -limit, limit)
    return g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)


@dataclass(frozen=True)
class FfnWeights:
    """One MoE layer's weights as float64 arrays in numpy order (outputs, inputs)."""

    router: np.ndarray  # [n_expert, n_embd]
    gate: np.ndarray  # [n_expert, n_ff, n_embd]
    up: np.ndarray  # [n_expert, n_ff, n_embd]
    down: np.ndarray  # [n_expert, n_embd, n_ff]
    router_bias: np.ndarray | None = None  # [n_expert]
    selection_bias: np.ndarray | None = None  # [n_expert], for choosing only
    gate_bias: np.ndarray | None = None  # [n_expert, n_ff]
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None  # [n_expert, n_embd]
    shared_gate: np.ndarray | None = None  # [n_ff_shared, n_embd]
    shared_up: np.ndarray | None = None
    shared_down: np.ndarray | None = None  # [n_embd, n_ff_shared]
    shared_gate_inp: np.ndarray | None = None  # [n_embd]: sigmoid gate of the shared expert


def moe_ffn(
    x: np.ndarray, weights: FfnWeights, routing: Routing, top_k: int, activation: Activation = Activation.SILU
) -> np.ndarray:
    """The MoE block's output [n_tokens, n_embd] for normalized input x, in float64."""
    x = np.asarray(x, np.float64)
    logits = x @ weights.router.T
    if weights.router_bias is not None:
        logits = logits + weights.router_bias
    ids, route_weights = route(logits, routing, top_k, weights.selection_bias)
    act = swiglu if activation is Activation.SILU else swiglu_oai
    out = np.zeros_like(x)
    for k in range(top_k):
        e = ids[:, k]
        g = np.einsum("tfe,te->tf", weights.gate[e], x)
        u = np.einsum("tfe,te->tf", weights.up[e], x)
        if weights.gate_bias is not None and weights.up_bias is not None:
            g, u = g + weights.gate_bias[e], u + weights.up_bias[e]
        y = np.einsum("tnf,tf->tn", weights.down[e], act(g, u))
        if weights.down_bias is not None:
            y = y + weights.down_bias[e]
        out += route_weights[:, k : k + 1] * y
    if weights.shared_gate is not None and weights.shared_up is not None and weights.shared_down is not None:
        shared = swiglu(x @ weights.shared_gate.T, x @ weights.shared_up.T) @ weights.shared_down.T
        if weights.shared_gate_inp is not None:
            shared = shared / (1.0 + np.exp(-(x @ weights.shared_gate_inp)))[:, None]
        out += shared
    return out


def rms_norm(h: np.ndarray) -> np.ndarray:
    """The runner's weightless stand-in norm, in float64."""
    h = np.asarray(h, np.float64)
    return h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-6)
