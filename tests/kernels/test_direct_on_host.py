"""The direct-decode kernels of direct.cu, compiled for the host and run on CPU threads.

The harness of test_kernels_on_host (each GPU thread a fiber, __syncthreads a hand-over, rounds
in random order) runs the generic branch of direct.cu: fragments read lane by lane from the
shared activation tile, the matrix step taken through a per-warp exchange in shared memory with
mma.sync's fragment layout. Everything else is the code the GPU runs: the activation rounding
into fragment order, the per-type fragment decoders, the double-buffered copies and their one
barrier per step, the padding tail and the three epilogues. Results are checked against the
float64 reference within the bf16 path's tolerance, for the same bytes across tile heights, and
(to the bit) against the simulator's twins where they compute the same float32 operations.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.kernels import kernel_source, quants, twins
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS, MatrixPath, TileM

from .test_kernels_on_host import _FIBERS, CXX, build_on_host, with_tail

DIRECT_TYPES = [fmt.qtype for fmt in FORMATS.values() if fmt.direct]

_DRIVER = (
    _FIBERS
    + """
typedef void (*Plain)(const unsigned char*, const unsigned short*, const int*, float*, int, int, int, int, int, int,
                      const float*);
typedef void (*GateUp)(const unsigned char*, const unsigned char*, const unsigned short*, const int*, float*, int,
                       int, int, int, int, int);

