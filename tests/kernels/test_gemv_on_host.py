"""gemv.cu's matrix-vector mul_mat_id itself, compiled for this host and run block by block with
test_kernels_on_host's fiber runner (each round of a block's threads in a fresh random order), against
the float64 reference: the CUDA-C the GPUs run, checked where no GPU is. The host takes the kernel's
generic wave sum (shared memory and barriers), the one AMD's wave64 targets take.

Each problem runs with the weights and activations 16-byte aligned (the types whose slices are 16-byte
runs load them 16 bytes at a time, the activations 4 floats at a time) and misaligned (one unit at a
time): the outputs must be the same bytes, and the same again on a second run (no dependence on the
order the threads ran in).
"""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.kernels import kernel_source, layout
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS
from expertstream.kernels.program import source_file

from .test_kernels_on_host import _FIBERS, CXX, WARP_EMULATION, build_on_host, with_tail

_T = GGMLQuantizationType
# Whole 32-element blocks (Q4_0, Q8_0, bytes for MXFP4), 256-element blocks loaded in 16-byte runs (Q4_K)
# or not (Q6_K, IQ2_XS), and the float types (partial last slice; F16 in 16-byte runs, F32 in words).
TYPES = (_T.Q4_0, _T.Q8_0, _T.MXFP4, _T.Q4_K, _T.Q6_K, _T.IQ2_XS, _T.F16, _T.F32)

_DRIVER = (
    _FIBERS
    + """
typedef void (*MulMatVecId)(const unsigned char*, const float*, const int*, float*, int, int, int, int, int, int,
                            const float*, const float*);
typedef void (*GateUpVecId)(const unsigned char*, const unsigned char*, const float*, const int*, float*, int, int, int,
                            int, int);

int main(int argc, char** argv) {
    MulMatVecId kernels[] = {%s};
    MulMatVecId one_row_kernels[] = {%s};
    GateUpVecId gate_up_kernels[] = {%s};
    const int kernel = atoi(argv[1]);
    std::vector<int> shape = read_array<int>(10);
    const int n_expert = shape[0], n_out = shape[1], n_in = shape[2], n_tokens = shape[3], top_k = shape[4];
    const int x_per_pair = shape[5], w_bytes = shape[6], w_shift = shape[7], x_shift = shape[8];
    // route weights; a SwiGLU gate (then y twice); gate_up of the two halves of w (then y twice); the kernel
    // with one row a wave
    const int scaled = shape[9] & 1, gated = shape[9] & 2, fused = shape[9] & 4, one_row = shape[9] & 8;
    const int n_pairs = n_tokens * top_k;
    const size_t x_count = (size_t)(x_per_pair ? n_pairs : n_tokens) * n_in;
    // Placed w_shift bytes (x_shift floats) past a 16-byte boundary.
    std::vector<float> w_storage(w_bytes / 4 + 8);
    std::vector<float> x_storage(x_count + 8);
    unsigned char* w = (unsigned char*)w_storage.data() + (16 - (size_t)w_storage.data() %% 16) %% 16 + w_shift;
    float* x = x_storage.data() + (16 - (size_t)x_storage.data() %% 16) %% 16 / 4 + x_shift;
    if (w_bytes && fread(w, 1, w_bytes, stdin) != (size_t)w_bytes) exit(2);
    if (fread(x, sizeof(float), x_count, stdin) != x_count) exit(2);
    std::vector<int> ids = read_array<int>(n_pairs);
    std::vector<float> route_weights = read_array<float>(scaled ? n_pairs : 0);
    std::vector<float> gate = read_array<float>(gated ? (size_t)n_pairs * n_out : 0);
    const unsigned block_rows = one_row ? MOE_GEMV_BLOCK_ROWS(1) : MOE_GEMV_ROWS;
    const unsigned grid_x = (n_out + block_rows - 1) / block_rows;
    MulMatVecId mul_mat_vec_id = (one_row ? one_row_kernels : kernels)[kernel];
    gridDim = EsDim3{grid_x, (unsigned)n_pairs, 1};
    blockDim = EsDim3{MOE_GEMV_THREADS, 1, 1};
    auto launch = [&](const float* silu_gate) {
        std::vector<float> y((size_t)n_pairs * n_out, NAN);
        for (unsigned by = 0; by < (unsigned)n_pairs; ++by) {
            for (unsigned bx = 0; bx < grid_x; ++bx) {
                blockIdx = EsDim3{bx, by, 0};
                run_block(MOE_GEMV_THREADS, [&] {
                    mul_mat_vec_id(w, x, ids.data(), y.data(), n_expert, n_out, n_in, top_k, x_per_pair, n_pairs,
                                   scaled ? route_weights.data() : nullptr, silu_gate);
                });
            }
        }
        return y;
    };
    if (fused) {  // gate_up_vec_id of w's halves, then the gate launch and the up launch with its output as silu_gate
        const unsigned char* w_up = w + w_bytes / 2;
        std::vector<float> y((size_t)n_pairs * n_out, NAN);
        const unsigned grid_gate_up = (n_out + MOE_GEMV_GATE_UP_ROWS - 1) / MOE_GEMV_GATE_UP_ROWS;
        gridDim = EsDim3{grid_gate_up, (unsigned)n_pairs, 1};
        for (unsigned by = 0; by < (unsigned)n_pairs; ++by) {
            for (unsigned bx = 0; bx < grid_gate_up; ++bx) {
                blockIdx = EsDim3{bx, by, 0};
                run_block(MOE_GEMV_THREADS, [&] {
                    gate_up_kernels[kernel](w, w_up, x, ids.data(), y.data(), n_expert, n_out, n_in, top_k, n_pairs);
                });
            }
        }
        fwrite(y.data(), sizeof(float), y.size(), stdout);
        gridDim = EsDim3{grid_x, (unsigned)n_pairs, 1};
        std::vector<float> g = launch(nullptr);
        unsigned char* w_gate = w;
        w = (unsigned char*)w_up;
        std::vector<float> both = launch(g.data());
        w = w_gate;
        fwrite(both.data(), sizeof(float), both.size(), stdout);
        return 0;
    }
    std::vector<float> y = launch(gated ? gate.data() : nullptr);
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    if (gated) {  // then the launch without the gate followed by moe_swiglu's operations
        std::vector<float> up = launch(nullptr);
        for (size_t i = 0; i < up.size(); ++i) {
            const float g = gate[i];
            up[i] = g / (1.0f + expf(-g)) * up[i];
        }
        fwrite(up.data(), sizeof(float), up.size(), stdout);
    }
    return 0;
}
"""
)


