"""The attention kernels of attention.cu, compiled for the host and run on CPU threads.

The harness of test_kernels_on_host (each GPU thread a fiber, __syncthreads a hand-over, rounds
in random order, so a read no barrier orders after its write sees the old value in some rounds)
runs the SIMT prefill, the wide kernel, the matrix-core prefill's kernel on mma.cu's interface (the one AMD
runs, here with the interface's generic step: f16 products in float32 FMAs, so everything but
the matrix instruction runs: the staging of Q, K and V^T, the score and P tiles, the wave skips
and every barrier) and the split-K decode with its combine, with the partial buffers NaN before
the launch: a combine that read a chunk no block wrote would fail. Results are checked against
the float64 reference (the matrix-core prefill within the f16 tolerance, as on GPUs), with NaN
in every cache row no query sees.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from expertstream.kernels import attention, kernel_source
from expertstream.kernels.program import source_file

from .test_attention import RTOL_F16, RTOL_F32, Case, make_inputs_on_host, worst_row_error
from .test_kernels_on_host import _FIBERS, CXX, build_on_host

SIMT, MATRIX_GENERIC, DECODE, FUSED_DECODE, WIDE, WIDE_DECODE = 0, 1, 2, 3, 4, 5

_DRIVER = (
    _FIBERS
    + """
typedef void (*Prefill)(const float*, const unsigned short*, const unsigned short*, float*, const int*, const float*,
                        int, int, int, int, int, float);
typedef void (*Decode)(const float*, const unsigned short*, const unsigned short*, float*, float*, const int*, int,
                       int, int, int, int, float, int);
typedef void (*FusedDecode)(const float*, const unsigned short*, const unsigned short*, float*, float*, const int*, int,
                            int, int, int, int, float, int, const float*, float*, unsigned*);

static void launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, const std::function<void()>& body) {
    gridDim = EsDim3{gx, gy, gz};
    blockDim = EsDim3{threads, 1, 1};
    for (unsigned z = 0; z < gz; ++z) {
        for (unsigned y = 0; y < gy; ++y) {
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = EsDim3{x, y, z};
                run_block(threads, body);
            }
        }
    }
}

