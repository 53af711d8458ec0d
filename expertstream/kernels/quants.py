"""numpy decoders of ggml's weight blocks, as the mul_mat_id kernel decodes them.

Each decoder takes uint8 blocks [n, block_bytes] and returns float32 [n, block_elements],
computing every element with the kernel's float32 operations in the kernel's order, so
that a decoded value is the kernel's value bit for bit. 256-element blocks are decoded as
eight 32-element slices (the kernel's k step): arrays are shaped [n, 8, 32] on the way.

Written from the block layouts in ggml-common.h, independently of gguf.quants, which
reference.py uses to check them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import InvalidArgument

Decoder = Callable[[np.ndarray], np.ndarray]

SLICES = 8  # 32-element slices of a 256-element block

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # e2m1, doubled


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """float32 [n, 1] from the f16 at byte ``at`` of each block."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _u16(blocks: np.ndarray, at: int, count: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at : at + 2 * count]).view("<u2")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 2 * m] from [..., m] bytes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """[..., count] 0/1 from the low ``count`` bits of each word, bit 0 first."""
    return ((words[..., None] >> np.arange(count, dtype=words.dtype)) & 1).astype(np.uint8)


def _by_slice(bytes_: np.ndarray, rows: int) -> np.ndarray:
    """[n, rows, bytes / rows] view of a block part."""
    return bytes_.reshape(bytes_.shape[0], rows, -1)


# -- 32-element blocks ---------------------------------------------------------------------


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - np.float32(8))


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    high = _bits(np.ascontiguousarray(qh).view("<u4")[:, 0], 32)
    return (_nibbles(qs) | (high << 4)).astype(np.float32)


def _q5_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_five_bit(b[:, 2:6], b[:, 6:22]) - np.float32(16))


def _q5_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _five_bit(b[:, 4:8], b[:, 8:24]) + _f16(b, 2)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * IQ4_VALUES[_nibbles(b[:, 2:18])]


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """float32 2^(e - 128): half the E8M0 scale, subnormal for e < 2 as in ggml."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _mxfp4(b: np.ndarray) -> np.ndarray:
    return e8m0_half(b[:, :1]) * MXFP4_VALUES[_nibbles(b[:, 1:17])]


