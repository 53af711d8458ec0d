"""mma.cu's lane arithmetic against the register layouts the vendors document.

NVIDIA: the addresses each lane hands ldmatrix .x4 and the C element each lane holds after
mma.sync m16n8k16 are plain integer functions; compiled for the host, they are checked
here by emulating ldmatrix and the A/B/C fragment layouts (PTX ISA, "Matrix Fragments for
mma.m16n8k16" with .bf16).

AMD: where each lane's A and B fragment starts in a shared tile and which C element it holds
after v_mfma_f32_16x16x16 (CDNA2/CDNA3, wave64) or v_wmma_f32_16x16x16 (RDNA3, RDNA4, wave32)
are plain integer functions too; they are checked by emulating the instruction with the
register layouts of AMD's ISA guides (the bf16 and f16 forms of each share one layout), so the
product lands where mma_row/mma_col say.

The host runs of the kernels (test_kernels_on_host, test_attention_on_host) use the generic
step instead, so this is what covers the matrix-core indexing without a GPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from expertstream.kernels import kernel_source

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

_DRIVER = """
#include <cstdio>
int main() {
    for (int lane = 0; lane < 32; ++lane) {
        printf("%d %d", ldmatrix_a_offset(lane), ldmatrix_b_offset(lane));
        for (int i = 0; i < 8; ++i) printf(" %d %d", mma_sync_row(lane, i), mma_sync_col(lane, i));
        printf("\\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def lanes(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, np.ndarray]:
    """(MMA_LDK, int [32, 18]: a offset, b offset, then (row, col) of C elements 0..7 per lane)."""
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    source = kernel_source()
    ldk = re.search(r"#define MMA_LDK \((\w+) \+ (\d+)\)", source)
    tile_k = re.search(rf"#define {ldk.group(1)} (\d+)", source) if ldk else None
    assert ldk and tile_k, "MMA_LDK is no longer a tile width plus padding"
    row_elements = int(tile_k.group(1)) + int(ldk.group(2))
    functions = source[
        source.index("__device__ int ldmatrix_a_offset") : source.index("#if defined(MMA_NVIDIA)\n\nstruct")
    ]
    folder = tmp_path_factory.mktemp("lanes")
    (folder / "lanes.cpp").write_text(f"#define __device__\n#define MMA_LDK {row_elements}\n" + functions + _DRIVER)
    subprocess.run([CXX, "-std=c++17", "-o", str(folder / "lanes"), str(folder / "lanes.cpp")], check=True)
    out = subprocess.run([str(folder / "lanes")], capture_output=True, text=True, check=True).stdout
    return row_elements, np.array([line.split() for line in out.splitlines()], int)


def test_ldmatrix_gives_mma_sync_its_a_fragments(lanes: tuple[int, np.ndarray]) -> None:
    ldk, table = lanes
    a = np.arange(16 * ldk).reshape(16, ldk)  # A[m][k] at a[m, k]: every element distinct
    regs = _registers(a, table[:, 0])
    g, c = np.arange(32) // 4, np.arange(32) % 4
    # a0,a1: (g, 2c..); a2,a3: (g+8, 2c..); a4,a5: (g, 2c+8..); a6,a7: (g+8, 2c+8..)
    for reg, (row, col) in enumerate([(g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8)]):
        assert (regs[:, reg, 0] == a[row, col]).all() and (regs[:, reg, 1] == a[row, col + 1]).all(), reg


def test_ldmatrix_gives_mma_sync_its_b_fragments(lanes: tuple[int, np.ndarray]) -> None:
    ldk, table = lanes
    b = np.arange(16 * ldk).reshape(16, ldk)  # B[k][n] of the product at b[n, k]
    regs = _registers(b, table[:, 1])
    g, c = np.arange(32) // 4, np.arange(32) % 4
    # per n8 step: b0,b1 = B[2c..][g], b2,b3 = B[2c+8..][g]; registers 0,1 then 2,3 for n + 8
    for reg, (n, k) in enumerate([(g, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c), (g + 8, 2 * c + 8)]):
        assert (regs[:, reg, 0] == b[n, k]).all() and (regs[:, reg, 1] == b[n, k + 1]).all(), reg


def test_c_elements_are_where_mma_sync_puts_them(lanes: tuple[int, np.ndarray]) -> None:
    _, table = lanes
    rows, cols = table[:, 2::2], table[:, 3::2]
    g, c = np.arange(32) // 4, np.arange(32) % 4
    for i in range(8):  # c0,c1: (g, 2c..), c2,c3: (g+8, 2c..); elements 4..7 for columns 8..15
        assert (rows[:, i] == g + 8 * ((i % 4) // 2)).all(), i
        assert (cols[:, i] == 8 * (i // 4) + 2 * c + i % 2).all(), i
    assert len({(r, q) for r, q in zip(rows.reshape(-1), cols.reshape(-1), strict=True)}) == 256


def _registers(tile: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[32 lanes, 4 registers, 2 values] that ldmatrix .x4 loads from ``tile`` at ``offsets``."""
    flat = tile.reshape(-1)
    t = np.arange(32)
    regs = np.empty((32, 4, 2), tile.dtype)
    for j in range(4):
        rows = np.stack([flat[offsets[8 * j + r] : offsets[8 * j + r] + 8] for r in range(8)])
        regs[:, j, 0] = rows[t // 4, 2 * (t % 4)]
        regs[:, j, 1] = rows[t // 4, 2 * (t % 4) + 1]
    return regs


# -- AMD: MFMA (wave64) and WMMA on RDNA3 / RDNA4 (wave32) --------------------------------------

_AMD_DRIVER = """
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
    const int ld = atoi(argv[1]);
    for (int lane = 0; lane < 64; ++lane) {
        printf("%d %d %d %d", amd_matrix_col(lane), mfma_fragment_offset(lane, ld),
               wmma_gfx11_fragment_offset(lane, ld), wmma_gfx12_fragment_offset(lane, ld));
        for (int i = 0; i < 8; ++i) {
            printf(" %d %d %d", mfma_row(lane, i), wmma_gfx11_row(lane, i), wmma_gfx12_row(lane, i));
        }
        printf("\\n");
    }
    return 0;
}
"""


@dataclass(frozen=True)
class AmdLayout:
    """One instruction's documented register layout: for lane l and item j of its fragment, the
    (row or column, k) of A or B, and the (row, column) of C."""

    wave: int
    k_per_lane: int  # consecutive k of one A row (B column) in a lane's fragment
    ab: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # (lane, item) -> (m or n, k)
    c: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # (lane, item) -> (m, n)


AMD_LAYOUTS = {
    # CDNA3 ISA and AMD's matrix instruction calculator, v_mfma_f32_16x16x16_f16 / _bf16(_1k):
    # A[i][k] in lane i + 16 (k / 4), item k % 4 (B alike by column); D[i][j] in lane j + 16 (i / 4),
    # item i % 4.
    "mfma": AmdLayout(
        64,
        4,
        lambda lane, j: (lane % 16, 4 * (lane // 16) + j),
        lambda lane, j: (4 * (lane // 16) + j, lane % 16),
    ),
    # RDNA3 ISA, v_wmma_f32_16x16x16_f16 / _bf16 (wave32): lane l holds all 16 k of A row (B column)
    # l % 16, lanes 16-31 repeating lanes 0-15; the 32-bit D has row 2 v + l / 16 in VGPR v.
    "wmma_gfx11": AmdLayout(
        32,
        16,
        lambda lane, j: (lane % 16, j),
        lambda lane, j: (2 * j + lane // 16, lane % 16),
    ),
    # RDNA4 ISA, v_wmma_f32_16x16x16_f16 / _bf16: lanes 0-15 hold k 0-7 of their row (column), lanes
    # 16-31 k 8-15; D has row v in lanes 0-15 and row 8 + v in lanes 16-31 of VGPR v.
    "wmma_gfx12": AmdLayout(
        32,
        8,
        lambda lane, j: (lane % 16, 8 * (lane // 16) + j),
        lambda lane, j: (j + 8 * (lane // 16), lane % 16),
    ),
}


@pytest.fixture(scope="module")
def amd_lane_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    source = kernel_source()
    start = source.index("__device__ int amd_matrix_col")
    functions = source[start : source.index("#if defined(MMA_NVIDIA)\n\nstruct")]
    folder = tmp_path_factory.mktemp("amd_lanes")
    (folder / "lanes.cpp").write_text("#define __device__\n" + functions + _AMD_DRIVER)
    subprocess.run([CXX, "-std=c++17", "-o", str(folder / "lanes"), str(folder / "lanes.cpp")], check=True)
    return folder / "lanes"


@pytest.mark.parametrize("ld", [40, 72, 136], ids=lambda ld: f"ld{ld}")  # mma.cu's tiles; attention's Q/K rows
@pytest.mark.parametrize("family", list(AMD_LAYOUTS))
def test_the_amd_matrix_instruction_computes_a_times_b_transposed_where_mma_row_and_col_say(
    amd_lane_program: Path, family: str, ld: int
) -> None:
    layout = AMD_LAYOUTS[family]
    out = subprocess.run([str(amd_lane_program), str(ld)], capture_output=True, text=True, check=True).stdout
    table = np.array([line.split() for line in out.splitlines()], int)[: layout.wave]
    column = table[:, 0]
    offset = table[:, 1 + list(AMD_LAYOUTS).index(family)]
    rows = table[:, 4:].reshape(layout.wave, 8, 3)[:, : 256 // layout.wave, list(AMD_LAYOUTS).index(family)]
    rng = np.random.default_rng(7)
    a_tile, b_tile = rng.integers(-8, 8, (2, 16, ld))  # A[m][k] and B[n][k] in rows of ld elements
    lanes = np.arange(layout.wave)[:, None]
    items = np.arange(layout.k_per_lane)[None, :]
    at = offset[:, None] + items  # each lane loads a run of consecutive elements from its offset
    # The instruction reads item j of lane l as the (row, k) its layout names: rebuild A and B.
    a_seen, b_seen = np.full((16, 16), -99), np.full((16, 16), -99)
    m, k = layout.ab(lanes, items)
    a_seen[m, k] = a_tile.reshape(-1)[at]
    b_seen[m, k] = b_tile.reshape(-1)[at]
    assert (a_seen[m, k] == a_tile.reshape(-1)[at]).all(), "lanes holding the same element disagree"
    assert (b_seen[m, k] == b_tile.reshape(-1)[at]).all(), "lanes holding the same element disagree"
    product = a_seen @ b_seen.T  # D[m][n] = sum_k A[m][k] B[k][n], B[k][n] = B stored at [n][k]
    c_items = np.arange(256 // layout.wave)[None, :]
    held = product[layout.c(lanes, c_items)]  # what the instruction leaves in each lane's items
    placed = np.full((16, 16), -99)
    placed[rows, np.broadcast_to(column[:, None], rows.shape)] = held
    np.testing.assert_array_equal(placed, a_tile[:, :16] @ b_tile[:, :16].T)
    assert len({(r, c) for r, c in zip(rows.reshape(-1), np.repeat(column, rows.shape[1]), strict=True)}) == 256


# -- int8.cu: ldmatrix for the s8 A fragment of mma.sync m16n8k32, and the B words --------------

_INT8_DRIVER = """
#include <cstdio>
#include <cstdlib>
int main() {
    for (int lane = 0; lane < 32; ++lane) printf("%d %d %d\\n", int8_ldmatrix_a_offset(lane), int8_b_row(lane),
                                                 int8_b_quad(lane));
    unsigned int words[8];
    for (int i = 0; i < 8; ++i) words[i] = (unsigned int)strtoul(getenv(i < 4 ? "LOW" : "HIGH"), 0, 16) * (i + 1);
    for (int i = 0; i < 8; ++i) printf("%u ", words[i]);
    printf("\\n");
    for (int kb = 0; kb < 2; ++kb) {
        for (int quad = 0; quad < 4; ++quad) {
            unsigned int b0, b1, k0, k1;
            Int8Format<ES_TYPE_Q4_0>::b_words(words, kb, quad, &b0, &b1);
            Int8Format<ES_TYPE_Q4_K>::b_words(words, kb, quad, &k0, &k1);
            printf("%u %u %u %u\\n", b0, b1, k0, k1);
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def int8_lanes(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(INT8_X_STRIDE, int [32, 3]: a offset, b row, b quad per lane; the 8 weight words; the
    [2 blocks, 4 quads, 4] b0/b1 words of Q4_0 then Q4_K for them)."""
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    source = kernel_source()
    stride = re.search(r"#define INT8_X_STRIDE (\d+)", source)
    words = re.search(r"#define INT8_W_WORDS (\d+)", source)
    assert stride and words
    functions = source[
        source.index("template <int TYPE> struct Int8Format;") : source.index("#if defined(INT8_NVIDIA)")
    ]
    start = source.index("__device__ unsigned int nibbles_minus_8(")  # gemv.cu's, shared with int8.cu
    nibbles = source[start : source.index("}\n", start) + 2]
    prelude = (
        "#define __device__\n#define ES_TYPE_Q4_0 2\n#define ES_TYPE_Q4_K 12\n"
        f"#define INT8_X_STRIDE {stride.group(1)}\n#define INT8_W_WORDS {words.group(1)}\n"
        "struct Int8Scales { float d, s; };\nfloat half_to_float(unsigned int);\n"
        "void k4_scale_min(const unsigned short*, int, int*, int*);\n" + nibbles
    )
    folder = tmp_path_factory.mktemp("int8_lanes")
    (folder / "lanes.cpp").write_text(prelude + functions + _INT8_DRIVER)
    subprocess.run([CXX, "-std=c++17", "-o", str(folder / "lanes"), str(folder / "lanes.cpp")], check=True)
    env = {"LOW": "9e3c5a17", "HIGH": "1f2e3d4c"}
    out = subprocess.run([str(folder / "lanes")], capture_output=True, text=True, check=True, env=env).stdout
    lines = out.splitlines()
    table = np.array([line.split() for line in lines[:32]], int)
    row_words = np.array(lines[32].split(), np.uint64).astype(np.uint32)
    fragments = np.array([line.split() for line in lines[33:]], np.uint64).astype(np.uint32).reshape(2, 4, 4)
    return int(stride.group(1)), table, row_words, fragments


def test_ldmatrix_gives_the_int8_mma_its_a_fragments(
    int8_lanes: tuple[int, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    stride, table, _, _ = int8_lanes
    a = np.arange(16 * stride).reshape(16, stride)  # A[m][k] (one byte each) at a[m, k]
    flat = a.reshape(-1)
    t = np.arange(32)
    g, c = t // 4, t % 4
    # ldmatrix .x4 (b16): lanes 8j..8j+7 name the rows of matrix j; lane t gets bytes 4 (t % 4)..+3
    # of row t / 4 of each matrix.
    regs = np.empty((32, 4, 4), a.dtype)
    for j in range(4):
        rows = np.stack([flat[table[8 * j + r, 0] : table[8 * j + r, 0] + 16] for r in range(8)])
        for byte in range(4):
            regs[:, j, byte] = rows[g, 4 * c + byte]
    # PTX ISA, m16n8k32 .s8 A: a0 = A[g][4c..], a1 = A[g+8][4c..], a2 = A[g][16+4c..], a3 = A[g+8][16+4c..]
    for reg, (row, col) in enumerate([(g, 4 * c), (g + 8, 4 * c), (g, 16 + 4 * c), (g + 8, 16 + 4 * c)]):
        for byte in range(4):
            assert (regs[:, reg, byte] == a[row, col + byte]).all(), (reg, byte)


def test_each_lane_reads_the_b_column_the_int8_mma_asks_of_it(
    int8_lanes: tuple[int, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    _, table, _, _ = int8_lanes
    t = np.arange(32)
    # PTX ISA, m16n8k32 .s8 B: b0 = B[4c..4c+3][g], b1 = B[16+4c..16+4c+3][g]
    assert (table[:, 1] == t // 4).all() and (table[:, 2] == t % 4).all()


def test_b_words_hold_the_quants_of_k_4c_and_16_plus_4c(
    int8_lanes: tuple[int, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    _, _, row_words, fragments = int8_lanes
    row_bytes = row_words.view(np.uint8)  # the 32 nibble bytes of a staged weight row
    low, high = (row_bytes & 0xF).astype(np.int64), (row_bytes >> 4).astype(np.int64)
    for kb in range(2):
        # Q4_0: block kb is bytes 16kb..16kb+15; element k < 16 in the low nibble of byte k, k >= 16
        # in the high nibble of byte k - 16; the value is the nibble minus 8.
        q4_0 = np.concatenate([low[16 * kb : 16 * kb + 16], high[16 * kb : 16 * kb + 16]]) - 8
        # Q4_K: sub-block kb of the 64-element chunk: element k in nibble kb of byte k.
        q4_k = (low if kb == 0 else high)[:32]
        for quad in range(4):
            got = fragments[kb, quad].view(np.int8).reshape(4, 4).astype(np.int64)  # b0, b1 of Q4_0, Q4_K
            for expected, b0, b1 in ((q4_0, got[0], got[1]), (q4_k, got[2], got[3])):
                assert (b0 == expected[4 * quad : 4 * quad + 4]).all(), (kb, quad)
                assert (b1 == expected[16 + 4 * quad : 16 + 4 * quad + 4]).all(), (kb, quad)