def build_gemv(folder: Path, source: str, prefix: str = "") -> Path:
    """_DRIVER over ``source``'s matrix-vector kernels of TYPES, compiled for this host after ``prefix``."""
    names = ", ".join(FORMATS[t].gemv_kernel_name for t in TYPES)
    one_row_names = ", ".join(FORMATS[t].gemv_one_row_kernel_name for t in TYPES)
    gate_up_names = ", ".join(FORMATS[t].gemv_gate_up_kernel_name for t in TYPES)
    return build_on_host(folder, prefix + source, _DRIVER % (names, one_row_names, gate_up_names))


@pytest.fixture(scope="module")
def host_gemv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    return build_gemv(tmp_path_factory.mktemp("host_gemv"), kernel_source(TYPES))


def run_gemv(
    binary: Path,
    w_type: GGMLQuantizationType,
    padded: np.ndarray,
    x: np.ndarray,
    ids: np.ndarray,
    shape: tuple[int, int, int],
    misaligned: bool = False,
    route_weights: np.ndarray | None = None,
    silu_gate: np.ndarray | None = None,
    up: np.ndarray | None = None,
    one_row: bool = False,
) -> np.ndarray:
    """y [n_tokens, top_k, n_out] from the kernel; ``misaligned`` places w one unit and x one float
    past a 16-byte boundary. With ``silu_gate``: [2, n_tokens, top_k, n_out], the kernel's output with
    that gate, then its output without it followed by moe_swiglu's operations. With ``up`` (padded
    like ``padded``, the gate): [2, n_tokens, top_k, n_out], gate_up_vec_id's output, then the gate
    launch's followed by the up launch's with it as silu_gate. ``one_row``: the kernel with one row a wave."""
    n_expert, n_out, n_in = shape
    n_tokens, top_k = ids.shape
    w_shift, x_shift = (FORMATS[w_type].unit_bytes, 1) if misaligned else (0, 0)
    w_bytes = padded.tobytes() + (b"" if up is None else up.tobytes())
    fields = (n_expert, n_out, n_in, n_tokens, top_k, int(x.ndim == 3), len(w_bytes), w_shift, x_shift)
    flags = int(route_weights is not None) | 2 * int(silu_gate is not None) | 4 * int(up is not None) | 8 * int(one_row)
    header = struct.pack("10i", *fields, flags)
    data = header + w_bytes + np.ascontiguousarray(x, np.float32).tobytes() + ids.astype(np.int32).tobytes()
    if route_weights is not None:
        data += route_weights.astype(np.float32).tobytes()
    if silu_gate is not None:
        data += silu_gate.astype(np.float32).tobytes()
    run = subprocess.run([str(binary), str(TYPES.index(w_type))], input=data, capture_output=True, check=True)
    out = np.frombuffer(run.stdout, np.float32)
    pairs = (n_tokens, top_k, n_out)
    return out.reshape(pairs) if silu_gate is None and up is None else out.reshape(2, *pairs)


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
def test_matches_reference_aligned_or_not(
    host_gemv: Path, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    # n_out 13: odd, the last block of rows partial. n_in 768 reads the padding tail of quantized
    # rows; 200 ends the float rows in a partial slice. Ids out of range give NaN rows.
    fmt = FORMATS[w_type]
    n_expert, n_out, n_in = 4, 13, 768 if fmt.quantized else 200
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.array([[3, 0, -2], [1, 4, 3]], np.int32)
    bad = (ids < 0) | (ids >= n_expert)
    padded = with_tail(w, w_type, n_in)
    for x_per_pair in (False, True):
        x = rng.standard_normal((2, 3, n_in) if x_per_pair else (2, n_in)).astype(np.float32)
        expected = ref.mul_mat_vec_id(w, w_type, n_expert, n_out, n_in, x, ids)
        y = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in))
        assert np.isnan(y[bad]).all(), "rows of ids out of range are not NaN"
        assert np.isfinite(y[~bad]).all(), "outputs unwritten or not finite"
        err = ref.relative_error(y[~bad], expected[~bad])
        assert err < ref.MUL_MAT_ID_RTOL, f"relative error {err:.3g}"
        again = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in))
        assert again.tobytes() == y.tobytes(), "a second run (threads in another order) gave other bytes"
        shifted = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in), misaligned=True)
        assert shifted.tobytes() == y.tobytes(), "misaligned inputs (narrow loads) gave other bytes"


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
def test_one_row_a_wave_writes_the_bytes_of_two(
    host_gemv: Path, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """The kernel launches of few rows take (one row a wave, blocks of 8 rows) sums each row as the one of
    two rows a wave does: the same bytes, with the last expert's padding tail, a partial last block of
    either, ids out of range, routing weights and a SwiGLU gate."""
    fmt = FORMATS[w_type]
    n_expert, n_out, n_in = 3, 21, 768 if fmt.quantized else 200
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    padded = with_tail(w, w_type, n_in)
    ids = np.array([[2, 0, 5], [1, 2, -1]], np.int32)
    x = rng.standard_normal((2, 3, n_in)).astype(np.float32)
    scales = rng.uniform(0.1, 1.0, 6).astype(np.float32)
    gate = rng.standard_normal((2, 3, n_out)).astype(np.float32)
    for extra in ({}, {"route_weights": scales}, {"silu_gate": gate}):
        two = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in), **extra)
        one = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in), one_row=True, **extra)
        assert np.isfinite(two[..., :2, :]).all() and np.isnan(two[..., 1, 2, :]).all()
        assert one.tobytes() == two.tobytes(), sorted(extra)


