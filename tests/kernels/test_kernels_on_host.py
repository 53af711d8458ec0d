"""The mul_mat_id kernels themselves, compiled for the host and run on CPU threads.

The grouping kernel, the SIMT kernels of simt.cu and the matrix-core kernels of mma.cu are
plain C++ once a few CUDA names are defined: each GPU thread of a block is a fiber (ucontext)
of one host thread, __syncthreads hands over to the next fiber, so a block runs in rounds
from barrier to barrier, each round in a fresh random order of its threads (a read that a
barrier does not order after its write sees the old value in some rounds), blocks one after
another; __shared__ variables are static. mma.cu takes its
generic matrix step there (fp32 FMAs over the bf16 tiles), and int8.cu its generic integer
step over the int8 tiles after the activation quantizer, so everything but the vendor's
matrix instruction runs: the raw-block staging, the decode into bf16 tiles, the double
buffering and its barriers, the padding tail and the epilogue. Results are checked against
the float64 reference within each path's tolerance, and for the same bytes across tile
heights. Skipped, with the reason, where no C++ compiler is installed.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from expertstream.ggml import padded_size
from expertstream.kernels import kernel_source, layout, quants, twins
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS, MatrixPath, TileM, weight_format

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

_PRELUDE = """
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

struct EsDim3 {
    unsigned x, y, z;
};
static EsDim3 threadIdx, blockIdx, blockDim, gridDim;
static ucontext_t scheduler;
static std::vector<ucontext_t> fibers;
static std::vector<char> finished;
static unsigned current;
static void __syncthreads() { swapcontext(&fibers[current], &scheduler); }
static int atomicAdd(int* p, int v) { int old = *p; *p += v; return old; }
static unsigned atomicInc(unsigned* p, unsigned v) { unsigned old = *p; *p = old >= v ? 0 : old + 1; return old; }
static void __threadfence() {}
using std::max;
using std::min;
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(...)
"""

# The block runner and stdin reader both host drivers share.
_FIBERS = """
static const std::function<void()>* block_body;

static void fiber_main() {
    (*block_body)();
    finished[current] = 1;
}

static std::mt19937 round_order_rng(12345);

// Every thread runs to its next barrier (or its end), then the next thread does, in a random
// order; rounds repeat until all have finished.
static void run_block(unsigned threads, const std::function<void()>& body) {
    const size_t stack_bytes = 64 * 1024;
    std::vector<char> stacks(threads * stack_bytes);
    fibers.assign(threads, ucontext_t());
    finished.assign(threads, 0);
    block_body = &body;
    for (unsigned t = 0; t < threads; ++t) {
        getcontext(&fibers[t]);
        fibers[t].uc_stack.ss_sp = stacks.data() + t * stack_bytes;
        fibers[t].uc_stack.ss_size = stack_bytes;
        fibers[t].uc_link = &scheduler;
        makecontext(&fibers[t], fiber_main, 0);
    }
    std::vector<unsigned> order(threads);
    for (unsigned t = 0; t < threads; ++t) order[t] = t;
    for (unsigned left = threads; left > 0;) {
        std::shuffle(order.begin(), order.end(), round_order_rng);
        for (unsigned t : order) {
            if (!finished[t]) {
                current = t;
                threadIdx = EsDim3{t, 0, 0};
                swapcontext(&scheduler, &fibers[t]);
                left -= finished[t];
            }
        }
    }
}

// The pairs grouped by expert into tiles of tile_m rows, as the matrix kernels read them.
static std::vector<int> grouped(std::vector<int>& ids, int n_pairs, int n_expert, int tile_m, int max_tiles) {
    const unsigned blocks = (n_pairs + MOE_GROUP_CHUNK - 1) / MOE_GROUP_CHUNK;
    std::vector<int> scratch(MOE_SCRATCH_HEADER + 3 * max_tiles + n_pairs + blocks * (n_expert + 1));
    gridDim = EsDim3{blocks, 1, 1};
    blockDim = EsDim3{MOE_GROUP_THREADS, 1, 1};
    for (unsigned b = 0; b < blocks; ++b) {
        blockIdx = EsDim3{b, 0, 0};
        run_block(MOE_GROUP_THREADS, [&] {
            moe_group_count(ids.data(), scratch.data(), n_pairs, n_expert, max_tiles);
        });
    }
    for (unsigned b = blocks; b-- > 0;) {  // in reverse: no block may depend on an earlier one having run
        blockIdx = EsDim3{b, 0, 0};
        run_block(MOE_GROUP_THREADS, [&] {
            moe_group_place(ids.data(), scratch.data(), n_pairs, n_expert, tile_m, max_tiles);
        });
    }
    return scratch;
}