// argv: kernel index, tile height, mode (0 plain, 1 routed, 2 gate/up), [rounded]: write the
// rounded activations instead of the outputs.
int main(int argc, char** argv) {
    const int kernel = atoi(argv[1]);
    const int tile_m = atoi(argv[2]);
    const int mode = atoi(argv[3]);
    std::vector<int> shape = read_array<int>(7);
    const int n_expert = shape[0], n_out = shape[1], n_in = shape[2], n_tokens = shape[3], top_k = shape[4];
    const int x_per_pair = shape[5], w_bytes = shape[6];
    const int n_pairs = n_tokens * top_k;
    const int x_rows = x_per_pair ? n_pairs : n_tokens;
    std::vector<unsigned char> w = read_array<unsigned char>(w_bytes);
    std::vector<unsigned char> w2 = read_array<unsigned char>(mode == 2 ? w_bytes : 0);
    std::vector<float> x = read_array<float>((size_t)x_rows * n_in);
    std::vector<int> ids = read_array<int>(n_pairs);
    std::vector<float> route = read_array<float>(mode == 1 ? n_pairs : 0);
    std::vector<unsigned short> xb((size_t)x_rows * n_in);
    const long long words = (long long)x_rows * n_in / 2;
    for (unsigned bx = 0; bx < (unsigned)((words + DIRECT_ROUND_THREADS - 1) / DIRECT_ROUND_THREADS); ++bx) {
        blockIdx = EsDim3{bx, 0, 0};
        blockDim = EsDim3{DIRECT_ROUND_THREADS, 1, 1};
        gridDim = EsDim3{(unsigned)((words + DIRECT_ROUND_THREADS - 1) / DIRECT_ROUND_THREADS), 1, 1};
        run_block(DIRECT_ROUND_THREADS, [&] { moe_round_x_direct(x.data(), (unsigned int*)xb.data(), x_rows, n_in); });
    }
    if (argc > 4) {
        fwrite(xb.data(), sizeof(unsigned short), xb.size(), stdout);
        return 0;
    }
    const int max_tiles = (n_pairs + tile_m - 1) / tile_m + n_expert + 1;
    std::vector<int> scratch = grouped(ids, n_pairs, n_expert, tile_m, max_tiles);
    std::vector<float> y((size_t)n_pairs * n_out, NAN);
    Plain plain[] = {%s};
    GateUp gate_up[] = {%s};
    const int per_block = mode == 2 ? MOE_TILE_N / 2 : MOE_TILE_N;
    for (unsigned by = 0; by < (unsigned)max_tiles; ++by) {
        for (unsigned bx = 0; bx < (unsigned)(n_out + per_block - 1) / per_block; ++bx) {
            blockIdx = EsDim3{bx, by, 0};
            blockDim = EsDim3{MOE_DIRECT_THREADS, 1, 1};
            run_block(MOE_DIRECT_THREADS, [&] {
                if (mode == 2) {
                    gate_up[kernel](w.data(), w2.data(), xb.data(), scratch.data(), y.data(), n_expert, n_out, n_in,
                                    top_k, x_per_pair, max_tiles);
                } else {
                    plain[kernel](w.data(), xb.data(), scratch.data(), y.data(), n_expert, n_out, n_in, top_k,
                                  x_per_pair, max_tiles, mode == 1 ? route.data() : nullptr);
                }
            });
        }
    }
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}
"""
)

KERNELS = [(t, tile) for t in DIRECT_TYPES for tile in FORMATS[t].direct_tiles]
PLAIN, ROUTED, GATE_UP = 0, 1, 2


@pytest.fixture(scope="module")
def direct_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    names = [
        ", ".join(FORMATS[t].direct_kernel_name(tile, gate_up) for t, tile in KERNELS) for gate_up in (False, True)
    ]
    return build_on_host(tmp_path_factory.mktemp("direct_kernels"), kernel_source(DIRECT_TYPES), _DRIVER % tuple(names))


def _run(binary: Path, args: list[str], data: bytes) -> bytes:
    return subprocess.run([str(binary), *args], input=data, capture_output=True, check=True).stdout


def run_direct(
    binary: Path,
    w_type: GGMLQuantizationType,
    tile: TileM,
    mode: int,
    tensors: list[np.ndarray],
    x: np.ndarray,
    ids: np.ndarray,
    n_expert: int,
    n_out: int,
    n_in: int,
    route: np.ndarray | None = None,
) -> np.ndarray:
    n_tokens, top_k = ids.shape
    header = struct.pack("7i", n_expert, n_out, n_in, n_tokens, top_k, int(x.ndim == 3), tensors[0].nbytes)
    data = header + b"".join(t.tobytes() for t in tensors)
    data += np.ascontiguousarray(x, np.float32).tobytes() + ids.astype(np.int32).tobytes()
    if route is not None:
        data += np.ascontiguousarray(route, np.float32).tobytes()
    out = _run(binary, [str(KERNELS.index((w_type, tile))), str(int(tile)), str(mode)], data)
    return np.frombuffer(out, np.float32).reshape(n_tokens, top_k, n_out)


def _problem(
    rng: np.random.Generator, w_type: GGMLQuantizationType, n_out: int = 150, n_in: int = 256
) -> tuple[int, int, int, np.ndarray]:
    # n_out 150: two blocks of 128 rows (three of 64 outputs for gate/up), the last partial; n_in
    # 256 (four k steps) padded to 512, so the padding tail is read. An odd n_out leaves output rows
    # unaligned for the epilogue's paired stores, which then store one column at a time, and puts
    # every other expert of Q6_K (rows of 210 bytes per 256 elements) 2 bytes past a 4-byte boundary.
    n_expert, n_tokens, top_k = 4, 21, 3
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    ids[4, 1] = n_expert  # an id out of range: its row is NaN
    return n_expert, n_out, n_in, ids


# n_in 768: three 256-element blocks a row, so Q6_K's blocks start at 2 mod 4 bytes in turn within a row
# as well as from row to row.
@pytest.mark.parametrize("n_in", [256, 768])
@pytest.mark.parametrize("w_type", DIRECT_TYPES, ids=lambda t: t.name)
def test_direct_kernels_match_reference_and_agree_across_tiles(
    direct_kernels: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n_in: int
) -> None:
    n_expert, n_out, n_in, ids = _problem(rng, w_type, n_in=n_in)
    n_tokens, top_k = ids.shape
    bad = ids >= n_expert
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    for x_per_pair in (False, True):
        x = rng.standard_normal((n_tokens, top_k, n_in) if x_per_pair else (n_tokens, n_in)).astype(np.float32)
        expected = ref.mul_mat_id(w, w_type, n_expert, n_out, n_in, x, ids)
        results = []
        for tile in FORMATS[w_type].direct_tiles:
            y = run_direct(
                direct_kernels, w_type, tile, PLAIN, [with_tail(w, w_type, n_in)], x, ids, n_expert, n_out, n_in
            )
            assert np.isnan(y[bad]).all(), f"m{int(tile)}: rows of bad ids are not NaN"
            assert np.isfinite(y[~bad]).all(), f"m{int(tile)}: outputs unwritten or not finite"
            err = ref.relative_error(y[~bad], expected[~bad])
            assert err < ref.mul_mat_id_rtol(MatrixPath.MMA), f"m{int(tile)}: relative error {err:.3g}"
            results.append(y)
        assert all(r.tobytes() == results[0].tobytes() for r in results), "tiles disagree"


@pytest.mark.parametrize("n_out", [150, 149])
@pytest.mark.parametrize("w_type", DIRECT_TYPES, ids=lambda t: t.name)
def test_gate_up_and_routed_epilogues(
    direct_kernels: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n_out: int
) -> None:
    """gate_up gives silu(gate) * up of the plain kernel's outputs, and the routed kernel each pair's
    weight times them, with the float32 operations of moe_swiglu and combine."""
    n_expert, n_out, n_in, ids = _problem(rng, w_type, n_out)
    n_tokens, _top_k = ids.shape
    good = ids < n_expert
    gate_w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    gate, up = (with_tail(w, w_type, n_in) for w in (gate_w, ref.random_weights(rng, w_type, n_expert * n_out, n_in)))
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    tile = TileM.SHORT
    g, u = (run_direct(direct_kernels, w_type, tile, PLAIN, [t], x, ids, n_expert, n_out, n_in) for t in (gate, up))
    expected_g = ref.mul_mat_id(gate_w, w_type, n_expert, n_out, n_in, x, ids)
    assert ref.relative_error(g[good], expected_g[good]) < ref.mul_mat_id_rtol(MatrixPath.MMA)
    fused = run_direct(direct_kernels, w_type, tile, GATE_UP, [gate, up], x, ids, n_expert, n_out, n_in)
    with np.errstate(over="ignore"):
        expected = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    assert np.isnan(fused[~good]).all()
    np.testing.assert_allclose(fused[good], expected[good], rtol=1e-6, atol=1e-6)
    route = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    routed = run_direct(direct_kernels, w_type, tile, ROUTED, [gate], x, ids, n_expert, n_out, n_in, route)
    assert routed[good].tobytes() == (route[..., None] * g)[good].tobytes()
    assert np.isnan(routed[~good]).all()
    tallest = max(FORMATS[w_type].direct_tiles)
    tall = run_direct(direct_kernels, w_type, tallest, GATE_UP, [gate, up], x, ids, n_expert, n_out, n_in)
    assert tall.tobytes() == fused.tobytes()


def test_rounded_activations_are_the_twins_bytes(direct_kernels: Path, rng: np.random.Generator) -> None:
    """moe_round_x_direct and twins.round_x_direct agree bit for bit (ties to even included), and the
    twin's inverse gives back the rounded values in element order."""
    n_rows, n_in = 5, 128
    x = (rng.standard_normal((n_rows, n_in)) * np.exp(rng.uniform(-30, 30, (n_rows, 1)))).astype(np.float32)
    x[1, :8] = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-140, 0, -0.0, 3e38, -3e38], np.float32)
    header = struct.pack("7i", 1, 1, n_in, n_rows, 1, 0, 0)
    got = _run(direct_kernels, ["0", "32", "0", "rounded"], header + x.tobytes() + np.zeros(n_rows, np.int32).tobytes())
    got_bits = np.frombuffer(got, np.uint16).reshape(n_rows, n_in)
    assert got_bits.tobytes() == twins.round_x_direct(x).tobytes()
    back = twins.unround_x_direct(got_bits, n_in)
    assert back.tobytes() == twins.round_to_bf16(x).tobytes()