// argv: mode (0 SIMT prefill, 1 matrix-core prefill, 2 decode, 4 the wide kernels (256, 576), 5 their split-K
// decode and the combine, 3 fused decode:
// twice, its blocks in reverse
// order, each partial NaN before; exit 4 where a block's count is not the blocks of its group run so far
// (0 after the last), 3 where a counter is not back to 0). stdin: n_tokens, kv_len,
// n_head, n_head_kv, head_dim, window, has_sinks, scale, q, k, v, positions, sinks. stdout: out (for 3,
// each launch's).
int main(int argc, char** argv) {
    const int mode = atoi(argv[1]);
    if (mode == 6) {  // the shared memory the wide matrix-core prefill lays out (its kernels are NVIDIA's own)
        printf("%d %d\\n", AttnWideMma<256, false>::BYTES, AttnWideMma<576, true>::BYTES);
        return 0;
    }
    std::vector<int> shape = read_array<int>(7);
    const int n_tokens = shape[0], kv_len = shape[1], n_head = shape[2], n_head_kv = shape[3], head_dim = shape[4];
    const int window = shape[5], has_sinks = shape[6];
    const float scale = read_array<float>(1)[0];
    std::vector<float> q = read_array<float>((size_t)n_tokens * n_head * head_dim);
    std::vector<unsigned short> k = read_array<unsigned short>((size_t)kv_len * n_head_kv * head_dim);
    std::vector<unsigned short> v = read_array<unsigned short>((size_t)kv_len * n_head_kv * head_dim);
    std::vector<int> positions = read_array<int>(n_tokens);
    std::vector<float> sinks = read_array<float>(has_sinks ? n_head : 0);
    const float* sinks_at = has_sinks ? sinks.data() : nullptr;
    std::vector<float> out((size_t)n_tokens * n_head * head_dim, NAN);
    const int wide = head_dim == 128;
    if (mode == 4) {
        const int group = n_head / n_head_kv;
        launch((n_tokens * group + ATTN_WIDE_ROWS - 1) / ATTN_WIDE_ROWS, n_head_kv, 1, ATTN_THREADS, [&] {
            (head_dim == 576 ? attn_wide_d576 : attn_wide_d256)(q.data(), k.data(), v.data(), out.data(),
                                                                positions.data(), sinks_at, n_tokens, kv_len, n_head,
                                                                n_head_kv, window, scale);
        });
    } else if (mode < 2) {
        Prefill prefill[2][2] = {{attn_prefill_simt_d64, attn_prefill_simt_d128},
                                 {attn_prefill_mma_d64, attn_prefill_mma_d128}};
        const int rows = mode ? ATTN_MMA_ROWS : ATTN_PREFILL_ROWS;
        launch((n_tokens + rows - 1) / rows, n_head, 1, ATTN_THREADS, [&] {
            prefill[mode][wide](q.data(), k.data(), v.data(), out.data(), positions.data(), sinks_at, n_tokens,
                                kv_len, n_head, n_head_kv, window, scale);
        });
    } else if (mode == 3) {
        FusedDecode fused[2] = {attn_decode_fused_d64, attn_decode_fused_d128};
        const int n_chunks = (kv_len + ATTN_DECODE_CHUNK - 1) / ATTN_DECODE_CHUNK;
        const int group = n_head / n_head_kv;
        const unsigned gz = (n_tokens * group + ATTN_DECODE_ROWS - 1) / ATTN_DECODE_ROWS;
        std::vector<unsigned> counters(n_head_kv * gz, 0);
        for (int pass = 0; pass < 2; ++pass) {
            std::vector<float> ml((size_t)n_tokens * n_head * n_chunks * 2, NAN);
            std::vector<float> partial((size_t)n_tokens * n_head * n_chunks * head_dim, NAN);
            std::fill(out.begin(), out.end(), NAN);
            gridDim = EsDim3{(unsigned)n_chunks, (unsigned)n_head_kv, gz};
            blockDim = EsDim3{ATTN_THREADS, 1, 1};
            for (unsigned z = gz; z-- > 0;) {
                for (unsigned y = n_head_kv; y-- > 0;) {
                    for (unsigned x = n_chunks; x-- > 0;) {
                        blockIdx = EsDim3{x, y, z};
                        run_block(ATTN_THREADS, [&] {
                            fused[wide](q.data(), k.data(), v.data(), ml.data(), partial.data(), positions.data(),
                                        n_tokens, kv_len, n_head, n_head_kv, window, scale, n_chunks, sinks_at,
                                        out.data(), counters.data());
                        });
                        // each block counts itself once; only the group's last puts the count back to 0
                        if (counters[z * n_head_kv + y] != (unsigned)((n_chunks - x) % n_chunks)) exit(4);
                    }
                }
            }
            for (unsigned c : counters) {
                if (c != 0) exit(3);
            }
            if (pass == 0) fwrite(out.data(), sizeof(float), out.size(), stdout);  // the second after the branches
        }
    } else if (mode == 5) {
        const int n_chunks = (kv_len + ATTN_DECODE_CHUNK - 1) / ATTN_DECODE_CHUNK;
        const int group = n_head / n_head_kv;
        std::vector<float> ml((size_t)n_tokens * n_head * n_chunks * 2, NAN);
        std::vector<float> partial((size_t)n_tokens * n_head * n_chunks * head_dim, NAN);
        launch(n_chunks, n_head_kv, (n_tokens * group + ATTN_WIDE_ROWS - 1) / ATTN_WIDE_ROWS, ATTN_THREADS, [&] {
            (head_dim == 576 ? attn_wide_decode_d576 : attn_wide_decode_d256)(
                q.data(), k.data(), v.data(), ml.data(), partial.data(), positions.data(), n_tokens, kv_len, n_head,
                n_head_kv, window, scale, n_chunks);
        });
        launch(n_head, n_tokens, 1, std::min(head_dim * ATTN_COMBINE_STRANDS, 1024), [&] {
            attn_decode_combine(ml.data(), partial.data(), positions.data(), sinks_at, out.data(), n_tokens, kv_len,
                                n_head, window, n_chunks, head_dim);
        });
    } else {
        Decode decode[2] = {attn_decode_d64, attn_decode_d128};
        const int n_chunks = (kv_len + ATTN_DECODE_CHUNK - 1) / ATTN_DECODE_CHUNK;
        const int group = n_head / n_head_kv;
        std::vector<float> ml((size_t)n_tokens * n_head * n_chunks * 2, NAN);
        std::vector<float> partial((size_t)n_tokens * n_head * n_chunks * head_dim, NAN);
        launch(n_chunks, n_head_kv, (n_tokens * group + ATTN_DECODE_ROWS - 1) / ATTN_DECODE_ROWS, ATTN_THREADS, [&] {
            decode[wide](q.data(), k.data(), v.data(), ml.data(), partial.data(), positions.data(), n_tokens, kv_len,
                         n_head, n_head_kv, window, scale, n_chunks);
        });
        launch(n_head, n_tokens, 1, head_dim * ATTN_COMBINE_STRANDS, [&] {
            attn_decode_combine(ml.data(), partial.data(), positions.data(), sinks_at, out.data(), n_tokens, kv_len,
                                n_head, window, n_chunks, head_dim);
        });
    }
    fwrite(out.data(), sizeof(float), out.size(), stdout);
    return 0;
}
"""
)


def test_the_launcher_gives_the_wide_matrix_core_prefill_the_shared_memory_it_lays_out(
    attention_kernels: Path,
) -> None:
    run = subprocess.run([str(attention_kernels), "6"], capture_output=True, check=True, text=True)
    assert [int(n) for n in run.stdout.split()] == [attention.wide_mma_shared_bytes(d) for d in (256, 576)]


@pytest.fixture(scope="module")
def attention_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    return build_on_host(tmp_path_factory.mktemp("attention_kernels"), kernel_source(()), _DRIVER)


def run_on_host(binary: Path, mode: int, case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(the kernels' out, the float64 reference) for a fresh input of ``case``."""
    inputs = make_inputs_on_host(rng, case)
    c = case
    header = struct.pack(
        "7if", c.n_tokens, c.kv_len, c.n_head, c.n_head_kv, c.head_dim, c.window, int(c.sinks), inputs.scale
    )
    parts = [inputs.q, inputs.k[: c.kv_len], inputs.v[: c.kv_len], inputs.positions]
    if inputs.sinks is not None:
        parts.append(inputs.sinks)
    data = header + b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    run = subprocess.run([str(binary), str(mode)], input=data, capture_output=True, check=True)
    out = np.frombuffer(run.stdout, np.float32).reshape(-1, c.n_tokens, c.n_head, c.head_dim)
    return out[0] if out.shape[0] == 1 else out, inputs.reference()


