"""Float64 references for the dense kernels of dense.py, and the error bounds the tests allow
for ||out - ref|| / ||ref||.

Table rows are dequantized with ``gguf.quants.dequantize`` (reference.dequantize_rows), the
rest is computed in float64 from the formulas, independently of the float32 code of the
kernels and their twins: YaRN's correction dims here are float64 too.
"""

from __future__ import annotations

import math

import numpy as np

from ..ggml import RowType
from .dense import Rope
from .reference import dequantize_rows

# The decoders compute ggml's float32 values; the GPU may fuse a block's d * q - m into one
# multiply-add (NVRTC contracts by default), one rounding off in the last bit of a value.
GET_ROWS_RTOL = 1e-6
# float32 sums of squares over a few thousand terms land near 1e-7; a wrong row, weight or eps
# lands far above.
RMS_NORM_RTOL = 1e-5
BIAS_RTOL = 1e-6


def rope_rtol(max_position: int) -> float:
    """The bound for ``rope`` of positions up to ``max_position``. The angle pos * inv_freq is a
    float32 product of a float32 power, off by a few 2^-24 of itself, and the high frequencies'
    angles reach the position itself (the twin lands near max_position * 2^-27 on random data);
    a wrong pair, angle, ramp or scale is off by more than 1e-2."""
    return 1e-6 + max(1, max_position) * 2.0**-24


def get_rows(table: np.ndarray, table_type: RowType, n_cols: int, n_table_rows: int, ids: np.ndarray) -> np.ndarray:
    """float64 [len(ids), n_cols]: row ids[i] of the table, NaN where the id is out of range."""
    rows = dequantize_rows(table, table_type, n_table_rows, n_cols)
    ids = np.asarray(ids).reshape(-1)
    out = np.full((ids.size, n_cols), np.nan)
    valid = (ids >= 0) & (ids < n_table_rows)
    out[valid] = rows[ids[valid]]
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x [n_rows, n] normalized per row by its root mean square (+ eps), times weight [n]."""
    x = np.asarray(x, np.float64)
    y = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
    return y if weight is None else y * np.asarray(weight, np.float64)


def yarn_corr_dims(rope: Rope) -> tuple[float, float]:
    """YaRN's ramp ends as pair indices: where a dimension turns beta_fast and beta_slow times
    over the training context, floored and ceiled, clamped to [0, n_rot - 1]."""

    def corr_dim(n_rotations: float) -> float:
        return rope.n_rot * math.log(rope.n_ctx_orig / (n_rotations * 2 * math.pi)) / (2 * math.log(rope.freq_base))

    return max(0.0, math.floor(corr_dim(rope.beta_fast))), min(rope.n_rot - 1.0, math.ceil(corr_dim(rope.beta_slow)))


def rope_angles(positions: np.ndarray, rope: Rope) -> tuple[np.ndarray, float]:
    """(theta [n_tokens, n_rot / 2], mscale) of ggml's rope_ext with YaRN, in float64."""
    pair = np.arange(rope.n_rot // 2, dtype=np.float64)
    theta_extrap = np.asarray(positions, np.float64)[:, None] * rope.freq_base ** (-2.0 * pair / rope.n_rot)
    theta = rope.freq_scale * theta_extrap
    mscale = rope.attn_factor
    if rope.ext_factor != 0.0:
        low, high = yarn_corr_dims(rope)
        ramp = 1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * rope.ext_factor
        theta = theta * (1.0 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / rope.freq_scale)
    return theta, mscale


def rope(x: np.ndarray, positions: np.ndarray, rope: Rope) -> np.ndarray:
    """x [n_tokens, n_heads, head_dim] rotated: pairs (2i, 2i + 1), or (i, i + n_rot / 2) in NEOX
    mode, of the first n_rot dimensions of each head; the rest pass through."""
    out = np.array(x, np.float64)
    theta, mscale = rope_angles(positions, rope)
    cos = (np.cos(theta) * mscale)[:, None, :]
    sin = (np.sin(theta) * mscale)[:, None, :]
    half = rope.n_rot // 2
    first = np.arange(half) if rope.neox else 2 * np.arange(half)
    second = first + half if rope.neox else first + 1
    x0, x1 = out[:, :, first].copy(), out[:, :, second].copy()
    out[:, :, first] = x0 * cos - x1 * sin
    out[:, :, second] = x0 * sin + x1 * cos
    return out


def store_rows_f16(cache: np.ndarray, src: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float16 [rows, width]: ``cache`` with row positions[i] = src[i] rounded to nearest even
    (from float64, exact for float32 values), positions outside the rows skipped."""
    out = np.array(cache, np.float16)
    positions = np.asarray(positions).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):  # beyond the largest half: infinity; NaN stays NaN
        for i, row in enumerate(positions.tolist()):
            if 0 <= row < out.shape[0]:
                out[row] = np.asarray(src[i], np.float64).astype(np.float16)
    return out
