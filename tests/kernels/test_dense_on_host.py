"""dense.cu's kernels themselves, compiled for this host and run block by block with test_kernels_on_host's
fiber runner, against the float64 references: the CUDA-C the GPUs run, checked where no GPU is.

The driver gives every launch a grid of at most 3 rows of blocks, so the kernels' loops over the rows
past gridDim.y run too.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.kernels import dense, kernel_source, layout
from expertstream.kernels import reference as ref
from expertstream.kernels import reference_dense as ref_dense
from expertstream.kernels.dense import Rope
from expertstream.kernels.layout import FORMATS
from expertstream.kernels.program import source_file

from .test_dense import F16_EDGES
from .test_kernels_on_host import _FIBERS, CXX, compile_on_host, shared_code, with_tail

TYPES = list(FORMATS)

_DRIVER = (
    _FIBERS
    + """
typedef void (*GetRows)(const unsigned char*, const int*, float*, int, int, int);
typedef void (*MulMatVecId)(const unsigned char*, const float*, const int*, float*, int, int, int, int, int, int,
                            const float*, const float*);
typedef void (*AddNorm)(const unsigned char*, const float*, float*, float*, const float*, float*, unsigned*, int, int,
                        float);
typedef void (*CombineNorm)(const unsigned char*, const float*, const int*, float*, const float*, const float*,
                            const float*, float*, const float*, float*, unsigned*, int, int, int, int, float);

static void launch(unsigned grid_x, unsigned rows, unsigned threads, const std::function<void()>& body) {
    const unsigned grid_y = std::min(rows, 3u);
    gridDim = EsDim3{grid_x, grid_y, 1};
    blockDim = EsDim3{threads, 1, 1};
    for (unsigned by = 0; by < grid_y; ++by) {
        for (unsigned bx = 0; bx < grid_x; ++bx) {
            blockIdx = EsDim3{bx, by, 0};
            run_block(threads, body);
        }
    }
}

// Every block of a matrix-vector grid (grid_x, grid_y) of MOE_GEMV_THREADS threads, in order or the last
// block first (reversed); after(by) after each.
static void gemv_grid(unsigned grid_x, unsigned grid_y, bool reversed, const std::function<void()>& body,
                      const std::function<void(unsigned)>& after = [](unsigned) {}) {
    gridDim = EsDim3{grid_x, grid_y, 1};
    blockDim = EsDim3{MOE_GEMV_THREADS, 1, 1};
    for (unsigned i = 0; i < grid_x * grid_y; ++i) {
        const unsigned at = reversed ? grid_x * grid_y - 1 - i : i;
        blockIdx = EsDim3{at %% grid_x, at / grid_x, 0};
        run_block(MOE_GEMV_THREADS, body);
        after(at / grid_x);
    }
}

// A fused kernel that finishes in each token's last block, run twice with the same counters (one per
// token, rows_per_token rows of blocks each), its blocks in reverse order: y and out set to NaN and hidden
// to start before each launch, the `written` vectors written after it; then each token's counter after
// every block of the first launch.
static void fused_twice(unsigned grid_x, unsigned n_tokens, unsigned rows_per_token, std::vector<float>& y,
                        std::vector<float>& hidden, const std::vector<float>& start, std::vector<float>& out,
                        const std::vector<const std::vector<float>*>& written,
                        const std::function<void(unsigned*)>& body) {
    std::vector<unsigned> counters(n_tokens, 0);
    std::vector<int> counts;
    for (int pass = 0; pass < 2; ++pass) {
        std::fill(y.begin(), y.end(), NAN);
        std::fill(out.begin(), out.end(), NAN);
        hidden = start;
        gemv_grid(
            grid_x, n_tokens * rows_per_token, true, [&] { body(counters.data()); },
            [&](unsigned by) {
                if (pass == 0) counts.push_back((int)counters[by / rows_per_token]);
            });
        for (const std::vector<float>* v : written) {
            fwrite(v->data(), sizeof(float), v->size(), stdout);
        }
    }
    fwrite(counts.data(), sizeof(int), counts.size(), stdout);
}

