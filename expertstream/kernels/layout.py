"""Facts shared by the device kernels (the .cu files), their launcher and their Python twins.

The numbers here must match the #defines at the top of formats.cu and mma.cu.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .._env import switch
from ..errors import InvalidArgument
from ..ggml import MATRIX_ROW_PADDING, RowType

TILE_N = 128  # outputs per block of mul_mat_id
TILE_K = 32  # elements per k step: one block, or one 32-element slice of a 256-element block
MMID_THREADS = 128
MMA_THREADS = 128  # threads per block of the matrix-core mul_mat_id (mma.cu)
INT8_THREADS = 256  # threads per block of the int8 mul_mat_id (int8.cu)
DIRECT_THREADS = 128  # threads per block of the direct-decode mul_mat_id (direct.cu)
DIRECT_K = 64  # elements per k step of the direct-decode kernels: n_in must be a multiple
DIRECT_ROUND_THREADS = 256
GEMV_THREADS = 256  # threads per block of the matrix-vector mul_mat_id (gemv.cu)
GEMV_WAVE = 32  # lanes per output row of the matrix-vector kernels: a logical wave on any device
GEMV_WAVE_ROWS = 2  # output rows a wave of the matrix-vector kernels computes side by side
GEMV_ROWS = GEMV_THREADS // GEMV_WAVE * GEMV_WAVE_ROWS  # output rows per block of the matrix-vector kernels
# outputs per block of the matrix-vector gate_up (a gate and an up row a wave)
GEMV_GATE_UP_ROWS = GEMV_THREADS // GEMV_WAVE
# A matrix-vector mul_mat_id of fewer output rows than this over all its pairs runs one row a wave
# (WeightFormat.gemv_one_row_kernel_name, blocks of GEMV_ONE_ROW_ROWS rows): at two rows a wave an attention
# output projection of 2048 rows makes 1024 waves, under 8 a multiprocessor of an H100, and runs 17-27%
# slower; launches of 16384 rows (down over 8 experts) run faster at two (docs/results/decode-rows-h100.md).
GEMV_ONE_ROW_UNDER = 4096
GEMV_ONE_ROW_ROWS = GEMV_THREADS // GEMV_WAVE  # gemv.cu's MOE_GEMV_BLOCK_ROWS(1)
GEMV_STAGE = 4096  # activation rows up to this many elements are staged in shared memory (gemv.cu)
# The weight types whose matrix-vector rows take their activations on the int8 grid (gemv.cu's
# GemvInt8): per 32-element block (Q6_K: per 16-element half, each with its scale) the integer dot of
# the weight quants with the activations quantized as moe_quantize_x does, scaled in float32, as
# llama.cpp's q8_1 matrix-vector path. The other types add decoded float32 weights times float32
# activations.
GEMV_INT8_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.MXFP4,
    }
)
GEMV_STAGE_Q8 = 8192  # int8 activation rows are staged in shared memory in chunks of this many elements
# Pairs up to which MoeKernels(device, gemv=True) takes the matrix-vector kernels: each pair reads
# its expert's rows again, so past a few pairs per expert the tile kernels, which read a tile's
# weights once for all its pairs, should win. 8 (one token's top-8) was not compared with other bounds.
GEMV_MAX_PAIRS = 8
# Decode's last-block epilogues (MoeKernels.decode_epilogues): attention with its combine, the output
# projection with the residual add and FFN norm, the down projection with the combine and next norm.
DECODE_EPILOGUES_VAR = "EXPERTSTREAM_DECODE_EPILOGUES"
DIRECT_ALIGN = 4  # bytes: the direct kernels copy weights in 32-bit words (Q6_K's from the word at or below)
QUANT_THREADS = 256  # threads per block of the activation quantizer (int8.cu), one per 32-element block
QUANT_BLOCK = 32  # activation elements sharing one int8 scale
SCRATCH_ALIGN = 16  # bytes: a scratch given to mul_mat_id starts at a multiple of this
# Bytes: where the quantized or rounded activations start in the scratch, from its start. The
# direct kernels copy them 16 bytes per lane, 128 per row and step: started 16 bytes into a
# 32-byte sector, every row's copy touched five sectors instead of four, and the 128-pair kernel ran
# 40-52% longer at ubatch 512 on an H200.
X_ALIGN = 128
GROUP_THREADS = 256
GROUP_CHUNK = 2048  # pairs per grouping block
GROUP_LAUNCHES = 2  # moe_group_count, then moe_group_place
MAX_EXPERTS = 1024  # experts the grouping kernel can bucket
SCRATCH_HEADER = 4  # int32 words before the tile table

ROUTER_MAX_EXPERTS = 512
ROUTER_MAX_K = 32

ELEMENTWISE_THREADS = 256
MAX_GRID_Y = 65535
MAX_INT32 = 2**31 - 1

# Average pairs per expert from which the tall tile is used, for the types that have one.
# Measured on the H200 (docs/results/cuda-h200-kernels.md): at 32 per expert (ubatch 512
# of Qwen3-30B-A3B) the short tile wastes fewer rows and wins; from 128 the tall one wins,
# except for Q8_0, whose tall kernel needs too many registers and loses everywhere.
TALL_TILE_MIN_PAIRS_PER_EXPERT = 48
# The same for the matrix-core kernels. Not yet measured: there the products are cheap and
# decoding the weights, done once per tile, dominates, so the tall tile should win earlier.
MMA_TALL_TILE_MIN_PAIRS_PER_EXPERT = 24
# The same for the int8 kernels (heights 32, 64, 128). Not yet measured: the weights of a tile are
# read once per block whatever its height, so the tallest tile that is mostly full should win.
INT8_TILE_MIN_PAIRS_PER_EXPERT = {64: 16, 128: 48}
# The same for the direct-decode kernels (heights 32, 64, 128). On the H200 at 128 pairs per expert
# (uniform routing), the 64-pair tile ran Q4_K 1.10x faster than the 128-pair one and Q4_0 within
# 4% either way; at 256 the 128-pair tile won (docs/results/cuda-h200-kernels.md).
DIRECT_TILE_MIN_PAIRS_PER_EXPERT = {64: 24, 128: 160}


class TileM(enum.IntEnum):
    """Rows ((token, k) pairs) per block of mul_mat_id; each is compiled as its own kernel."""

    SHORT = 32
    TALL = 64
    TALLEST = 128  # int8 path only


class MatrixPath(enum.Enum):
    """How mul_mat_id multiplies: the kernel family, its rounding and its tolerance."""

    SIMT = "simt"  # simt.cu: float32 FMAs, any device
    MMA = "mma"  # mma.cu: bf16 inputs on matrix cores, float32 accumulation
    INT8 = "int8"  # int8.cu: weights as int8, activations quantized per 32-block, int32 products


MMA_TILES = (TileM.SHORT, TileM.TALL)  # every type has both heights on matrix cores
INT8_TILES = (TileM.SHORT, TileM.TALL, TileM.TALLEST)  # for the types with an int8 kernel
DIRECT_TILES = (TileM.SHORT, TileM.TALL, TileM.TALLEST)  # the heights a direct-decode kernel may have

# The path mul_mat_id takes per weight type on devices with int8 matrix instructions
# (Capabilities.int8_matrix_cores); types not listed take the bf16 matrix-core path. Only types with
# an int8 kernel (WeightFormat.int8) may be listed. Keep whichever path measures faster on the H200:
# there the int8 kernels ran at 0.77-0.80x the bf16 ones for Q4_0 and 0.93-1.10x for Q4_K (ubatch 512
# and 4096, best tile against best tile; docs/results/cuda-h200-kernels.md), so none is listed;
# MoeKernels(device, MatrixPath.INT8) or `prefill --matrix-path int8` asks for them.
INT8_DEFAULT_TYPES: frozenset[GGMLQuantizationType] = frozenset()


@dataclass(frozen=True)
class WeightFormat:
    """How one supported weight type is laid out and which kernels read it."""

    qtype: GGMLQuantizationType
    suffix: str  # kernel name part
    block_elements: int
    block_bytes: int
    tiles: tuple[TileM, ...]  # the tile heights compiled for this type
    unit_bytes: int = 2  # the kernel reads the tensor in units of this many bytes: w is aligned to it
    int8: bool = False  # whether int8.cu has a kernel for this type (MatrixPath.INT8)
    # The tile heights of direct.cu's kernels for this type (the MMA path on mma_fragments devices); none
    # where it has none.
    direct_tiles: tuple[TileM, ...] = ()

    @property
    def direct(self) -> bool:
        """Whether direct.cu has kernels for this type."""
        return bool(self.direct_tiles)

    @property
    def quantized(self) -> bool:
        return self.block_elements > 1

    def row_bytes(self, n_in: int) -> int:
        return n_in // self.block_elements * self.block_bytes

    def padded_row_elements(self, n_in: int) -> int:
        """Elements the kernel reads per row: quantized rows are read in 512-element blocks."""
        if not self.quantized:
            return n_in
        return -(-n_in // MATRIX_ROW_PADDING) * MATRIX_ROW_PADDING

    def tiles_on(self, path: MatrixPath) -> tuple[TileM, ...]:
        """The tile heights compiled for this type on ``path`` (none on INT8 for types without it)."""
        if path is MatrixPath.SIMT:
            return self.tiles
        if path is MatrixPath.INT8:
            return INT8_TILES if self.int8 else ()
        return MMA_TILES

    def path_on(self, path: MatrixPath) -> MatrixPath:
        """The path this type takes where ``path`` is asked for: types without an int8 kernel take MMA."""
        return MatrixPath.MMA if path is MatrixPath.INT8 and not self.int8 else path

    def kernel_name(self, tile_m: TileM, path: MatrixPath = MatrixPath.SIMT) -> str:
        family = {MatrixPath.SIMT: "", MatrixPath.MMA: "mma_", MatrixPath.INT8: "int8_"}[path]
        return f"moe_mul_mat_id_{family}{self.suffix}_m{int(tile_m)}"

    def direct_kernel_name(self, tile_m: TileM, gate_up: bool = False) -> str:
        """The direct-decode kernel: mul_mat_id (optionally routing-weighted), or gate and up with SwiGLU."""
        return f"moe_{'gate_up' if gate_up else 'mul_mat_id'}_direct_{self.suffix}_m{int(tile_m)}"

    @property
    def gemv_kernel_name(self) -> str:
        """The matrix-vector mul_mat_id of this type, for a few pairs (gemv.cu)."""
        return f"moe_mul_mat_vec_id_{self.suffix}"

    @property
    def gemv_one_row_kernel_name(self) -> str:
        """The matrix-vector mul_mat_id of this type with one row a wave, for launches of few rows (gemv.cu)."""
        return f"moe_mul_mat_vec_id1_{self.suffix}"

    @property
    def gemv_gate_up_kernel_name(self) -> str:
        """The matrix-vector gate, up and SwiGLU of this type, for a few pairs (gemv.cu)."""
        return f"moe_gate_up_vec_id_{self.suffix}"

    @property
    def gemv_parts_kernel_name(self) -> str:
        """The matrix-vector kernel of up to three dense projections of one input, this type (gemv.cu)."""
        return f"moe_mul_mat_vec_parts_{self.suffix}"

    @property
    def gemv_add_norm_kernel_name(self) -> str:
        """The matrix-vector projection of this type with the residual add and the next norm (dense.cu)."""
        return f"dense_mul_mat_vec_add_norm_{self.suffix}"

    @property
    def gemv_combine_norm_kernel_name(self) -> str:
        """The matrix-vector down projection of this type with the MoE combine and the next norm (dense.cu)."""
        return f"dense_mul_mat_vec_combine_norm_{self.suffix}"

    @property
    def get_rows_kernel_name(self) -> str:
        """The kernel that decodes rows of a table of this type (dense.get_rows)."""
        return f"dense_get_rows_{self.suffix}"

    def direct_fits(self, n_in: int) -> bool:
        """Whether the direct kernels take rows of ``n_in`` elements (whole k steps)."""
        return self.direct and n_in % DIRECT_K == 0

    def direct_tile_for(self, n_pairs: int, n_expert: int) -> TileM:
        """The direct-decode kernel's tile height for this many (token, k) pairs per expert."""
        tiles = [t for t in self.direct_tiles if n_pairs >= DIRECT_TILE_MIN_PAIRS_PER_EXPERT.get(t, 0) * n_expert]
        return max(tiles, default=TileM.SHORT)

    def tile_for(self, n_pairs: int, n_expert: int, path: MatrixPath = MatrixPath.SIMT) -> TileM:
        """The tile height that runs faster for this many (token, k) pairs per expert."""
        if path is MatrixPath.INT8:
            tiles = [t for t in self.tiles_on(path) if n_pairs >= INT8_TILE_MIN_PAIRS_PER_EXPERT.get(t, 0) * n_expert]
            return max(tiles, default=TileM.SHORT)
        tall_from = TALL_TILE_MIN_PAIRS_PER_EXPERT if path is MatrixPath.SIMT else MMA_TALL_TILE_MIN_PAIRS_PER_EXPERT
        if TileM.TALL in self.tiles_on(path) and n_pairs >= tall_from * n_expert:
            return TileM.TALL
        return TileM.SHORT