def test_slices_in_flight_do_not_change_the_bytes(
    host_gemv: Path, tmp_path_factory: pytest.TempPathFactory, rng: np.random.Generator
) -> None:
    """One or two slices of each row a lane in flight (MOE_GEMV_DEPTH, MOE_GEMV_INT8_DEPTH): the same
    additions in the same order, so the same bytes, on the float path and the int8 one."""
    depth = {"MOE_GEMV_DEPTH": 1, "MOE_GEMV_INT8_DEPTH": 1}
    source = kernel_source(TYPES)
    for name, value in depth.items():
        assert f"#define {name} {value} " in source, f"{name} is no longer {value}: swap the depths tried here"
        source = source.replace(f"#define {name} {value} ", f"#define {name} 2 ")
    deeper = build_gemv(tmp_path_factory.mktemp("host_gemv_depth2"), source)
    n_expert, n_out, n_in = 3, 11, 2560  # 80 slices: a lane's second and third rounds, the last partial
    ids = np.array([[2, 0, 1]], np.int32)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    for w_type in (_T.Q4_K, _T.Q6_K, _T.F16):
        w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
        padded = with_tail(w, w_type, n_in)
        one = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in))
        two = run_gemv(deeper, w_type, padded, x, ids, (n_expert, n_out, n_in))
        assert np.isfinite(one).all()
        assert one.tobytes() == two.tobytes(), w_type.name