int main(int argc, char** argv) {
    const std::string kernel = argv[1];
    if (kernel == "get_rows") {
        GetRows get_rows[] = {%s};
        std::vector<int> shape = read_array<int>(4);
        const int n_cols = shape[0], n_table_rows = shape[1], n_ids = shape[2];
        std::vector<unsigned char> table = read_array<unsigned char>(shape[3]);
        std::vector<int> ids = read_array<int>(n_ids);
        std::vector<float> out((size_t)n_ids * n_cols);
        launch((n_cols + GET_ROWS_CHUNK - 1) / GET_ROWS_CHUNK, n_ids, GET_ROWS_THREADS, [&] {
            get_rows[atoi(argv[2])](table.data(), ids.data(), out.data(), n_cols, n_table_rows, n_ids);
        });
        fwrite(out.data(), sizeof(float), out.size(), stdout);
    } else if (kernel == "rms_norm") {
        std::vector<int> shape = read_array<int>(4);
        const int n_rows = shape[0], n = shape[1], has_weight = shape[2], threads = shape[3];
        const float eps = read_array<float>(1)[0];
        std::vector<float> x = read_array<float>((size_t)n_rows * n);
        std::vector<float> weight = read_array<float>(has_weight ? n : 0);
        gridDim = EsDim3{(unsigned)n_rows, 1, 1};
        blockDim = EsDim3{(unsigned)threads, 1, 1};
        for (unsigned b = 0; b < (unsigned)n_rows; ++b) {  // in place, as the engine runs it
            blockIdx = EsDim3{b, 0, 0};
            run_block(threads, [&] {
                dense_rms_norm(x.data(), has_weight ? weight.data() : nullptr, x.data(), n_rows, n, eps);
            });
        }
        fwrite(x.data(), sizeof(float), x.size(), stdout);
    } else if (kernel == "add_rms_norm") {
        std::vector<int> shape = read_array<int>(4);
        const int n_rows = shape[0], n = shape[1], has_weight = shape[2], threads = shape[3];
        const float eps = read_array<float>(1)[0];
        std::vector<float> hidden = read_array<float>((size_t)n_rows * n);
        std::vector<float> delta = read_array<float>((size_t)n_rows * n);
        std::vector<float> weight = read_array<float>(has_weight ? n : 0);
        std::vector<float> out((size_t)n_rows * n);
        gridDim = EsDim3{(unsigned)n_rows, 1, 1};
        blockDim = EsDim3{(unsigned)threads, 1, 1};
        for (unsigned b = 0; b < (unsigned)n_rows; ++b) {
            blockIdx = EsDim3{b, 0, 0};
            run_block(threads, [&] {
                dense_add_rms_norm(hidden.data(), delta.data(), has_weight ? weight.data() : nullptr, out.data(),
                                   n_rows, n, eps);
            });
        }
        fwrite(hidden.data(), sizeof(float), hidden.size(), stdout);
        fwrite(out.data(), sizeof(float), out.size(), stdout);
    } else if (kernel == "project_add_norm") {
        // argv[2]: the type's index. The projection (mul_mat_vec_id of expert 0) then dense_add_rms_norm,
        // then the fused kernel, its blocks in reverse order, twice: each's hidden and out, and the
        // counters after each block of the first fused launch.
        MulMatVecId gemv[] = {%s};
        AddNorm fused[] = {%s};
        const int type = atoi(argv[2]);
        std::vector<int> shape = read_array<int>(4);
        const int n_tokens = shape[0], n = shape[1], n_in = shape[2], threads = shape[3];
        const float eps = read_array<float>(1)[0];
        std::vector<unsigned char> w = read_array<unsigned char>(read_array<int>(1)[0]);
        std::vector<float> x = read_array<float>((size_t)n_tokens * n_in);
        std::vector<float> start = read_array<float>((size_t)n_tokens * n);
        std::vector<float> norm = read_array<float>(n);
        std::vector<int> zeros(n_tokens, 0);
        std::vector<float> y((size_t)n_tokens * n, NAN), hidden = start, out((size_t)n_tokens * n, NAN);
        const unsigned grid_x = (n + MOE_GEMV_ROWS - 1) / MOE_GEMV_ROWS;
        gemv_grid(grid_x, n_tokens, false, [&] {  // every token's row: launch() strides over three
            gemv[type](w.data(), x.data(), zeros.data(), y.data(), 1, n, n_in, 1, 0, n_tokens, nullptr, nullptr);
        });
        launch(n_tokens, 1, threads, [&] {
            dense_add_rms_norm(hidden.data(), y.data(), norm.data(), out.data(), n_tokens, n, eps);
        });
        fwrite(hidden.data(), sizeof(float), hidden.size(), stdout);
        fwrite(out.data(), sizeof(float), out.size(), stdout);
        fused_twice(grid_x, n_tokens, 1, y, hidden, start, out, {&hidden, &out}, [&](unsigned* counters) {
            fused[type](w.data(), x.data(), y.data(), hidden.data(), norm.data(), out.data(), counters, n, n_in, eps);
        });
    } else if (kernel == "down_combine_norm") {
        // argv[2]: the type's index. The down projection (mul_mat_vec_id, rows scaled) then
        // dense_combine_rms_norm (with the shared rows), then the fused kernel, its blocks in reverse
        // order, twice: each's y, hidden and out, and the counters after each block of the first fused launch.
        MulMatVecId gemv[] = {%s};
        CombineNorm fused[] = {%s};
        const int type = atoi(argv[2]);
        std::vector<int> shape = read_array<int>(6);
        const int n_tokens = shape[0], top_k = shape[1], n_expert = shape[2], n = shape[3], n_in = shape[4];
        const int threads = shape[5];
        const float eps = read_array<float>(1)[0];
        const int n_pairs = n_tokens * top_k;
        std::vector<unsigned char> w = read_array<unsigned char>(read_array<int>(1)[0]);
        std::vector<float> act = read_array<float>((size_t)n_pairs * n_in);
        std::vector<int> ids = read_array<int>(n_pairs);
        std::vector<float> route = read_array<float>(n_pairs);
        std::vector<float> extra = read_array<float>((size_t)n_tokens * n);
        std::vector<float> start = read_array<float>((size_t)n_tokens * n);
        std::vector<float> norm = read_array<float>(n);
        std::vector<float> y((size_t)n_pairs * n, NAN), hidden = start, out((size_t)n_tokens * n, NAN);
        const unsigned grid_x = (n + MOE_GEMV_ROWS - 1) / MOE_GEMV_ROWS;
        gemv_grid(grid_x, n_pairs, false, [&] {
            gemv[type](w.data(), act.data(), ids.data(), y.data(), n_expert, n, n_in, top_k, 1, n_pairs, route.data(),
                       nullptr);
        });
        launch(n_tokens, 1, threads, [&] {
            dense_combine_rms_norm(y.data(), nullptr, extra.data(), hidden.data(), norm.data(), out.data(), n_tokens,
                                   top_k, n, eps);
        });
        for (const std::vector<float>* v : {&y, &hidden, &out}) {
            fwrite(v->data(), sizeof(float), v->size(), stdout);
        }
        fused_twice(grid_x, n_tokens, top_k, y, hidden, start, out, {&y, &hidden, &out}, [&](unsigned* counters) {
            fused[type](w.data(), act.data(), ids.data(), y.data(), route.data(), nullptr, extra.data(), hidden.data(),
                        norm.data(), out.data(), counters, n_expert, n, n_in, top_k, eps);
        });
    } else if (kernel == "combine_rms_norm") {
        // moe_combine then dense_rms_norm (into out), then dense_combine_rms_norm on a copy of hidden:
        // both hiddens and both outs.
        std::vector<int> shape = read_array<int>(6);
        const int n_tokens = shape[0], top_k = shape[1], n = shape[2], has_weights = shape[3], has_extra = shape[4];
        const int threads = shape[5];
        const float eps = read_array<float>(1)[0];
        std::vector<float> y = read_array<float>((size_t)n_tokens * top_k * n);
        std::vector<float> weights = read_array<float>(has_weights ? n_tokens * top_k : 0);
        std::vector<float> extra = read_array<float>(has_extra ? (size_t)n_tokens * n : 0);
        std::vector<float> hidden = read_array<float>((size_t)n_tokens * n);
        std::vector<float> norm = read_array<float>(n);
        std::vector<float> fused_hidden = hidden, out((size_t)n_tokens * n, NAN), fused_out(out);
        const float* w = has_weights ? weights.data() : nullptr;
        const float* e = has_extra ? extra.data() : nullptr;
        launch((n + 255) / 256, n_tokens, 256, [&] { moe_combine(y.data(), w, e, hidden.data(), n_tokens, top_k, n); });
        launch(n_tokens, 1, threads, [&] { dense_rms_norm(hidden.data(), norm.data(), out.data(), n_tokens, n, eps); });
        launch(n_tokens, 1, threads, [&] {
            dense_combine_rms_norm(y.data(), w, e, fused_hidden.data(), norm.data(), fused_out.data(), n_tokens, top_k,
                                   n, eps);
        });
        for (const std::vector<float>* v : {&hidden, &out, &fused_hidden, &fused_out}) {
            fwrite(v->data(), sizeof(float), v->size(), stdout);
        }
    } else if (kernel == "rope") {
        std::vector<int> shape = read_array<int>(5);
        const int n_tokens = shape[0], n_heads = shape[1], head_dim = shape[2], n_rot = shape[3];
        std::vector<float> f = read_array<float>(6);
        std::vector<int> positions = read_array<int>(n_tokens);
        std::vector<float> x = read_array<float>((size_t)n_tokens * n_heads * head_dim);
        launch((n_heads * (n_rot / 2) + DENSE_THREADS - 1) / DENSE_THREADS, n_tokens, DENSE_THREADS, [&] {
            dense_rope(x.data(), positions.data(), n_tokens, n_heads, head_dim, n_rot, shape[4], f[0], f[1], f[2],
                       f[3], f[4], f[5]);
        });
        fwrite(x.data(), sizeof(float), x.size(), stdout);
    } else if (kernel == "store") {
        std::vector<int> shape = read_array<int>(3);
        const int n_tokens = shape[0], width = shape[1], n_cache_rows = shape[2];
        std::vector<float> src = read_array<float>((size_t)n_tokens * width);
        std::vector<int> positions = read_array<int>(n_tokens);
        std::vector<unsigned short> cache = read_array<unsigned short>((size_t)n_cache_rows * width);
        launch((width + DENSE_THREADS - 1) / DENSE_THREADS, n_tokens, DENSE_THREADS, [&] {
            dense_store_rows_f16(src.data(), cache.data(), positions.data(), n_tokens, width, n_cache_rows);
        });
        fwrite(cache.data(), sizeof(unsigned short), cache.size(), stdout);
    } else if (kernel == "qkv") {
        std::vector<int> shape = read_array<int>(10);
        const int n_tokens = shape[0], n_head = shape[1], n_head_kv = shape[2], head_dim = shape[3];
        const int n_cache_rows = shape[4], n_rot = shape[5], neox = shape[6], threads = shape[9];
        std::vector<float> f = read_array<float>(7);
        std::vector<int> positions = read_array<int>(n_tokens);
        std::vector<float> q = read_array<float>((size_t)n_tokens * n_head * head_dim);
        std::vector<float> k = read_array<float>((size_t)n_tokens * n_head_kv * head_dim);
        std::vector<float> v = read_array<float>((size_t)n_tokens * n_head_kv * head_dim);
        std::vector<float> q_norm = read_array<float>(shape[7] ? head_dim : 0);
        std::vector<float> k_norm = read_array<float>(shape[8] ? head_dim : 0);
        const size_t cache_count = (size_t)n_cache_rows * n_head_kv * head_dim;
        std::vector<unsigned short> k_cache = read_array<unsigned short>(cache_count);
        std::vector<unsigned short> v_cache = read_array<unsigned short>(cache_count);
        launch(n_head + 2 * n_head_kv, n_tokens, threads, [&] {
            dense_qkv_rope_store(q.data(), k.data(), v.data(), shape[7] ? q_norm.data() : nullptr,
                                 shape[8] ? k_norm.data() : nullptr, k_cache.data(), v_cache.data(), positions.data(),
                                 n_tokens, n_head, n_head_kv, head_dim, n_cache_rows, f[0], n_rot, neox, f[1], f[2],
                                 f[3], f[4], f[5], f[6]);
        });
        fwrite(q.data(), sizeof(float), q.size(), stdout);
        fwrite(k_cache.data(), sizeof(unsigned short), k_cache.size(), stdout);
        fwrite(v_cache.data(), sizeof(unsigned short), v_cache.size(), stdout);
    }
    return 0;
}
"""
)


@pytest.fixture(scope="module")
def host_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    instances = "".join(
        f"DENSE_GET_ROWS({f.get_rows_kernel_name}, {int(t)})\n"
        f"MOE_MUL_MAT_VEC_ID({f.gemv_kernel_name}, {int(t)})\n"
        f"DENSE_MUL_MAT_VEC_ADD_NORM({f.gemv_add_norm_kernel_name}, {int(t)})\n"
        f"DENSE_MUL_MAT_VEC_COMBINE_NORM({f.gemv_combine_norm_kernel_name}, {int(t)})\n"
        for t, f in ((t, FORMATS[t]) for t in TYPES)
    )
    names = (
        ", ".join(FORMATS[t].get_rows_kernel_name for t in TYPES),
        ", ".join(FORMATS[t].gemv_kernel_name for t in TYPES),
        ", ".join(FORMATS[t].gemv_add_norm_kernel_name for t in TYPES),
        ", ".join(FORMATS[t].gemv_kernel_name for t in TYPES),
        ", ".join(FORMATS[t].gemv_combine_norm_kernel_name for t in TYPES),
    )
    elementwise = source_file("elementwise.cu")
    combine = elementwise[elementwise.index("// moe_combine: ") :]  # after the kernels of dynamic shared memory
    code = shared_code(kernel_source(())) + combine + source_file("dense.cu") + instances + _DRIVER % names
    return compile_on_host(tmp_path_factory.mktemp("dense"), "dense", code)


def _run(binary: Path, args: list[str], *parts: bytes) -> bytes:
    return subprocess.run([str(binary), *args], input=b"".join(parts), capture_output=True, check=True).stdout


@pytest.mark.parametrize("table_type", TYPES, ids=lambda t: t.name)
def test_get_rows(host_dense: Path, rng: np.random.Generator, table_type: GGMLQuantizationType) -> None:
    n_table_rows, n_cols = 4, 4352 if FORMATS[table_type].quantized else 4133  # a whole chunk and a partial one
    table = ref.random_weights(rng, table_type, n_table_rows, n_cols)
    ids = np.array([2, -1, 0, 3, 4, 2], np.int32)
    header = struct.pack("4i", n_cols, n_table_rows, ids.size, table.nbytes)
    out = _run(host_dense, ["get_rows", str(TYPES.index(table_type))], header, table.tobytes(), ids.tobytes())
    got = np.frombuffer(out, np.float32).reshape(ids.size, n_cols)
    expected = ref_dense.get_rows(table, table_type, n_cols, n_table_rows, ids)
    bad = (ids < 0) | (ids >= n_table_rows)
    assert np.isnan(got[bad]).all()
    err = ref.relative_error(got[~bad], expected[~bad])
    assert err < ref_dense.GET_ROWS_RTOL, f"relative error {err:.3g}"


@pytest.mark.parametrize(("n", "threads"), [(4096, 256), (128, 128), (45, 64), (1, 32)])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_in_place(host_dense: Path, rng: np.random.Generator, n: int, threads: int, with_weight: bool) -> None:
    n_rows, eps = 3, 1e-5
    x = (rng.standard_normal((n_rows, n)) * 10.0 ** rng.integers(-3, 4, (n_rows, 1))).astype(np.float32)
    weight = rng.standard_normal(n).astype(np.float32) if with_weight else np.zeros(0, np.float32)
    header = struct.pack("4if", n_rows, n, int(with_weight), threads, eps)
    out = _run(host_dense, ["rms_norm"], header, x.tobytes(), weight.tobytes())
    expected = ref_dense.rms_norm(x, weight if with_weight else None, eps)
    err = ref.relative_error(np.frombuffer(out, np.float32).reshape(n_rows, n), expected)
    assert err < ref_dense.RMS_NORM_RTOL, f"relative error {err:.3g}"


@pytest.mark.parametrize("n", [2048, 300, 45])
def test_rms_norm_bytes_do_not_depend_on_the_block(host_dense: Path, rng: np.random.Generator, n: int) -> None:
    """The sum's lanes are norm_threads(n) whatever the block: fewer threads play several lanes, more
    threads leave the extra ones out of the sum. norm_block(n), the launchers' block, is one of them."""
    n_rows, eps = 2, 1e-6
    x = (rng.standard_normal((n_rows, n)) * 3).astype(np.float32)
    weight = rng.standard_normal(n).astype(np.float32)
    blocks = sorted({32, dense.norm_threads(n), dense.norm_block(n), dense.NORM_BLOCK_THREADS})
    outs = {
        threads: _run(host_dense, ["rms_norm"], struct.pack("4if", n_rows, n, 1, threads, eps), x.tobytes(),
                      weight.tobytes())
        for threads in blocks
    }  # fmt: skip
    assert len(set(outs.values())) == 1, f"the bytes differ between blocks of {blocks} threads"
    # and they are the norm: a sum in another order (numpy's) lands within rounding
    err = ref.relative_error(np.frombuffer(outs[blocks[0]], np.float32).reshape(n_rows, n),
                             ref_dense.rms_norm(x, weight, eps))  # fmt: skip
    assert err < ref_dense.RMS_NORM_RTOL