template <typename T> static std::vector<T> read_array(size_t n) {
    std::vector<T> v(n);
    if (n && fread(v.data(), sizeof(T), n, stdin) != n) exit(2);
    return v;
}

"""

_DRIVER = (
    _FIBERS
    + """
typedef void (*MulMatId)(const unsigned char*, const float*, const int*, float*, int, int, int, int, int, int);
typedef void (*MulMatIdInt8)(const unsigned char*, const unsigned char*, const int*, float*, int, int, int, int, int,
                             int);

int main(int argc, char** argv) {
    const int kernel = atoi(argv[1]);
    const int tile_m = atoi(argv[2]);
    const bool int8 = atoi(argv[3]) != 0;
    std::vector<int> shape = read_array<int>(7);
    const int n_expert = shape[0], n_out = shape[1], n_in = shape[2], n_tokens = shape[3], top_k = shape[4];
    const int x_per_pair = shape[5], w_bytes = shape[6];
    const int n_pairs = n_tokens * top_k;
    std::vector<unsigned char> w = read_array<unsigned char>(w_bytes);
    std::vector<float> x = read_array<float>((size_t)(x_per_pair ? n_pairs : n_tokens) * n_in);
    std::vector<int> ids = read_array<int>(n_pairs);
    const int max_tiles = (n_pairs + tile_m - 1) / tile_m + n_expert + 1;
    std::vector<int> scratch = grouped(ids, n_pairs, n_expert, tile_m, max_tiles);
    const std::string mode = argc > 4 ? argv[4] : "";
    if (mode == "grouped") {  // the grouping scratch instead of the outputs
        fwrite(scratch.data(), sizeof(int), scratch.size(), stdout);
        return 0;
    }
    std::vector<float> y((size_t)n_pairs * n_out, NAN);
    MulMatId kernels[] = {%s};
    MulMatIdInt8 int8_kernels[] = {%s};
    // The int8 kernels read the activations as moe_quantize_x leaves them.
    const int x_rows = x_per_pair ? n_pairs : n_tokens;
    std::vector<unsigned char> xq((size_t)x_rows * int8_x_row_bytes(n_in) + 16);
    unsigned char* xq_at = xq.data() + (16 - (size_t)xq.data() %% 16) %% 16;
    if (int8) {
        const int blocks = x_rows * (n_in / MOE_QUANT_BLOCK);
        for (unsigned bx = 0; bx < (unsigned)(blocks + MOE_QUANT_THREADS - 1) / MOE_QUANT_THREADS; ++bx) {
            blockIdx = EsDim3{bx, 0, 0};
            blockDim = EsDim3{MOE_QUANT_THREADS, 1, 1};
            run_block(MOE_QUANT_THREADS, [&] { moe_quantize_x(x.data(), xq_at, x_rows, n_in); });
        }
    }
    const unsigned threads = int8 ? MOE_INT8_THREADS : MOE_MMID_THREADS;
    for (unsigned by = 0; by < (unsigned)max_tiles; ++by) {
        for (unsigned bx = 0; bx < (unsigned)(n_out + MOE_TILE_N - 1) / MOE_TILE_N; ++bx) {
            blockIdx = EsDim3{bx, by, 0};
            blockDim = EsDim3{threads, 1, 1};
            run_block(threads, [&] {
                if (int8) {
                    int8_kernels[kernel](w.data(), xq_at, scratch.data(), y.data(), n_expert, n_out, n_in, top_k,
                                         x_per_pair, max_tiles);
                } else {
                    kernels[kernel](w.data(), x.data(), scratch.data(), y.data(), n_expert, n_out, n_in, top_k,
                                    x_per_pair, max_tiles);
                }
            });
        }
    }
    if (mode == "quantized") {  // the quantized activations instead of the outputs
        fwrite(xq_at, 1, xq.size() - 16, stdout);
        return 0;
    }
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}
"""
)

KERNELS = [(fmt.qtype, path, tile) for fmt in FORMATS.values() for path in MatrixPath for tile in fmt.tiles_on(path)]
FLOAT_KERNELS = [k for k in KERNELS if k[1] is not MatrixPath.INT8]
INT8_KERNELS = [k for k in KERNELS if k[1] is MatrixPath.INT8]


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    assert layout.MMA_THREADS == layout.MMID_THREADS  # the driver launches both with one block size
    names = [
        ", ".join(FORMATS[t].kernel_name(tile, path) for t, path, tile in kinds)
        for kinds in (FLOAT_KERNELS, INT8_KERNELS)
    ]
    return build_on_host(tmp_path_factory.mktemp("host_kernels"), kernel_source(), _DRIVER % tuple(names))


# The warp functions NVIDIA's warp paths use (the router's selection, the matrix-vector kernels' activation
# amax), for fibers: a lane's value goes through a slot, with a barrier (a fiber yield) after the writes and
# another after the reads. A yield is not a count, so this is faithful where every thread of the block
# takes the same shuffles (the matrix-vector kernels' staging) or the block's other warps have left the
# selection, as they do on the router's paths without groups (and on the grouped path for one row a block).
WARP_EMULATION = """
#include <cstring>
#define ES_EMULATE_WARPS 1
#define __forceinline__ inline
static unsigned long long es_warp_slots[1024];
template <typename T> static T es_warp_read(T v, unsigned src_lane) {
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    es_warp_slots[threadIdx.x] = bits;
    __syncthreads();
    const unsigned long long got = es_warp_slots[(threadIdx.x & ~31u) + (src_lane & 31u)];
    __syncthreads();
    T out;
    memcpy(&out, &got, sizeof(T));
    return out;
}
template <typename T> static T __shfl_sync(unsigned, T v, int src) { return es_warp_read(v, (unsigned)src); }
template <typename T> static T __shfl_xor_sync(unsigned, T v, int s) {
    return es_warp_read(v, (threadIdx.x & 31u) ^ s);
}
template <typename T> static T __shfl_down_sync(unsigned, T v, int s) {
    const unsigned lane = threadIdx.x & 31u;
    return es_warp_read(v, lane + s < 32 ? lane + s : lane);
}
static unsigned __reduce_max_sync(unsigned, unsigned v) {
    for (int s = 16; s > 0; s >>= 1) {
        const unsigned other = __shfl_xor_sync(0xffffffffu, v, s);
        v = other > v ? other : v;
    }
    return v;
}
"""


def shared_code(source: str) -> str:
    """The kernel source up to simt.cu's mul_mat_id kernels: the definitions every other part uses,
    without the elementwise, routing and stand-in kernels (which use dynamic shared memory)."""
    return source[: source.index('extern "C" __global__ void moe_swiglu(')]


def compile_on_host(folder: Path, name: str, code: str) -> Path:
    """The host prelude and ``code`` compiled into the program ``folder / name``."""
    (folder / f"{name}.cpp").write_text(_PRELUDE + code)
    build = subprocess.run(
        [CXX or "c++", "-std=c++17", "-O1", "-o", str(folder / name), str(folder / f"{name}.cpp")],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return folder / name


def build_on_host(folder: Path, source: str, driver: str) -> Path:
    """Compile ``source``'s shared code, then all of mma.cu, int8.cu and direct.cu, with ``driver``,
    for this host."""
    mma_part = source[source.index("// mul_mat_id on matrix cores") :]
    return compile_on_host(folder, "kernels", shared_code(source) + mma_part + driver)


def with_tail(w: np.ndarray, w_type: GGMLQuantizationType, n_in: int, fill: int = 0) -> np.ndarray:
    """The tensor's bytes followed by its padding tail, every tail byte ``fill``."""
    padded = np.full(padded_size(w.nbytes, w_type, n_in), fill, np.uint8)
    padded[: w.nbytes] = w.reshape(-1)
    return padded


