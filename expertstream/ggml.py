"""ggml row types: block sizes, row sizes and the padding kernels read past a row's end.

Shared by the model code (sizing tensors in a file), the kernels (weight layouts) and the
backends (padded allocations) without any of them importing another.
"""

from __future__ import annotations

import enum
from typing import Union

import numpy as np
from gguf import GGMLQuantizationType as _T

from .errors import InvalidArgument

MATRIX_ROW_PADDING = 512
"""Kernels read quantized rows in blocks of this many elements (as ggml's MMQ does)."""


RowType = Union[int, "enum.IntEnum"]  # a gguf.GGMLQuantizationType, or its integer value


def _quant_info(row_type: RowType) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(int(row_type))
    except ValueError:
        raise InvalidArgument(
            f"unknown ggml row type {row_type!r}", hint="pass a gguf.GGMLQuantizationType member"
        ) from None
    return GGML_QUANT_SIZES[qtype]


def is_quantized(row_type: RowType) -> bool:
    """True for block-quantized types (Q4_0, Q8_0, ...), False for F32/F16/BF16 and integers."""
    block_size, _ = _quant_info(row_type)
    return block_size > 1


def row_size(row_type: RowType, ne: int) -> int:
    """Bytes taken by ``ne`` elements of ``row_type`` (ne must be a multiple of the block size)."""
    block_size, type_size = _quant_info(row_type)
    if ne % block_size:
        raise InvalidArgument(f"{ne} elements is not a multiple of the block size {block_size}")
    return ne // block_size * type_size


def padded_size(nbytes: int, row_type: RowType | None, ne0: int | None) -> int:
    """Size to allocate for a tensor of ``nbytes`` whose rows have ``ne0`` elements.

    Quantized tensors whose rows are not a multiple of MATRIX_ROW_PADDING get one extra
    (partial) row's worth of bytes, because the kernels read whole 512-element blocks past
    the end of the last row. The extra bytes must be zero when a kernel reads them.
    """
    if nbytes < 0:
        raise InvalidArgument(f"negative size {nbytes}")
    if row_type is None or ne0 is None or not is_quantized(row_type):
        return nbytes
    rem = ne0 % MATRIX_ROW_PADDING
    return nbytes + (row_size(row_type, MATRIX_ROW_PADDING - rem) if rem else 0)


EXPERT_TYPES: tuple[_T, ...] = (
    _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
    _T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S,
    _T.IQ4_NL, _T.IQ4_XS, _T.MXFP4,
    _T.F16, _T.BF16, _T.F32,
)  # fmt: skip
"""The expert weight types the MoE kernels read (``kernels.layout.FORMATS`` has one format each)."""


_IQ1_M_SCALES = slice(48, 56)  # the four 16-bit scale words of an IQ1_M block
_NIBBLE_SHIFTS = np.array([0, 4, 8, 12], np.uint16)


def iq1_m_scale_bits(blocks: np.ndarray) -> np.ndarray:
    """uint16 [n]: the f16 bits of the scale of each IQ1_M block (uint8 [n, 56]).

    IQ1_M has no scale field: scale word i keeps bits 4i..4i+3 of it in its top nibble.
    """
    words = np.ascontiguousarray(blocks[:, _IQ1_M_SCALES]).view("<u2")
    return np.bitwise_or.reduce((words >> np.uint16(12)) << _NIBBLE_SHIFTS, axis=1).astype(np.uint16)


def set_iq1_m_scale_bits(blocks: np.ndarray, bits: np.ndarray) -> None:
    """Store the f16 bits ``bits`` [n] as the scale of each IQ1_M block, in place."""
    words = np.ascontiguousarray(blocks[:, _IQ1_M_SCALES]).view("<u2")
    nibbles = (np.asarray(bits, np.uint16)[:, None] >> _NIBBLE_SHIFTS) & np.uint16(0xF)
    blocks[:, _IQ1_M_SCALES] = ((words & np.uint16(0x0FFF)) | (nibbles << np.uint16(12))).view(np.uint8)


__all__ = [
    "EXPERT_TYPES",
    "MATRIX_ROW_PADDING",
    "RowType",
    "iq1_m_scale_bits",
    "is_quantized",
    "padded_size",
    "row_size",
    "set_iq1_m_scale_bits",
]