@pytest.mark.parametrize(
    ("mode", "case"),
    [
        (SIMT, Case(40, 70, 4, 2, 64, window=24, sinks=True, extra_rows=30)),
        (SIMT, Case(33, 0, 2, 1, 128, extra_rows=3)),
        (MATRIX_GENERIC, Case(70, 20, 2, 2, 64, sinks=True, extra_rows=40)),
        (MATRIX_GENERIC, Case(150, 0, 4, 1, 128, window=40, extra_rows=70)),
        (MATRIX_GENERIC, Case(20, 300, 2, 1, 64, window=50, sinks=True)),
        (DECODE, Case(1, 0, 2, 2, 64)),
        (DECODE, Case(3, 600, 8, 2, 64, window=300, sinks=True, extra_rows=200)),
        (DECODE, Case(2, 270, 4, 1, 128, extra_rows=500)),
        (WIDE, Case(1, 40, 16, 1, 576, extra_rows=9)),  # deepseek2's decode: 16 heads, one shared latent key
        (WIDE, Case(21, 3, 4, 1, 576, extra_rows=30)),
        (WIDE, Case(5, 60, 4, 2, 576, window=20, sinks=True)),
        (WIDE, Case(19, 7, 16, 2, 256, extra_rows=4)),  # qwen3next's full attention
        (WIDE_DECODE, Case(1, 300, 16, 1, 576, extra_rows=40)),  # deepseek2's decode over 10 chunks
        (WIDE_DECODE, Case(3, 70, 4, 1, 576, window=50, sinks=True, extra_rows=9)),
        (WIDE_DECODE, Case(2, 100, 16, 2, 256, extra_rows=100)),
    ],
    ids=str,
)
def test_attention_kernels_match_reference(
    attention_kernels: Path, rng: np.random.Generator, mode: int, case: Case
) -> None:
    out, expected = run_on_host(attention_kernels, mode, case, rng)
    err = worst_row_error(out, expected)
    assert err < (RTOL_F16 if mode == MATRIX_GENERIC else RTOL_F32), f"worst row relative error {err:.3g}"


def test_the_launcher_gives_the_combine_its_strands() -> None:
    """attention.py launches head_dim * COMBINE_STRANDS threads per combine block, the strands attention.cu adds."""
    source = source_file("attention.cu")
    assert f"#define ATTN_COMBINE_STRANDS {attention.COMBINE_STRANDS}\n" in source
    assert f"#define ATTN_COMBINE_MAX_D {max(attention.HEAD_DIMS + attention.WIDE_DIMS)} " in source


@pytest.mark.parametrize(
    "case",
    [
        Case(1, 0, 2, 2, 64),
        Case(1, 700, 8, 2, 128, sinks=True, extra_rows=100),
        Case(3, 600, 8, 2, 64, window=300, sinks=True, extra_rows=200),
        Case(2, 270, 4, 1, 128, extra_rows=500),
        Case(5, 130, 16, 4, 64, window=70),
    ],
    ids=str,
)
def test_fused_decode_is_the_bytes_of_decode_then_combine(
    attention_kernels: Path, rng: np.random.Generator, case: Case
) -> None:
    """attn_decode_fused_d*, decode's attention in one launch (the last block of each KV head's rows
    combines them), writes the bytes of the decode launch then the combine launch, whichever block
    finishes last; a second launch with the same counters writes them again (each counter back to 0)."""
    inputs_seed = int(rng.integers(1 << 30))
    two_launches, expected = run_on_host(attention_kernels, DECODE, case, np.random.default_rng(inputs_seed))
    fused, _ = run_on_host(attention_kernels, FUSED_DECODE, case, np.random.default_rng(inputs_seed))
    assert np.isfinite(fused).all(), "outputs unwritten or not finite"
    assert fused.shape == (2, *two_launches.shape), "the fused launches wrote no two outputs"
    assert fused[0].tobytes() == two_launches.tobytes(), "the fused launch wrote other bytes than the two launches"
    assert fused[1].tobytes() == two_launches.tobytes(), "a second fused launch (the counters reused) wrote other bytes"
    assert worst_row_error(fused[0], expected) < RTOL_F32