def quantize_on_host(binary: Path, x: np.ndarray) -> np.ndarray:
    """The bytes moe_quantize_x writes for float32 rows x [n_rows, n_in] (one token, top-1 Q4_0 problem)."""
    n_rows, n_in = x.shape
    w = np.zeros(padded_size(n_in // 32 * 18, GGMLQuantizationType.Q4_0, n_in), np.uint8)
    header = struct.pack("7i", 1, 1, n_in, n_rows, 1, 0, w.nbytes)
    data = header + w.tobytes() + np.ascontiguousarray(x, np.float32).tobytes() + np.zeros(n_rows, np.int32).tobytes()
    kernel = INT8_KERNELS.index((GGMLQuantizationType.Q4_0, MatrixPath.INT8, TileM.SHORT))
    run = subprocess.run(
        [str(binary), str(kernel), "32", "1", "quantized"], input=data, capture_output=True, check=True
    )
    return np.frombuffer(run.stdout, np.uint8).reshape(n_rows, -1)


def group_on_host(binary: Path, ids: np.ndarray, n_expert: int, tile_m: int) -> np.ndarray:
    """The int32 scratch the grouping kernels leave for ids [n_tokens, top_k]."""
    n_tokens, top_k = ids.shape
    n_in = 32
    header = struct.pack("7i", n_expert, 1, n_in, n_tokens, top_k, 0, 0)
    data = header + np.zeros(n_tokens * n_in, np.float32).tobytes() + ids.astype(np.int32).tobytes()
    run = subprocess.run([str(binary), "0", str(tile_m), "0", "grouped"], input=data, capture_output=True, check=True)
    return np.frombuffer(run.stdout, np.int32)


def run_on_host(
    binary: Path,
    w_type: GGMLQuantizationType,
    path: MatrixPath,
    tile: TileM,
    padded: np.ndarray,
    x: np.ndarray,
    ids: np.ndarray,
    n_expert: int,
    n_out: int,
    n_in: int,
) -> np.ndarray:
    n_tokens, top_k = ids.shape
    header = struct.pack("7i", n_expert, n_out, n_in, n_tokens, top_k, int(x.ndim == 3), padded.nbytes)
    data = header + padded.tobytes() + np.ascontiguousarray(x, np.float32).tobytes() + ids.astype(np.int32).tobytes()
    int8 = path is MatrixPath.INT8
    kernel = (INT8_KERNELS if int8 else FLOAT_KERNELS).index((w_type, path, tile))
    run = subprocess.run(
        [str(binary), str(kernel), str(int(tile)), str(int(int8))], input=data, capture_output=True, check=True
    )
    return np.frombuffer(run.stdout, np.float32).reshape(n_tokens, top_k, n_out)


@pytest.mark.parametrize(
    ("n_expert", "n_tokens", "top_k"),
    [(7, 1500, 3), (600, 700, 8)],
    ids=["7-experts", "600-experts"],  # 600: more buckets than a grouping block has threads
)
def test_grouping_over_several_blocks_cuts_each_bucket_into_tiles(
    host_kernels: Path, rng: np.random.Generator, n_expert: int, n_tokens: int, top_k: int
) -> None:
    """Pairs of three grouping blocks, ids out of range among them: the tile table cuts each bucket
    (experts ascending, then the bad ids) into tiles of tile_m pairs, and the row entries are every
    pair once, each in a tile of its own bucket."""
    tile_m = 64
    n_pairs = n_tokens * top_k
    assert layout.group_blocks(n_pairs) == 3
    ids = rng.integers(0, n_expert, (n_tokens, top_k)).astype(np.int32)
    ids[::97, 1] = -1
    ids[5::211, 2] = n_expert + 100
    scratch = group_on_host(host_kernels, ids, n_expert, tile_m)
    bucket = np.where((ids >= 0) & (ids < n_expert), ids, n_expert).ravel()
    counts = np.bincount(bucket, minlength=n_expert + 1)
    expected = []
    for e, count in enumerate(counts):
        first = counts[:e].sum()
        expected += [(e, first + begin, min(tile_m, count - begin)) for begin in range(0, count, tile_m)]
    max_tiles = layout.max_tiles(n_pairs, n_expert, tile_m)
    assert scratch[0] == len(expected)
    table = scratch[layout.SCRATCH_HEADER : layout.SCRATCH_HEADER + 3 * len(expected)].reshape(-1, 3)
    assert [tuple(t) for t in table.tolist()] == expected
    rows = scratch[layout.SCRATCH_HEADER + 3 * max_tiles :][:n_pairs]
    assert sorted(rows.tolist()) == list(range(n_pairs))
    for e, first, count in expected:
        assert (bucket[rows[first : first + count]] == e).all()


@pytest.mark.parametrize("w_type", list(FORMATS), ids=lambda t: t.name)
def test_kernels_match_reference_and_agree_across_tiles(
    host_kernels: Path, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    # n_out 150: two column blocks, the second partial; n_in not a multiple of 512 for the
    # quantized types (the padding tail is read) and of 32 for the float ones (a partial k step).
    fmt = weight_format(w_type)
    n_expert, n_out, n_in, n_tokens, top_k = 5, 150, 768 if fmt.quantized else 200, 23, 3
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    ids[4, 1] = n_expert  # an id out of range: its row is NaN
    for x_per_pair in (False, True):
        x = rng.standard_normal((n_tokens, top_k, n_in) if x_per_pair else (n_tokens, n_in)).astype(np.float32)
        expected = ref.mul_mat_id(w, w_type, n_expert, n_out, n_in, x, ids)
        bad = ids >= n_expert
        for path in MatrixPath:
            results = []
            for tile in fmt.tiles_on(path):  # none on INT8 for types without an int8 kernel
                y = run_on_host(
                    host_kernels, w_type, path, tile, with_tail(w, w_type, n_in), x, ids, n_expert, n_out, n_in
                )
                assert np.isnan(y[bad]).all(), f"{path.value} m{int(tile)}: rows of bad ids are not NaN"
                assert np.isfinite(y[~bad]).all(), f"{path.value} m{int(tile)}: outputs unwritten or not finite"
                err = ref.relative_error(y[~bad], expected[~bad])
                bound = ref.mul_mat_id_rtol(path)
                assert err < bound, f"{path.value} m{int(tile)}: relative error {err:.3g} over {bound}"
                results.append(y)
            assert all(r.tobytes() == results[0].tobytes() for r in results), f"{path.value}: tiles disagree"


@pytest.mark.parametrize("w_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
def test_dirty_padding_tail_shows_on_every_path(
    host_kernels: Path, rng: np.random.Generator, w_type: GGMLQuantizationType
) -> None:
    n_expert, n_out, n_in = 2, 20, 768
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.array([[0, 1], [1, 0]], np.int32)
    x = rng.standard_normal((2, n_in)).astype(np.float32)
    dirty = with_tail(w, w_type, n_in, 0xFF)
    for path in MatrixPath:
        y = run_on_host(host_kernels, w_type, path, TileM.SHORT, dirty, x, ids, n_expert, n_out, n_in)
        last_expert = ids == n_expert - 1
        assert np.isnan(y[last_expert][:, -1]).all(), f"{path.value}: a NaN padding tail was not read"
        assert np.isfinite(y[~last_expert]).all() and np.isfinite(y[last_expert][:, :-1]).all()


def test_activation_quantizer_writes_the_twins_bytes(host_kernels: Path, rng: np.random.Generator) -> None:
    """moe_quantize_x and quants.quantize_x agree bit for bit, including rounding ties, zero,
    NaN and infinite blocks, blocks too small for 127 / amax, and values whose product is +-127."""
    n_in = 96
    x = (rng.standard_normal((8, n_in)) * np.exp(rng.uniform(-20, 20, (8, 1)))).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 40] = np.nan
    x[3, 70] = -np.inf
    x[4, :32] = np.arange(32, dtype=np.float32) - 12.7  # amax 18.3: quotients near .5 ties
    x[5, 32:64] = np.float32(127) * np.arange(-16, 16, dtype=np.float32) / 2  # exact ties: q = k / 2 * 127 / d
    x[6, 64:] = np.float32(1e-44)  # subnormal: d rounds to 0
    x[7, :32] = np.float32(2e-38)  # 127 / amax overflows: q = 0, d = amax / 127
    expected = twins.pack_quantized_x(*quants.quantize_x(x))
    got = quantize_on_host(host_kernels, x)
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes(), np.argwhere(got != expected)[:5]
    q, d, _ = twins.unpack_quantized_x(got, n_in)
    assert np.isnan(d[2, 1]) and np.isnan(d[3, 2]) and (q[2, 1] == 0).all() and d[1, 0] == 0
    assert (q[7, 0] == 0).all() and d[7, 0] > 0 and (np.abs(q) <= 127).all()


def test_int8_q4_0_row_of_an_odd_number_of_blocks(host_kernels: Path, rng: np.random.Generator) -> None:
    """A Q4_0 row of 17 blocks ends in a k step of one block: results match and agree across tiles."""
    w_type = GGMLQuantizationType.Q4_0
    n_expert, n_out, n_in, n_tokens, top_k = 3, 40, 544, 20, 2
    w = ref.random_weights(rng, w_type, n_expert * n_out, n_in)
    ids = np.stack([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    expected = ref.mul_mat_id(w, w_type, n_expert, n_out, n_in, x, ids)
    results = [
        run_on_host(
            host_kernels, w_type, MatrixPath.INT8, tile, with_tail(w, w_type, n_in), x, ids, n_expert, n_out, n_in
        )
        for tile in FORMATS[w_type].tiles_on(MatrixPath.INT8)
    ]
    err = ref.relative_error(results[0], expected)
    assert err < ref.mul_mat_id_rtol(MatrixPath.INT8), err
    assert all(r.tobytes() == results[0].tobytes() for r in results)
