"""The block decoders of decode.cu, compiled for the host, against gguf.quants.dequantize.

The decoders and the slice staging (unit_of) are plain C++; with __device__ defined away a
host compiler builds them, so the device decode is checked bit for bit on every type
without a GPU. Skipped, with the reason, where no C++ compiler is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from expertstream.kernels import kernel_source
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

_DRIVER = """
#include <cstdio>
#include <cstdlib>
#include <vector>

template <int TYPE> static void decode_blocks(int n_blocks) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    std::vector<Unit> block(BlockFormat<TYPE>::bytes / sizeof(Unit) + 1);
    for (int b = 0; b < n_blocks; ++b) {
        if (fread(block.data(), 1, BlockFormat<TYPE>::bytes, stdin) != (size_t)BlockFormat<TYPE>::bytes) exit(2);
        for (int s = 0; s < BlockFormat<TYPE>::slices; ++s) {
            Unit staged[BlockFormat<TYPE>::slice_units];
            for (int h = 0; h < BlockFormat<TYPE>::slice_units; ++h) {
                staged[h] = block[BlockFormat<TYPE>::unit_of(s, h)];
            }
            float values[32];
            decode_slice<TYPE>(staged, s, values);
            fwrite(values, sizeof(float), 32, stdout);
        }
    }
}

int main(int argc, char** argv) {
    const int type = atoi(argv[1]);
    const int n_blocks = atoi(argv[2]);
    switch (type) {
%s
    default: return 3;
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    source = kernel_source()
    decoders = source[source.index("#define ES_TYPE_") : source.index("// Grouping")]
    cases = "\n".join(f"    case {int(t)}: decode_blocks<{int(t)}>(n_blocks); break;" for t in FORMATS)
    folder = tmp_path_factory.mktemp("decode")
    (folder / "decode.cpp").write_text(
        "#define __device__\n#define __global__\n#include <cmath>\n" + decoders + _DRIVER % cases
    )
    # No contraction: the host must round like the device's explicit operations.
    subprocess.run(
        [CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-o", str(folder / "decode"), str(folder / "decode.cpp")],
        check=True,
    )
    return folder / "decode"


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_device_decoder_matches_gguf(decoder: Path, rng: np.random.Generator, qtype: GGMLQuantizationType) -> None:
    fmt = FORMATS[qtype]
    rows = ref.random_weights(rng, qtype, 32, 4 * max(fmt.block_elements, 32))
    if fmt.quantized:  # a dirty padding block too: it must decode to the same non-finite values
        rows = np.concatenate([rows, np.full((1, rows.shape[1]), 0xFF, np.uint8)])
    block_bytes = fmt.block_bytes if fmt.quantized else 32 * fmt.block_bytes
    run = subprocess.run(
        [str(decoder), str(int(qtype)), str(rows.size // block_bytes)], input=rows.tobytes(), capture_output=True
    )
    assert run.returncode == 0, run.stderr.decode()
    ours = np.frombuffer(run.stdout, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = np.asarray(dequantize(rows, qtype), np.float32).reshape(-1)
    assert ours.size == theirs.size
    same = (ours.view(np.uint32) == theirs.view(np.uint32)) | (np.isnan(ours) & np.isnan(theirs))
    assert same.all(), f"{np.count_nonzero(~same)} of {same.size} values differ, first at {np.argmin(same)}"