def test_the_warp_path_stages_the_bytes_of_the_block_path(
    host_gemv: Path, tmp_path_factory: pytest.TempPathFactory, rng: np.random.Generator
) -> None:
    """NVIDIA's staging of the int8 activations (each slice's amax exchanged by warp shuffles, one barrier a
    chunk; emulated here) writes the bytes of the shared-memory path: a row of two chunks, a block of
    zeros, one holding a NaN, and a short row. (The emulated shuffles are barriers themselves, so this
    cannot see a chunk staged before every thread has read the one before: the kernel's own barrier.)"""
    warps = build_gemv(tmp_path_factory.mktemp("host_gemv_warps"), kernel_source(TYPES), WARP_EMULATION)
    ids = np.array([[1, 0]], np.int32)
    n_expert, n_out = 2, 5
    for n_in in (layout.GEMV_STAGE_Q8 + 512, 768):
        clean = rng.standard_normal((1, n_in)).astype(np.float32)
        clean[0, 32:64] = 0.0
        with_nan = clean.copy()
        with_nan[0, 100] = np.nan
        for w_type in sorted(layout.GEMV_INT8_TYPES, key=lambda t: t.name):
            w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
            padded = with_tail(w, w_type, n_in)
            for x in (clean, with_nan):
                block = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in))
                warp = run_gemv(warps, w_type, padded, x, ids, (n_expert, n_out, n_in))
                assert warp.tobytes() == block.tobytes(), (w_type.name, n_in)
                assert np.isnan(block).all() if x is with_nan else np.isfinite(block).all()


@pytest.mark.parametrize("w_type", [_T.Q4_0, _T.Q4_K, _T.Q8_0, _T.MXFP4], ids=lambda t: t.name)
def test_dirty_padding_tail_shows(host_gemv: Path, rng: np.random.Generator, w_type: GGMLQuantizationType) -> None:
    """A tail of 0xFF bytes: NaN scales on the int8 path but MXFP4's, whose E8M0 scales are all
    finite, so its tail adds 0 against zero activations (the twin says the same)."""
    n_expert, n_out, n_in = 2, 9, 768
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.array([[0, 1]], np.int32)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    dirty = with_tail(w, w_type, n_in, 0xFF)
    y = run_gemv(host_gemv, w_type, dirty, x, ids, (n_expert, n_out, n_in))
    assert np.isfinite(y[0, 0]).all() and np.isfinite(y[0, 1, :-1]).all()
    if w_type == _T.MXFP4:
        clean = run_gemv(host_gemv, w_type, with_tail(w, w_type, n_in), x, ids, (n_expert, n_out, n_in))
        assert y.tobytes() == clean.tobytes(), "an MXFP4 tail against zero activations changed a row"
    else:
        assert np.isnan(y[0, 1, -1]), "a NaN padding tail was not read"