def _format(
    qtype: GGMLQuantizationType,
    tiles: tuple[TileM, ...] = (TileM.SHORT,),
    unit_bytes: int = 2,
    int8: bool = False,
    direct_tiles: tuple[TileM, ...] = (),
) -> WeightFormat:
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    return WeightFormat(qtype, qtype.name.lower(), block_elements, block_bytes, tiles, unit_bytes, int8, direct_tiles)


_T = GGMLQuantizationType
_BOTH = (TileM.SHORT, TileM.TALL)

# Types not measured on the H200 compile the short tile only. MXFP4 blocks take 17 bytes
# and F32 elements 4, so those two are read in bytes and in 32-bit words. Q6_K's direct kernels
# stage 23 words of each weight row per k step (Q4_K's 12): a 128-pair tile would need more than the
# 48 KiB of static shared memory a block may have.
FORMATS: dict[GGMLQuantizationType, WeightFormat] = {
    f.qtype: f
    for f in (
        _format(_T.Q4_0, _BOTH, int8=True, direct_tiles=DIRECT_TILES),
        _format(_T.Q4_1),
        _format(_T.Q5_0),
        _format(_T.Q5_1),
        _format(_T.Q8_0),
        _format(_T.Q2_K),
        _format(_T.Q3_K),
        _format(_T.Q4_K, int8=True, direct_tiles=DIRECT_TILES),
        _format(_T.Q5_K),
        _format(_T.Q6_K, direct_tiles=_BOTH),
        _format(_T.IQ1_S),
        _format(_T.IQ1_M),
        _format(_T.IQ2_XXS),
        _format(_T.IQ2_XS),
        _format(_T.IQ2_S),
        _format(_T.IQ3_XXS),
        _format(_T.IQ3_S),
        _format(_T.IQ4_NL),
        _format(_T.IQ4_XS),
        _format(_T.MXFP4, unit_bytes=1, direct_tiles=DIRECT_TILES),
        _format(_T.F16, _BOTH),
        _format(_T.BF16, _BOTH),
        _format(_T.F32, unit_bytes=4),
    )
}


