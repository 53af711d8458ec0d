"""numpy decoders of ggml's weight blocks, as the mul_mat_id kernel decodes them.

Each decoder takes uint8 blocks [n, block_bytes] and returns float32 [n, block_elements],
computing every element with the kernel's float32 operations in the kernel's order, so
that a decoded value is the kernel's value bit for bit. 256-element blocks are decoded as
eight 32-element slices (the kernel's k step): arrays are shaped [n, 8, 32] on the way.

Written from the block layouts in ggml-common.h, independently of gguf.quants, which
reference.py uses to check them. The i-quants' lattice grids are read from the tables in
grids.cu, so the checks against gguf.quants cover the kernel's tables too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import InvalidArgument
from ..ggml import iq1_m_scale_bits
from .layout import QUANT_BLOCK
from .program import source_file

Decoder = Callable[[np.ndarray], np.ndarray]

SLICES = 8  # 32-element slices of a 256-element block

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # e2m1, doubled
IQ1_DELTA = np.float32(0.125)
IQ2_GRID_VALUES = np.array([0x08, 0x19, 0x2B], np.float32)
IQ3XXS_GRID_VALUES = np.array([0x04, 0x0C, 0x14, 0x1C, 0x24, 0x2C, 0x34, 0x3E], np.float32)


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


# -- 256-element i-quant blocks ------------------------------------------------------------


@functools.cache
def grid_entries(name: str) -> np.ndarray:
    """uint16 entries of the lattice grid table ``name`` (IQ2XXS_GRID, ...) as grids.cu holds them."""
    table = re.search(rf"const unsigned short {name}\[(\d+)\] = \{{([^}}]*)\}};", source_file("grids.cu"))
    if table is None:
        raise InvalidArgument(f"grids.cu has no grid table {name}")
    entries = np.array([int(v, 16) for v in table.group(2).replace(",", " ").split()], np.uint16)
    if entries.size != int(table.group(1)):
        raise InvalidArgument(f"grid table {name} holds {entries.size} entries, declared {table.group(1)}")
    return entries


@functools.cache
def grid_points(name: str) -> np.ndarray:
    """float32 [entries, elements]: each grid point's values, decoded from its codes as decode.cu does."""
    entries = grid_entries(name)[:, None]
    if name.startswith("IQ3"):
        codes = (entries >> np.arange(0, 16, 4, dtype=np.uint16)) & 7  # a nibble per element, 4 elements
        values = IQ3XXS_GRID_VALUES[codes] if name == "IQ3XXS_GRID" else 2 * codes.astype(np.float32) + 1
    else:
        codes = (entries >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # 2 bits per element, 8 elements
        values = IQ2_GRID_VALUES[codes] if name.startswith("IQ2") else codes.astype(np.float32) - 1
    return np.ascontiguousarray(values, np.float32)


def _sign_bits(index: np.ndarray) -> np.ndarray:
    """The 8 sign bits of 7-bit sign indices: bit 7 makes the number of set bits even."""
    index = index.astype(np.uint32)
    parity = index ^ (index >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    return index | ((parity & 1) << 7)


def _signs(bits: np.ndarray) -> np.ndarray:
    """float32 [..., 8] of -1 where bit j of each value is set, else 1."""
    return np.where(_bits(bits, 8) == 1, np.float32(-1), np.float32(1))


def _packed_sign_indices(words: np.ndarray) -> np.ndarray:
    """[..., 4, 8] signs from the four 7-bit sign indices in the low 28 bits of each word."""
    return _signs(_sign_bits((words[..., None] >> np.arange(0, 28, 7, dtype=np.uint32)) & 127))


def _u32_slices(part: np.ndarray) -> np.ndarray:
    """uint32 [n, 8] from 32 bytes: one little-endian word per slice."""
    return np.ascontiguousarray(part).view("<u4")


def _half_scales(d: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """IQ2_XS/IQ2_S: d * (0.5 + nibble) * 0.25 per 16 elements, [n, 8, 2, 1] from 8 bytes of nibble pairs."""
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).astype(np.float32)
    return (d[:, :, None] * (np.float32(0.5) + nibbles) * np.float32(0.25))[..., None]


def _iq1_s(b: np.ndarray) -> np.ndarray:
    qs = _by_slice(b[:, 2:34], SLICES).astype(np.uint16)
    qh = _u16(b, 34, SLICES)
    dl = _f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)
    index = qs | (((qh[..., None] >> np.arange(0, 12, 3, dtype=np.uint16)) & 7) << 8)
    values = grid_points("IQ1S_GRID")[index]  # [n, 8, 4, 8]
    return (dl[:, :, None, None] * (values + delta[:, :, None, None])).reshape(-1, 256)


def _iq1_m(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    qs = _by_slice(b[:, 0:32], SLICES).astype(np.uint16)
    qh = _by_slice(b[:, 32:48], SLICES)
    high = np.stack([qh & 0xF, qh >> 4], axis=-1).reshape(n, SLICES, 4)  # a nibble per grid point
    d = iq1_m_scale_bits(b).view(np.float16).astype(np.float32)[:, None, None]
    scales = (_u16(b, 48, 4)[:, :, None] >> np.arange(0, 12, 3, dtype=np.uint16)) & 7
    dl = d * (2 * scales.reshape(n, SLICES, 2) + 1).astype(np.float32)  # per 16 elements
    delta = np.where(high & 8, -IQ1_DELTA, IQ1_DELTA)
    values = grid_points("IQ1S_GRID")[qs | ((high & 7).astype(np.uint16) << 8)]
    points = values + delta[..., None]  # [n, 8, 4, 8]
    return (np.repeat(dl, 2, axis=2)[..., None] * points).reshape(-1, 256)


def _iq2_xxs(b: np.ndarray) -> np.ndarray:
    sub = _by_slice(b[:, 2:66], SLICES)  # per slice: 4 index bytes, then the sign and scale word
    aux = _u32_slices(sub[:, :, 4:])[..., 0]
    db = _f16(b, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)
    values = grid_points("IQ2XXS_GRID")[sub[:, :, :4]]
    return (db[:, :, None, None] * values * _packed_sign_indices(aux)).reshape(-1, 256)


def _iq2_xs(b: np.ndarray) -> np.ndarray:
    q = _u16(b, 2, 32).reshape(-1, SLICES, 4)
    db = _half_scales(_f16(b, 0), b[:, 66:74])
    values = grid_points("IQ2XS_GRID")[q & 511]
    return (np.repeat(db, 2, axis=2) * values * _signs(_sign_bits(q >> 9))).reshape(-1, 256)


def _iq2_s(b: np.ndarray) -> np.ndarray:
    qs = _by_slice(b[:, 2:34], SLICES).astype(np.uint16)
    high = (b[:, 66:74, None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3
    db = _half_scales(_f16(b, 0), b[:, 74:82])
    values = grid_points("IQ2S_GRID")[qs | (high.astype(np.uint16) << 8)]
    signs = _signs(_by_slice(b[:, 34:66], SLICES))
    return (np.repeat(db, 2, axis=2) * values * signs).reshape(-1, 256)


def _iq3_xxs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    aux = _u32_slices(b[:, 66:98])
    db = _f16(b, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    values = grid_points("IQ3XXS_GRID")[_by_slice(b[:, 2:66], SLICES)].reshape(n, SLICES, 4, 8)
    return (db[:, :, None, None] * values * _packed_sign_indices(aux)).reshape(-1, 256)


def _iq3_s(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    qs = _by_slice(b[:, 2:66], SLICES).astype(np.uint16)
    high = _bits(b[:, 66:74], 8).astype(np.uint16)  # bit i of qh[s]: 9th index bit of point i
    scales = np.stack([b[:, 106:110] & 0xF, b[:, 106:110] >> 4], axis=-1).reshape(n, SLICES)
    db = _f16(b, 0) * (1 + 2 * scales).astype(np.float32)
    values = grid_points("IQ3S_GRID")[qs | (high << 8)].reshape(n, SLICES, 4, 8)
    signs = _signs(_by_slice(b[:, 74:106], SLICES))
    return (db[:, :, None, None] * values * signs).reshape(-1, 256)


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
    _T.IQ1_S: _iq1_s,
    _T.IQ1_M: _iq1_m,
    _T.IQ2_XXS: _iq2_xxs,
    _T.IQ2_XS: _iq2_xs,
    _T.IQ2_S: _iq2_s,
    _T.IQ3_XXS: _iq3_xxs,
    _T.IQ3_S: _iq3_s,
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
    _block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = np.asarray(rows, np.uint8)
    n_rows = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, block_bytes)
    with np.errstate(over="ignore", invalid="ignore"):  # dirty padding decodes to inf/NaN on purpose
        values = decoder(blocks)
    return values.reshape(n_rows, -1)


# -- the int8 path: integer quants and per-32-block scales ---------------------------------


Int8Split = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def _q4_0_int8(b: np.ndarray) -> Int8Split:
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return q[:, None, :], _f16(b, 0), None


def _q4_k_int8(b: np.ndarray) -> Int8Split:
    sc, m = _k4_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    q = _low_nibble_slices(b[:, 16:144]).astype(np.int8)
    return q, d * sc[:, :, 0], dmin * m[:, :, 0]


def _q6_k_int8(b: np.ndarray) -> Int8Split:
    """Per 16-element half-slice: its own signed scale (the matrix-vector kernels' blocks)."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)
    low = np.stack([ql & 0xF, ql >> 4], axis=2).reshape(n, SLICES, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> np.arange(0, 8, 2, dtype=np.uint8)[None, None, :, None]) & 3).reshape(n, SLICES, 32)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 2 * SLICES, 16)
    dl = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q, dl, None


def _q8_0_int8(b: np.ndarray) -> Int8Split:
    return b[:, None, 2:34].view(np.int8), _f16(b, 0), None


def _mxfp4_int8(b: np.ndarray) -> Int8Split:
    return MXFP4_VALUES[_nibbles(b[:, 1:17])].astype(np.int8)[:, None, :], e8m0_half(b[:, :1]), None


INT8_SPLITS: dict[GGMLQuantizationType, Callable[[np.ndarray], Int8Split]] = {
    _T.Q4_0: _q4_0_int8,
    _T.Q8_0: _q8_0_int8,
    _T.MXFP4: _mxfp4_int8,
    _T.Q4_K: _q4_k_int8,
    _T.Q6_K: _q6_k_int8,  # 16-element blocks: the matrix-vector kernels only (no int8 tile kernel)
}


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows [n_rows, n_in] quantized as quantize_block32 (gemv.cu) does: int8 q [n_rows,
    blocks, 32], float32 d and s = d * sum(q) [n_rows, blocks]. d = amax / 127 and, with r = 127 / amax
    in float32, q = rint(x * r) of the unrounded product (the kernel's fmaf); a block with a NaN or an
    infinity gets d = NaN and q = 0, one whose r overflows (an all-zero block among them) q = 0."""
    n_rows, n_in = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(n_rows, n_in // QUANT_BLOCK, QUANT_BLOCK)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        finite = np.isfinite(blocks).all(axis=-1)
        amax = np.where(finite, np.abs(np.where(np.isfinite(blocks), blocks, 0)).max(axis=-1), 0).astype(np.float32)
        d = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
        r = (np.float32(127) / amax).astype(np.float32)
        usable = finite & np.isfinite(r)
        product = blocks.astype(np.float64) * np.where(usable, r, np.float32(0)).astype(np.float64)[..., None]
        q = np.where(usable[..., None], np.rint(product), 0).astype(np.int8)  # exact in float64, as fmaf
        s = d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)
    return q, d, s


def x_blocks(xq: tuple[np.ndarray, np.ndarray, np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantized activations (q [..., blocks, 32], d, s) cut into blocks of ``width`` elements (32 or
    16), each half of a 32-element block keeping its d; s is then d * the half's own sum."""
    q, d, s = xq
    if width == QUANT_BLOCK:
        return q, d, s
    parts = QUANT_BLOCK // width
    q = q.reshape(*q.shape[:-2], q.shape[-2] * parts, width)
    d = np.repeat(d, parts, axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        s = d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)
    return q, d, s


def int8_rows(rows: np.ndarray, qtype: GGMLQuantizationType) -> Int8Split:
    """What the int8 kernels take from uint8 rows [n_rows, row_bytes] of ``qtype``, per block of B
    elements (32; Q6_K's 16): int8 quants [n_rows, blocks, B] (MXFP4's: its value table's) and float32
    [n_rows, blocks] multipliers of their dot (Q4_0, Q8_0: d; Q4_K: d * sc; Q6_K: d * the half's scale;
    MXFP4: half the E8M0 scale) and of the activations' sum term (Q4_K: dmin * m; None for the types
    without one, whose kernels never read the sum).

    Element k of the row decodes to d * q[k] - m, as decode_rows gives it.
    """
    split = INT8_SPLITS.get(qtype)
    if split is None:
        raise InvalidArgument(f"no int8 kernel for {qtype.name}")
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    n_rows = rows.shape[0]
    q, d, m = split(np.ascontiguousarray(rows, np.uint8).reshape(-1, block_bytes))
    return q.reshape(n_rows, -1, q.shape[-1]), d.reshape(n_rows, -1), None if m is None else m.reshape(n_rows, -1)