# MXFP4 rows of 320 elements (170 bytes) start 2 bytes past a 4-byte boundary every other row, as its
# odd k steps do within a row.
@pytest.mark.parametrize(
    ("w_type", "n_in"),
    [*((t, 768) for t in DIRECT_TYPES), (GGMLQuantizationType.MXFP4, 320)],
    ids=lambda v: v.name if isinstance(v, GGMLQuantizationType) else str(v),
)
def test_each_weight_is_decode_slices_value_in_bf16(
    direct_kernels: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n_in: int
) -> None:
    """Token t's activations are 1 at element t and 0 elsewhere, so output n of token t is weight (n, t)
    alone: every weight, wherever it lies in its block and k step, is the float32 value of
    decode_slice (quants.decode_rows repeats its operations) rounded to bf16. Expert 1 of rows of 768
    elements: with 63 rows an expert, its Q6_K rows and blocks start 2 bytes past a 4-byte boundary in
    turn, and so does the expert."""
    n_expert, n_out = 2, 63
    fmt = FORMATS[w_type]
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    x = np.eye(n_in, dtype=np.float32)
    ids = np.ones((n_in, 1), np.int32)
    y = run_direct(
        direct_kernels, w_type, TileM.SHORT, PLAIN, [with_tail(w, w_type, n_in)], x, ids, n_expert, n_out, n_in
    )
    rows = w.reshape(n_expert * n_out, fmt.row_bytes(n_in))[n_out:]
    expected = twins.round_to_bf16(quants.decode_rows(rows, w_type))
    np.testing.assert_array_equal(y[:, 0, :], expected.T)
