"""The bf16 rounding of the matrix-core kernels: mma.cu's portable rounding, compiled for the
host, against the twins' round_to_bf16 bit for bit, and both against rounding done in float64.

On NVIDIA the kernels round with cvt.rn.bf16x2.f32, which rounds the same way (to nearest,
ties to even); the CUDA suite checks the kernels' results against the reference.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from expertstream.kernels import kernel_source
from expertstream.kernels.twins import round_to_bf16

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

_DRIVER = """
#include <cstdio>

int main() {
    float f;
    while (fread(&f, sizeof f, 1, stdin) == 1) {
        const unsigned short h = (unsigned short)float_to_bf16_bits(f);
        fwrite(&h, sizeof h, 1, stdout);
    }
    return 0;
}
"""


def _samples(rng: np.random.Generator) -> np.ndarray:
    """float32 values around every rounding case: ties, carries into the exponent, subnormals,
    the largest finite values, infinities and NaNs."""
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    tie_bits = (rng.integers(0, 2**16, 2000, dtype=np.uint64).astype(np.uint32) << 16) | np.uint32(0x8000)
    edges = np.array(
        [0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x3FFFFFFF,
         0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF],
        np.uint32,
    )  # fmt: skip
    return np.concatenate([random_bits, tie_bits, edges]).view(np.float32)


def _rounded_in_float64(values: np.ndarray) -> np.ndarray:
    """Nearest bf16 of finite values, found by comparing the two neighbours in float64, ties
    to the even one; past the largest finite bf16 the upper neighbour is 2^128, i.e. infinity."""
    bits = values.view(np.uint32)
    down_bits = bits & np.uint32(0xFFFF0000)
    up_bits = down_bits + np.uint32(0x10000)
    lo = down_bits.view(np.float32).astype(np.float64)
    carry = (up_bits & np.uint32(0x7FFFFFFF)) == np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        up = np.where(carry, np.copysign(2.0**128, lo), up_bits.view(np.float32).astype(np.float64))
    x = values.astype(np.float64)
    odd = ((bits >> np.uint32(16)) & np.uint32(1)) == 1
    to_up = (np.abs(up - x) < np.abs(x - lo)) | ((np.abs(up - x) == np.abs(x - lo)) & odd)
    with np.errstate(over="ignore"):
        return np.where(to_up, up, lo).astype(np.float32)


def test_twin_rounds_to_nearest_even(rng: np.random.Generator) -> None:
    values = _samples(rng)
    finite = np.isfinite(values)
    ours = round_to_bf16(values)
    expected = _rounded_in_float64(values[finite])
    assert (ours[finite].view(np.uint32) == expected.view(np.uint32)).all()
    assert np.isnan(ours[np.isnan(values)]).all()
    assert (ours[np.isinf(values)] == values[np.isinf(values)]).all()


@pytest.fixture(scope="module")
def host_rounding(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    source = kernel_source()
    start = source.index("__device__ unsigned int float_to_bits")  # formats.cu's, which the rounding uses
    bits = source[start : source.index("}\n", start) + 2]
    rounding = (
        bits
        + source[
            source.index("__device__ unsigned int float_to_bf16_bits") : source.index(
                "__device__ unsigned int pack_bf16x2"
            )
        ]
    )
    folder = tmp_path_factory.mktemp("bf16")
    (folder / "round.cpp").write_text("#define __device__\n" + rounding + _DRIVER)
    subprocess.run([CXX, "-std=c++17", "-O1", "-o", str(folder / "round"), str(folder / "round.cpp")], check=True)
    return folder / "round"


def test_kernel_rounding_matches_the_twin(host_rounding: Path, rng: np.random.Generator) -> None:
    values = _samples(rng)
    run = subprocess.run([str(host_rounding)], input=values.tobytes(), capture_output=True, check=True)
    kernel = (np.frombuffer(run.stdout, np.uint16).astype(np.uint32) << 16).view(np.float32)
    twin = round_to_bf16(values)
    same = (kernel.view(np.uint32) == twin.view(np.uint32)) | (np.isnan(kernel) & np.isnan(twin))
    assert same.all(), f"{np.count_nonzero(~same)} of {same.size} differ, first at {values[np.argmin(same)]!r}"