# -- 256-element K-quant blocks ------------------------------------------------------------


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K from their 12 bytes, as float32 [n, 8, 1]."""
    low_sc, low_m, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([low_sc & 0x3F, (high & 0xF) | ((low_sc >> 6) << 4)], axis=1)
    m = np.concatenate([low_m & 0x3F, (high >> 4) | ((low_m >> 6) << 4)], axis=1)
    return sc.astype(np.float32)[:, :, None], m.astype(np.float32)[:, :, None]


def _low_nibble_slices(qs: np.ndarray) -> np.ndarray:
    """[n, 8, 32] from 128 bytes: each 32-byte group gives slice 2g (low) and 2g + 1 (high)."""
    groups = _by_slice(qs, 4)
    return np.stack([groups & 0xF, groups >> 4], axis=2).reshape(qs.shape[0], SLICES, 32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    sc, m = _k4_scales(b[:, 4:16])
    d, dmin = _f16(b, 0)[:, :, None], _f16(b, 2)[:, :, None]
    q = _low_nibble_slices(b[:, 16:144]).astype(np.float32)
    return ((d * sc) * q - dmin * m).reshape(-1, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    sc, m = _k4_scales(b[:, 4:16])
    d, dmin = _f16(b, 0)[:, :, None], _f16(b, 2)[:, :, None]
    high = _bits(b[:, 16:48], SLICES).transpose(0, 2, 1)  # bit s of byte l -> slice s, element l
    q = (_low_nibble_slices(b[:, 48:176]) | (high << 4)).astype(np.float32)
    return ((d * sc) * q - dmin * m).reshape(-1, 256)


def _two_bit_slices(qs: np.ndarray) -> np.ndarray:
    """[n, 8, 32] from 64 bytes: 32-byte half h gives slices 4h + j from bits 2j..2j+1."""
    halves = _by_slice(qs, 2)[:, :, None, :]
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[None, None, :, None]
    return ((halves >> shifts) & 3).reshape(qs.shape[0], SLICES, 32)


def _per_16(values: np.ndarray) -> np.ndarray:
    """[n, 8, 32] from one value per 16 elements [n, 16]."""
    return np.repeat(values.reshape(-1, SLICES, 2), 16, axis=2)


def _q2_k(b: np.ndarray) -> np.ndarray:
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80)[:, :, None], _f16(b, 82)[:, :, None]
    dl = d * _per_16(scales & 0xF).astype(np.float32)
    ml = dmin * _per_16(scales >> 4).astype(np.float32)
    return (dl * _two_bit_slices(b[:, 16:80]).astype(np.float32) - ml).reshape(-1, 256)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """The sixteen 6-bit scales of Q3_K, minus 32, from their 12 bytes: int [n, 16]."""
    low = np.concatenate([packed[:, 0:8] & 0xF, packed[:, 0:8] >> 4], axis=1)
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[None, :, None]
    high = ((packed[:, None, 8:12] >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)).astype(np.int32) - 32


def _q3_k(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 108)[:, :, None]
    dl = d * _per_16(_q3_k_scales(b[:, 96:108])).astype(np.float32)
    high = _bits(b[:, 0:32], SLICES).transpose(0, 2, 1)
    q = _two_bit_slices(b[:, 32:96]).astype(np.int32) - 4 * (1 - high.astype(np.int32))
    return (dl * q.astype(np.float32)).reshape(-1, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half][32-byte part][l]
    low = np.stack([ql & 0xF, ql >> 4], axis=2).reshape(n, SLICES, 32)  # slice 4h + 2 * shift + part
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> np.arange(0, 8, 2, dtype=np.uint8)[None, None, :, None]) & 3).reshape(n, SLICES, 32)
    q = (low | (high << 4)).astype(np.int32) - 32
    d = _f16(b, 208)[:, :, None]
    dl = d * _per_16(b[:, 192:208].view(np.int8)).astype(np.float32)
    return (dl * q.astype(np.float32)).reshape(-1, 256)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)[:, :, None]
    high = (_u16(b, 2, 1) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    low = _nibbles(b[:, 4:8]).reshape(-1, 2, 4).transpose(0, 2, 1).reshape(-1, SLICES)
    dl = d * ((low | (high << 4)).astype(np.int32) - 32).astype(np.float32)[:, :, None]
    q = _nibbles(_by_slice(b[:, 8:136], SLICES))
    return (dl * IQ4_VALUES[q]).reshape(-1, 256)


# -- float types ---------------------------------------------------------------------------


def _f16_rows(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bf16_rows(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16).view(np.float32)


def _f32_rows(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f4").astype(np.float32)


_T = GGMLQuantizationType
DECODERS: dict[GGMLQuantizationType, Decoder] = {
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q8_0: _q8_0,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
    _T.IQ4_NL: _iq4_nl,
    _T.IQ4_XS: _iq4_xs,
    _T.MXFP4: _mxfp4,
    _T.F16: _f16_rows,
    _T.BF16: _bf16_rows,
    _T.F32: _f32_rows,
}


def decode_rows(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [n_rows, elements] from uint8 rows [n_rows, row_bytes] of ``qtype``."""
    decoder = DECODERS.get(qtype)
    if decoder is None:
        raise InvalidArgument(f"no decoder for {qtype.name}")
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = np.asarray(rows, np.uint8)
    n_rows = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, block_bytes)
    with np.errstate(over="ignore", invalid="ignore"):  # dirty padding decodes to inf/NaN on purpose
        values = decoder(blocks)
    return values.reshape(n_rows, -1)
