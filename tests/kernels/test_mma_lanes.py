"""mma.cu's NVIDIA lane arithmetic against the fragment layouts the PTX ISA documents.

The addresses each lane hands ldmatrix .x4 and the C element each lane holds after
mma.sync m16n8k16 are plain integer functions; compiled for the host, they are checked
here by emulating ldmatrix and the A/B/C fragment layouts (PTX ISA, "Matrix Fragments for
mma.m16n8k16" with .bf16). The host run of the kernels (test_kernels_on_host) uses the
generic step instead, so this is what covers the tensor-core indexing without a GPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess

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