@pytest.mark.parametrize(("n", "threads"), [(2048, 1024), (4096, 256), (45, 64)])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_add_rms_norm_is_the_bytes_of_the_add_then_the_norm(
    host_dense: Path, rng: np.random.Generator, n: int, threads: int, with_weight: bool
) -> None:
    n_rows, eps = 3, 1e-6
    hidden = (rng.standard_normal((n_rows, n)) * 10.0 ** rng.integers(-2, 3, (n_rows, 1))).astype(np.float32)
    delta = rng.standard_normal((n_rows, n)).astype(np.float32)
    weight = rng.standard_normal(n).astype(np.float32) if with_weight else np.zeros(0, np.float32)
    header = struct.pack("4if", n_rows, n, int(with_weight), threads, eps)
    added = hidden + delta  # moe_add_inplace's one float addition per element
    normed = _run(host_dense, ["rms_norm"], header, added.tobytes(), weight.tobytes())
    got = _run(host_dense, ["add_rms_norm"], header, hidden.tobytes(), delta.tobytes(), weight.tobytes())
    assert got[: added.nbytes] == added.tobytes(), "hidden is not hidden + delta"
    assert got[added.nbytes :] == normed, "the norm's bytes differ from rms_norm's of the sum"


@pytest.mark.parametrize(
    "w_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F16], ids=lambda t: t.name
)
@pytest.mark.parametrize(("n", "n_tokens"), [(1024, 6), (300, 3)])
def test_project_add_norm_is_the_bytes_of_the_projection_then_add_rms_norm(
    host_dense: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n: int, n_tokens: int
) -> None:
    """dense_mul_mat_vec_add_norm_*, decode's attention output, residual add and FFN norm in one launch:
    the hidden rows and norm of the matrix-vector launch then dense_add_rms_norm at its block size for n
    (256 lanes on 128 threads), whichever block finishes last, twice with the same counters."""
    n_in, eps = 512, 1e-6
    threads = dense.norm_threads(n)
    w = with_tail(ref.random_weights(rng, w_type, n, n_in), w_type, n_in)
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    # magnitudes 1e-3..1e3 element by element: the sum of squares' order shows in its last bits
    hidden = (rng.standard_normal((n_tokens, n)) * 10.0 ** rng.integers(-3, 4, (n_tokens, n))).astype(np.float32)
    norm = rng.standard_normal(n).astype(np.float32)
    header = struct.pack("4ifi", n_tokens, n, n_in, threads, eps, w.nbytes)
    out = _run(
        host_dense, ["project_add_norm", str(TYPES.index(w_type))], header, w.tobytes(), x.tobytes(),
        hidden.tobytes(), norm.tobytes(),
    )  # fmt: skip
    size = 2 * hidden.nbytes
    two_launches, first, second, counts = out[:size], out[size : 2 * size], out[2 * size : 3 * size], out[3 * size :]
    assert np.isfinite(np.frombuffer(two_launches, np.float32)).all()
    assert first == two_launches, "the fused launch wrote other bytes than the projection and add_rms_norm"
    assert second == two_launches, "a second fused launch (the counters reused) wrote other bytes"
    blocks = -(-n // layout.GEMV_ROWS)
    expected_counts = [*range(1, blocks), 0] * n_tokens
    assert list(np.frombuffer(counts, np.int32)) == expected_counts, "a block counted twice, or not the last reset"


@pytest.mark.parametrize(
    "w_type", [GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.F16], ids=lambda t: t.name
)
@pytest.mark.parametrize(("n", "n_tokens", "top_k"), [(2048, 1, 8), (300, 2, 3)])
def test_down_combine_norm_is_the_bytes_of_down_then_combine_rms_norm(
    host_dense: Path, rng: np.random.Generator, w_type: GGMLQuantizationType, n: int, n_tokens: int, top_k: int
) -> None:
    """dense_mul_mat_vec_combine_norm_*, decode's down projection, MoE combine and next norm in one launch:
    the rows, hidden rows and norm of the matrix-vector launch then dense_combine_rms_norm at its block
    size for n (norm_threads(n) lanes on 128 threads), whichever block finishes last, twice with the same
    counters; the last expert's padding tail read where it is routed to."""
    n_in, n_expert, eps = 512, 4, 1e-6
    n_pairs = n_tokens * top_k
    threads = dense.norm_threads(n)
    w = with_tail(ref.random_weights(rng, w_type, n_expert * n, n_in), w_type, n_in)
    act = rng.standard_normal((n_pairs, n_in)).astype(np.float32)
    ids = rng.permutation(np.resize(np.arange(n_expert, dtype=np.int32), n_pairs)).astype(np.int32)
    route = rng.random(n_pairs).astype(np.float32)
    extra = rng.standard_normal((n_tokens, n)).astype(np.float32)
    # magnitudes 1e-3..1e3 element by element: the sum of squares' order shows in its last bits
    hidden = (rng.standard_normal((n_tokens, n)) * 10.0 ** rng.integers(-3, 4, (n_tokens, n))).astype(np.float32)
    norm = rng.standard_normal(n).astype(np.float32)
    header = struct.pack("6ifi", n_tokens, top_k, n_expert, n, n_in, threads, eps, w.nbytes)
    arrays = (w, act, ids, route, extra, hidden, norm)
    out = _run(host_dense, ["down_combine_norm", str(TYPES.index(w_type))], header, *(a.tobytes() for a in arrays))
    size = (n_pairs + 2 * n_tokens) * n * 4
    two_launches, first, second, counts = out[:size], out[size : 2 * size], out[2 * size : 3 * size], out[3 * size :]
    assert np.isfinite(np.frombuffer(two_launches, np.float32)).all()
    assert first == two_launches, "the fused launch wrote other bytes than down and combine_rms_norm"
    assert second == two_launches, "a second fused launch (the counters reused) wrote other bytes"
    blocks = -(-n // layout.GEMV_ROWS) * top_k
    expected_counts = [*range(1, blocks), 0] * n_tokens
    assert list(np.frombuffer(counts, np.int32)) == expected_counts, "a block counted twice, or not the last reset"


@pytest.mark.parametrize(("n", "threads"), [(2048, 1024), (45, 64)])
@pytest.mark.parametrize(("weights", "extra"), [(True, False), (False, True)], ids=["weighted", "scaled+shared"])
def test_combine_rms_norm_is_the_bytes_of_the_combine_then_the_norm(
    host_dense: Path, rng: np.random.Generator, n: int, threads: int, weights: bool, extra: bool
) -> None:
    """dense_combine_rms_norm, the end of an MoE layer and the next norm in one launch (decode), leaves
    the hidden rows moe_combine leaves and writes the norm dense_rms_norm writes of them."""
    n_tokens, top_k, eps = 2, 8, 1e-6
    y = rng.standard_normal((n_tokens, top_k, n)).astype(np.float32)
    w = rng.random((n_tokens, top_k)).astype(np.float32) if weights else np.zeros(0, np.float32)
    e = rng.standard_normal((n_tokens, n)).astype(np.float32) if extra else np.zeros(0, np.float32)
    hidden = (rng.standard_normal((n_tokens, n)) * 4).astype(np.float32)
    norm = rng.standard_normal(n).astype(np.float32)
    header = struct.pack("6if", n_tokens, top_k, n, int(weights), int(extra), threads, eps)
    out = _run(host_dense, ["combine_rms_norm"], header, *(a.tobytes() for a in (y, w, e, hidden, norm)))
    size = hidden.nbytes
    two_launches, fused = out[: 2 * size], out[2 * size :]
    assert np.isfinite(np.frombuffer(fused, np.float32)).all()
    assert fused[:size] == two_launches[:size], "hidden differs from moe_combine's"
    assert fused[size:] == two_launches[size:], "the norm differs from dense_rms_norm's of the combined rows"


@pytest.mark.parametrize(
    ("params", "head_dim"),
    [
        (Rope(64, False, 10000.0), 64),
        (Rope(32, True, 1e6), 80),
        (Rope(64, True, 150000.0, 1 / 32, 1.0, 1.0, 32.0, 1.0, 4096), 64),
        (Rope(48, False, 10000.0, 0.25, 0.5, 0.9, 32.0, 1.0, 2048), 80),
    ],
    ids=["normal", "neox-partial", "yarn-gpt-oss", "yarn-normal-partial"],
)
def test_rope(host_dense: Path, rng: np.random.Generator, params: Rope, head_dim: int) -> None:
    n_tokens, n_heads = 7, 3
    positions = rng.permutation(3000)[:n_tokens].astype(np.int32)
    x = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    low, high = dense.yarn_corr_dims(params) if params.ext_factor else (0.0, 0.0)
    factors = (params.freq_base, params.freq_scale, params.ext_factor, low, high, dense.rope_mscale(params))
    header = struct.pack("5i6f", n_tokens, n_heads, head_dim, params.n_rot, int(params.neox), *factors)
    out = _run(host_dense, ["rope"], header, positions.tobytes(), x.tobytes())
    got = np.frombuffer(out, np.float32).reshape(n_tokens, n_heads, head_dim)
    rotated = slice(0, params.n_rot)
    err = ref.relative_error(got[..., rotated], ref_dense.rope(x, positions, params)[..., rotated])
    assert err < ref_dense.rope_rtol(int(positions.max())), f"relative error {err:.3g}"
    np.testing.assert_array_equal(got[..., params.n_rot :], x[..., params.n_rot :])


def test_store_rows_f16_rounds_every_float32_class(host_dense: Path, rng: np.random.Generator) -> None:
    """Float16's edges, then random bit patterns of every exponent: the kernel's rounding bit for bit."""
    n_cache_rows, width = 9, 512
    positions = np.array([4, 0, 8, 9, -3, 2], np.int32)
    src = rng.integers(0, 2**32, (positions.size, width), dtype=np.uint64).astype(np.uint32).view(np.float32)
    src[:, : len(F16_EDGES)] = F16_EDGES
    cache = rng.standard_normal((n_cache_rows, width)).astype(np.float16)
    header = struct.pack("3i", positions.size, width, n_cache_rows)
    out = _run(host_dense, ["store"], header, src.tobytes(), positions.tobytes(), cache.tobytes())
    got = np.frombuffer(out, np.float16).reshape(n_cache_rows, width)
    expected = ref_dense.store_rows_f16(cache, src, positions)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])