def test_route_weights_scale_each_row(host_gemv: Path, rng: np.random.Generator) -> None:
    w_type = _T.Q4_K
    n_expert, n_out, n_in = 3, 7, 2048
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.array([[2, 0, 1]], np.int32)
    x = rng.standard_normal((1, 3, n_in)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (1, 3)).astype(np.float32)
    padded = with_tail(w, w_type, n_in)
    y = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in), route_weights=weights)
    err = ref.relative_error(y, weights[..., None] * ref.mul_mat_vec_id(w, w_type, n_expert, n_out, n_in, x, ids))
    assert err < ref.MUL_MAT_ID_RTOL, f"relative error {err:.3g}"
    source = source_file("gemv.cu")
    assert f"#define MOE_GEMV_THREADS {layout.GEMV_THREADS}\n" in source
    assert f"#define MOE_GEMV_WAVE_ROWS {layout.GEMV_WAVE_ROWS} " in source
    assert f"#define MOE_GEMV_STAGE {layout.GEMV_STAGE} " in source
    assert f"#define MOE_GEMV_STAGE_Q8 {layout.GEMV_STAGE_Q8} " in source


@pytest.mark.parametrize(
    ("w_type", "n_in"),
    [
        (_T.Q6_K, 8448),
        (_T.F16, 4133),
        (_T.Q4_K, 8704),
        (_T.Q4_0, 8224),
        (_T.Q8_0, 8704),
        (_T.MXFP4, 8256),
        (_T.IQ2_XS, 4352),
    ],
    ids=lambda v: v.name if isinstance(v, _T) else str(v),
)
def test_rows_longer_than_the_stage_give_the_same_sums(
    host_gemv: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n_in: int
) -> None:
    """Past the stage the float activations are read from global memory, the int8 ones staged in chunks of
    MOE_GEMV_STAGE_Q8 elements: the same sums."""
    stage = layout.GEMV_STAGE_Q8 if w_type in layout.GEMV_INT8_TYPES else layout.GEMV_STAGE
    assert n_in > stage
    n_expert, n_out = 2, 5
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.array([[1, 0]], np.int32)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    y = run_gemv(host_gemv, w_type, with_tail(w, w_type, n_in), x, ids, (n_expert, n_out, n_in))
    err = ref.relative_error(y, ref.mul_mat_vec_id(w, w_type, n_expert, n_out, n_in, x, ids))
    assert err < ref.MUL_MAT_ID_RTOL, f"relative error {err:.3g}"


def test_int8_activations_are_those_of_the_listed_types(host_gemv: Path, rng: np.random.Generator) -> None:
    """gemv.cu's GemvInt8 names layout.GEMV_INT8_TYPES; a listed type's rows are the int8 products
    (off the float ones by far more than the bound), an unlisted type's the float ones."""
    listed = re.search(r"struct GemvInt8 \{\s*static const bool value = ([^;]*);", source_file("gemv.cu"))
    assert listed is not None
    assert {_T[name] for name in re.findall(r"ES_TYPE_(\w+)", listed.group(1))} == set(layout.GEMV_INT8_TYPES)
    for w_type in (_T.Q4_K, _T.Q6_K, _T.MXFP4, _T.IQ2_XS):
        n_expert, n_out, n_in = 1, 16, 1024
        w = ref.random_weights(rng, w_type, n_out, n_in)
        ids = np.zeros((1, 1), np.int32)
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        y = run_gemv(host_gemv, w_type, with_tail(w, w_type, n_in), x, ids, (n_expert, n_out, n_in))
        exact = ref.mul_mat_id(w, w_type, n_expert, n_out, n_in, x, ids)
        off = ref.relative_error(y, exact)
        assert (off > 10 * ref.MUL_MAT_ID_RTOL) == (w_type in layout.GEMV_INT8_TYPES), f"{w_type.name}: {off:.3g}"


