"""The mul_mat_id kernels themselves, compiled for the host and run on CPU threads.

The grouping kernel, the SIMT kernels of moe.cu and the matrix-core kernels of mma.cu are
plain C++ once a few CUDA names are defined: one std::thread per GPU thread, blocks one after
another, __syncthreads a std::barrier, __shared__ variables static. mma.cu takes its
generic matrix step there (fp32 FMAs over the bf16 tiles), so everything but the vendor's
matrix instruction runs: the raw-block staging, the decode into bf16 tiles, the double
buffering and its barriers, the padding tail and the epilogue. Results are checked against
the float64 reference within each path's tolerance, and for the same bytes across tile
heights. Skipped, with the reason, where no C++20 compiler is installed.
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
from expertstream.kernels import kernel_source, layout
from expertstream.kernels import reference as ref
from expertstream.kernels.layout import FORMATS, MatrixPath, TileM, weight_format

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

_PRELUDE = """
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

struct EsDim3 {
    unsigned x, y, z;
};
static thread_local EsDim3 threadIdx;
static EsDim3 blockIdx, blockDim, gridDim;
static std::barrier<>* block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
static int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
using std::min;
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(...)
"""

_DRIVER = """
typedef void (*MulMatId)(const unsigned char*, const float*, const int*, float*, int, int, int, int, int, int);

static void run_block(unsigned threads, const std::function<void()>& body) {
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([t, &body] { threadIdx = EsDim3{t, 0, 0}; body(); });
    }
    for (auto& thread : pool) thread.join();
}

template <typename T> static std::vector<T> read_array(size_t n) {
    std::vector<T> v(n);
    if (fread(v.data(), sizeof(T), n, stdin) != n) exit(2);
    return v;
}

int main(int argc, char** argv) {
    const int kernel = atoi(argv[1]);
    const int tile_m = atoi(argv[2]);
    std::vector<int> shape = read_array<int>(7);
    const int n_expert = shape[0], n_out = shape[1], n_in = shape[2], n_tokens = shape[3], top_k = shape[4];
    const int x_per_slot = shape[5], w_bytes = shape[6];
    const int n_pairs = n_tokens * top_k;
    std::vector<unsigned char> w = read_array<unsigned char>(w_bytes);
    std::vector<float> x = read_array<float>((size_t)(x_per_slot ? n_pairs : n_tokens) * n_in);
    std::vector<int> ids = read_array<int>(n_pairs);
    const int max_tiles = (n_pairs + tile_m - 1) / tile_m + n_expert + 1;
    std::vector<int> scratch(MOE_SCRATCH_HEADER + 3 * max_tiles + n_pairs);
    std::vector<float> y((size_t)n_pairs * n_out, NAN);

    blockIdx = EsDim3{0, 0, 0};
    blockDim = EsDim3{MOE_GROUP_THREADS, 1, 1};
    run_block(MOE_GROUP_THREADS, [&] {
        moe_group_by_expert(ids.data(), scratch.data(), n_pairs, n_expert, tile_m, max_tiles);
    });
    MulMatId kernels[] = {%s};
    const unsigned threads = MOE_MMID_THREADS;
    for (unsigned by = 0; by < (unsigned)max_tiles; ++by) {
        for (unsigned bx = 0; bx < (unsigned)(n_out + MOE_TILE_N - 1) / MOE_TILE_N; ++bx) {
            blockIdx = EsDim3{bx, by, 0};
            blockDim = EsDim3{threads, 1, 1};
            run_block(threads, [&] {
                kernels[kernel](w.data(), x.data(), scratch.data(), y.data(), n_expert, n_out, n_in, top_k,
                                x_per_slot, max_tiles);
            });
        }
    }
    fwrite(y.data(), sizeof(float), y.size(), stdout);
    return 0;
}
"""

KERNELS = [(fmt.qtype, path, tile) for fmt in FORMATS.values() for path in MatrixPath for tile in fmt.tiles_on(path)]


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    source = kernel_source()
    # The grouping and mul_mat_id kernels of moe.cu (not the elementwise ones, which use
    # dynamic shared memory), then all of mma.cu and its kernel instances.
    simt_part = source[: source.index('extern "C" __global__ void moe_swiglu(')]
    mma_part = source[source.index("// mul_mat_id on matrix cores") :]
    assert layout.MMA_THREADS == layout.MMID_THREADS  # the driver launches both with one block size
    names = ", ".join(FORMATS[t].kernel_name(tile, path) for t, path, tile in KERNELS)
    folder = tmp_path_factory.mktemp("host_kernels")
    (folder / "kernels.cpp").write_text(_PRELUDE + "#include <functional>\n" + simt_part + mma_part + _DRIVER % names)
    build = subprocess.run(
        [CXX, "-std=c++20", "-O1", "-pthread", "-o", str(folder / "kernels"), str(folder / "kernels.cpp")],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0 and "barrier" in build.stderr and "No such file" in build.stderr:
        pytest.skip(f"{CXX} has no C++20 <barrier>")
    assert build.returncode == 0, build.stderr[-4000:]
    return folder / "kernels"


def with_tail(w: np.ndarray, w_type: GGMLQuantizationType, n_in: int, fill: int = 0) -> np.ndarray:
    """The tensor's bytes followed by its padding tail, every tail byte ``fill``."""
    padded = np.full(padded_size(w.nbytes, w_type, n_in), fill, np.uint8)
    padded[: w.nbytes] = w.reshape(-1)
    return padded


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
    kernel = KERNELS.index((w_type, path, tile))
    run = subprocess.run([str(binary), str(kernel), str(int(tile))], input=data, capture_output=True, check=True)
    return np.frombuffer(run.stdout, np.float32).reshape(n_tokens, top_k, n_out)


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
    for x_per_slot in (False, True):
        x = rng.standard_normal((n_tokens, top_k, n_in) if x_per_slot else (n_tokens, n_in)).astype(np.float32)
        expected = ref.mul_mat_id(w, w_type, n_expert, n_out, n_in, x, ids)
        bad = ids >= n_expert
        for path in MatrixPath:
            results = []
            for tile in fmt.tiles_on(path):
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
def test_dirty_padding_tail_shows_on_both_paths(
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