def weight_format(w_type: RowType) -> WeightFormat:
    """The format of a supported weight type; InvalidArgument names the supported ones otherwise."""
    try:
        qtype = GGMLQuantizationType(int(w_type))
    except ValueError:
        qtype = None
    fmt = FORMATS.get(qtype) if qtype is not None else None
    if fmt is None:
        supported = ", ".join(f.qtype.name for f in FORMATS.values())
        shown = qtype.name if qtype is not None else repr(w_type)
        raise InvalidArgument(
            f"mul_mat_id does not support weight type {shown}",
            call="MoeKernels.mul_mat_id",
            hint=f"supported types: {supported}",
        )
    return fmt


def max_tiles(n_pairs: int, n_expert: int, tile_m: int) -> int:
    """Upper bound on tiles: each bucket (experts plus the bad-id bucket) wastes at most one."""
    return -(-n_pairs // tile_m) + n_expert + 1


def group_blocks(n_pairs: int) -> int:
    """Blocks of the grouping kernels: one per GROUP_CHUNK pairs."""
    return -(-n_pairs // GROUP_CHUNK)


def scratch_words(n_pairs: int, n_expert: int, tile_m: int) -> int:
    """int32 words of grouping scratch: header, tile triples, one row entry per pair, then each
    grouping block's count per bucket (experts plus the bad-id bucket)."""
    return SCRATCH_HEADER + 3 * max_tiles(n_pairs, n_expert, tile_m) + n_pairs + group_blocks(n_pairs) * (n_expert + 1)


def default_path(w_type: RowType, matrix_cores: bool, int8_matrix_cores: bool) -> MatrixPath:
    """The path mul_mat_id takes for ``w_type`` on a device with these matrix instructions."""
    if not matrix_cores:
        return MatrixPath.SIMT
    if int8_matrix_cores and weight_format(w_type).qtype in INT8_DEFAULT_TYPES:
        return MatrixPath.INT8
    return MatrixPath.MMA


def quantized_x_row_bytes(n_in: int) -> int:
    """Bytes of one activation row quantized for the int8 path: n_in int8 values, then (d, s) floats
    per 32-element block, padded to 16 bytes (int8.cu's int8_x_row_bytes)."""
    return -(-(n_in + n_in // QUANT_BLOCK * 8) // SCRATCH_ALIGN) * SCRATCH_ALIGN


def quantized_x_bytes(n_rows: int, n_in: int) -> int:
    """Bytes of ``n_rows`` activation rows quantized for the int8 path."""
    return n_rows * quantized_x_row_bytes(n_in)


def quantized_x_offset(n_pairs: int, n_expert: int, tile_m: int) -> int:
    """Byte offset of the quantized (or rounded) activations in the scratch: after the grouping words,
    at a multiple of X_ALIGN."""
    return -(-4 * scratch_words(n_pairs, n_expert, tile_m) // X_ALIGN) * X_ALIGN


def direct_x_bytes(n_rows: int, n_in: int) -> int:
    """Bytes of ``n_rows`` activation rows rounded to bf16 for the direct kernels (moe_round_x_direct)."""
    return n_rows * n_in * 2


def direct_pair_slot(pair: int) -> int:
    """Word position of element pair ``pair`` (0..7) of a 16-element chunk in direct.cu's fragment order."""
    return (pair % 2) * 4 + pair // 2


def decode_epilogues_from_environment() -> bool:
    """$EXPERTSTREAM_DECODE_EPILOGUES (0 or 1; unset: 0): MoeKernels' default decode_epilogues."""
    return switch(DECODE_EPILOGUES_VAR, "MoeKernels", f"unset {DECODE_EPILOGUES_VAR} for a launch each")