@pytest.mark.parametrize("w_type", [_T.Q4_K, _T.Q6_K], ids=lambda t: t.name)
def test_silu_gate_is_the_bytes_of_the_launch_then_swiglu(
    host_gemv: Path, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    n_expert, n_out, n_in = 3, 13, 768
    padded = with_tail(ref.random_weights(rng, w_type, n_expert * n_out, n_in), w_type, n_in, 0)
    x = rng.standard_normal((2, n_in)).astype(np.float32)
    ids = np.array([[2, 0], [1, 2]], np.int32)
    gate = (rng.standard_normal((2, 2, n_out)) * 30).astype(np.float32)  # some below -88: silu's -0 there
    fused, expected = run_gemv(host_gemv, w_type, padded, x, ids, (n_expert, n_out, n_in), silu_gate=gate)
    assert np.isfinite(fused).all()
    assert fused.tobytes() == expected.tobytes()


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
def test_gate_up_is_the_bytes_of_gate_then_up_with_its_gate(
    host_gemv: Path, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    """gate_up_vec_id, a gate row and an up row a wave, against the two launches it replaces and the
    float64 reference; ids out of range give NaN rows; aligned or not, the same bytes."""
    fmt = FORMATS[w_type]
    n_expert, n_out, n_in = 4, 13, 768 if fmt.quantized else 200
    gate_w, up_w = (ref.random_weights(rng, w_type, n_expert * n_out, n_in) for _ in range(2))
    gate_padded, up_padded = (with_tail(w, w_type, n_in) for w in (gate_w, up_w))
    ids = np.array([[3, 0, -1], [1, 2, 3]], np.int32)
    bad = (ids < 0) | (ids >= n_expert)
    x = rng.standard_normal((2, n_in)).astype(np.float32)
    shape = (n_expert, n_out, n_in)
    fused, two_launches = run_gemv(host_gemv, w_type, gate_padded, x, ids, shape, up=up_padded)
    assert np.isnan(fused[bad]).all(), "rows of ids out of range are not NaN"
    assert np.isfinite(fused[~bad]).all(), "outputs unwritten or not finite"
    assert fused[~bad].tobytes() == two_launches[~bad].tobytes()
    g = ref.mul_mat_vec_id(gate_w, w_type, n_expert, n_out, n_in, x, ids)
    u = ref.mul_mat_vec_id(up_w, w_type, n_expert, n_out, n_in, x, ids)
    expected = g / (1.0 + np.exp(-g)) * u
    err = ref.relative_error(fused[~bad], expected[~bad])
    assert err < 2 * ref.MUL_MAT_ID_RTOL, f"relative error {err:.3g}"
    shifted, _ = run_gemv(host_gemv, w_type, gate_padded, x, ids, shape, misaligned=True, up=up_padded)
    assert shifted.tobytes() == fused.tobytes(), "misaligned inputs (narrow loads) gave other bytes"


_PARTS_DRIVER = (
    _FIBERS
    + """
typedef void (*MulMatVecId)(const unsigned char*, const float*, const int*, float*, int, int, int, int, int, int,
                            const float*, const float*);
typedef void (*MulMatVecParts)(const unsigned char*, const unsigned char*, const unsigned char*, const float*, float*,
                               float*, float*, int, int, int, int, int);

// stdin: n_parts, n_out[3], n_in, n_tokens, bytes[3] (int32), each part's padded weights, x [n_tokens, n_in].
// stdout: each part's y from one mul_mat_vec_parts launch, then from one mul_mat_vec_id launch per part.
int main(int argc, char** argv) {
    MulMatVecId kernels[] = {%s};
    MulMatVecParts parts_kernels[] = {%s};
    const int kernel = atoi(argv[1]);
    std::vector<int> head = read_array<int>(9);
    const int n_parts = head[0], n_in = head[4], n_tokens = head[5];
    int n_out[3] = {head[1], head[2], head[3]};
    std::vector<std::vector<unsigned char>> w(3);
    for (int p = 0; p < 3; ++p) {
        w[p] = read_array<unsigned char>(head[6 + p]);
    }
    std::vector<float> x = read_array<float>((size_t)n_tokens * n_in);
    std::vector<int> zeros(n_tokens, 0);
    std::vector<std::vector<float>> y(3);
    int max_out = 0;
    for (int p = 0; p < 3; ++p) {
        y[p].assign((size_t)n_tokens * n_out[p], NAN);
        max_out = n_out[p] > max_out ? n_out[p] : max_out;
    }
    const unsigned grid_x = (max_out + MOE_GEMV_ROWS - 1) / MOE_GEMV_ROWS;
    gridDim = EsDim3{grid_x, (unsigned)(n_parts * n_tokens), 1};
    blockDim = EsDim3{MOE_GEMV_THREADS, 1, 1};
    for (unsigned by = 0; by < gridDim.y; ++by) {
        for (unsigned bx = 0; bx < grid_x; ++bx) {
            blockIdx = EsDim3{bx, by, 0};
            run_block(MOE_GEMV_THREADS, [&] {
                parts_kernels[kernel](w[0].data(), w[1].data(), w[2].data(), x.data(), y[0].data(), y[1].data(),
                                      y[2].data(), n_out[0], n_out[1], n_out[2], n_in, n_tokens);
            });
        }
    }
    for (int p = 0; p < n_parts; ++p) {
        fwrite(y[p].data(), sizeof(float), y[p].size(), stdout);
    }
    for (int p = 0; p < n_parts; ++p) {
        std::vector<float> alone((size_t)n_tokens * n_out[p], NAN);
        const unsigned grid_p = (n_out[p] + MOE_GEMV_ROWS - 1) / MOE_GEMV_ROWS;
        gridDim = EsDim3{grid_p, (unsigned)n_tokens, 1};
        for (unsigned by = 0; by < (unsigned)n_tokens; ++by) {
            for (unsigned bx = 0; bx < grid_p; ++bx) {
                blockIdx = EsDim3{bx, by, 0};
                run_block(MOE_GEMV_THREADS, [&] {
                    kernels[kernel](w[p].data(), x.data(), zeros.data(), alone.data(), 1, n_out[p], n_in, 1, 0,
                                    n_tokens, nullptr, nullptr);
                });
            }
        }
        fwrite(alone.data(), sizeof(float), alone.size(), stdout);
    }
    return 0;
}
"""
)


@pytest.fixture(scope="module")
def host_gemv_parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    names = ", ".join(FORMATS[t].gemv_kernel_name for t in TYPES)
    parts_names = ", ".join(FORMATS[t].gemv_parts_kernel_name for t in TYPES)
    source = kernel_source(TYPES)
    return build_on_host(tmp_path_factory.mktemp("host_gemv_parts"), source, _PARTS_DRIVER % (names, parts_names))


@pytest.mark.parametrize("w_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_parts", [2, 3])
def test_parts_are_the_bytes_of_one_launch_each(
    host_gemv_parts: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n_parts: int
) -> None:
    """mul_mat_vec_parts, Q, K and V of decode in one launch: each part's rows (of other lengths than
    the others', the last reading its padding tail) are the bytes of that projection's own launch,
    and near the float64 reference."""
    fmt = FORMATS[w_type]
    n_in, n_tokens = (768 if fmt.quantized else 200), 2
    n_outs = [21, 8, 13][:n_parts] + [0] * (3 - n_parts)
    ws = [ref.random_weights(rng, w_type, n_out, n_in) if n_out else None for n_out in n_outs]
    padded = [with_tail(w, w_type, n_in).tobytes() if w is not None else b"" for w in ws]
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    header = struct.pack("9i", n_parts, *n_outs, n_in, n_tokens, *(len(b) for b in padded))
    run = subprocess.run(
        [str(host_gemv_parts), str(TYPES.index(w_type))],
        input=header + b"".join(padded) + x.tobytes(),
        capture_output=True,
        check=True,
    )
    out = np.frombuffer(run.stdout, np.float32)
    sizes = [n_tokens * n for n in n_outs[:n_parts]]
    fused = np.split(out[: sum(sizes)], np.cumsum(sizes)[:-1])
    alone = np.split(out[sum(sizes) :], np.cumsum(sizes)[:-1])
    zeros = np.zeros((n_tokens, 1), np.int32)
    for p in range(n_parts):
        assert np.isfinite(fused[p]).all(), f"part {p}: outputs unwritten or not finite"
        assert fused[p].tobytes() == alone[p].tobytes(), f"part {p}: other bytes than its own launch"
        expected = ref.mul_mat_vec_id(ws[p], w_type, 1, n_outs[p], n_in, x, zeros).reshape(-1)
        assert ref.relative_error(fused[p], expected) < ref.MUL_MAT_ID_RTOL