@pytest.mark.parametrize(
    ("params", "head_dim", "norms"),
    [
        (Rope(128, True, 1e6), 128, True),  # qwen3moe: per-head norms, NEOX
        (Rope(64, False, 10000.0), 64, False),  # mixtral's kind: normal mode, no norms
        (Rope(64, True, 150000.0, 1 / 32, 1.0, 1.0, 32.0, 1.0, 4096), 64, False),  # gpt-oss: YaRN
        (Rope(32, True, 1e6), 64, True),  # partial rotary
    ],
    ids=["qwen3", "normal", "yarn", "partial"],
)
def test_qkv_rope_store_is_the_bytes_of_norm_rope_and_store(
    host_dense: Path, rng: np.random.Generator, params: Rope, head_dim: int, norms: bool
) -> None:
    """The one-launch kernel against rms_norm, rope and store_rows_f16 run one after another."""
    n_tokens, n_head, n_head_kv, n_cache_rows, eps = 5, 4, 2, 12, 1e-6
    positions = np.array([3, 0, 11, 12, 7], np.int32)  # 12 is past the cache: nothing written
    q, k, v = (rng.standard_normal((n_tokens, h, head_dim)).astype(np.float32) for h in (n_head, n_head_kv, n_head_kv))
    q_norm, k_norm = (rng.standard_normal(head_dim).astype(np.float32) if norms else None for _ in range(2))
    caches = [rng.standard_normal((n_cache_rows, n_head_kv * head_dim)).astype(np.float16) for _ in range(2)]
    low, high = dense.yarn_corr_dims(params) if params.ext_factor else (0.0, 0.0)
    factors = (params.freq_base, params.freq_scale, params.ext_factor, low, high, dense.rope_mscale(params))
    threads = dense.norm_threads(head_dim)

    def separately(x: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        rows = x.reshape(-1, head_dim)
        if weight is not None:
            header = struct.pack("4if", len(rows), head_dim, 1, threads, eps)
            rows = np.frombuffer(_run(host_dense, ["rms_norm"], header, rows.tobytes(), weight.tobytes()), np.float32)
        header = struct.pack("5i6f", n_tokens, x.shape[1], head_dim, params.n_rot, int(params.neox), *factors)
        return np.frombuffer(_run(host_dense, ["rope"], header, positions.tobytes(), rows.tobytes()), np.float32)

    def stored(rows: np.ndarray, cache: np.ndarray) -> bytes:
        header = struct.pack("3i", n_tokens, n_head_kv * head_dim, n_cache_rows)
        return _run(host_dense, ["store"], header, rows.tobytes(), positions.tobytes(), cache.tobytes())

    expected = separately(q, q_norm).tobytes() + stored(separately(k, k_norm), caches[0]) + stored(v, caches[1])
    flags = (int(norms), int(norms), threads)
    header = struct.pack(
        "10i7f",
        n_tokens,
        n_head,
        n_head_kv,
        head_dim,
        n_cache_rows,
        params.n_rot,
        int(params.neox),
        *flags,
        eps,
        *factors,
    )
    weights = b"" if not norms else q_norm.tobytes() + k_norm.tobytes()  # type: ignore[union-attr]
    parts = (positions, q, k, v)
    got = _run(host_dense, ["qkv"], header, *(a.tobytes() for a in parts), weights, *(c.tobytes() for c in caches))
    assert got == expected
