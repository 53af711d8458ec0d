"""routing.cu's router logits kernel itself, compiled for this host and run block by block with
test_kernels_on_host's fiber runner, against a float64 reference. The host takes the kernel's generic
wave sum (shared memory and barriers), the one AMD's wave64 targets take.

The kernel's summation order is fixed per (token, expert): a token's logits are the same bytes
whether it shares a block with other tokens (prefill) or runs alone (decode), whether the inputs
are 16-byte aligned (loaded 4 floats at a time) or not, and whatever order the threads ran in.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from expertstream.kernels import kernel_source, routing
from expertstream.kernels.program import source_file

from .test_kernels_on_host import _FIBERS, CXX, WARP_EMULATION, compile_on_host, shared_code
from .test_router_arch import ARCH_ROUTING

_DRIVER = (
    _FIBERS
    + """
int main() {
    std::vector<int> shape = read_array<int>(6);
    const int n_tokens = shape[0], n_embd = shape[1], n_expert = shape[2], has_bias = shape[3];
    const int x_shift = shape[4], r_shift = shape[5];
    // Placed x_shift (r_shift) floats past a 16-byte boundary.
    std::vector<float> x_storage((size_t)n_tokens * n_embd + 8), r_storage((size_t)n_expert * n_embd + 8);
    float* x = x_storage.data() + (16 - (size_t)x_storage.data() % 16) % 16 / 4 + x_shift;
    float* r = r_storage.data() + (16 - (size_t)r_storage.data() % 16) % 16 / 4 + r_shift;
    if (fread(x, sizeof(float), (size_t)n_tokens * n_embd, stdin) != (size_t)n_tokens * n_embd) exit(2);
    if (fread(r, sizeof(float), (size_t)n_expert * n_embd, stdin) != (size_t)n_expert * n_embd) exit(2);
    std::vector<float> bias = read_array<float>(n_expert);
    std::vector<float> logits((size_t)n_tokens * n_expert, NAN);
    const unsigned grid_x = (n_expert + LOGITS_EXPERTS - 1) / LOGITS_EXPERTS;
    const unsigned grid_y = (n_tokens + LOGITS_TOKENS - 1) / LOGITS_TOKENS;
    gridDim = EsDim3{grid_x, grid_y, 1};
    blockDim = EsDim3{LOGITS_THREADS, 1, 1};
    for (unsigned by = 0; by < grid_y; ++by) {
        for (unsigned bx = 0; bx < grid_x; ++bx) {
            blockIdx = EsDim3{bx, by, 0};
            run_block(LOGITS_THREADS, [&] {
                moe_router_logits(x, r, bias.data(), logits.data(), n_tokens, n_embd, n_expert, has_bias);
            });
        }
    }
    fwrite(logits.data(), sizeof(float), logits.size(), stdout);
    return 0;
}
"""
)


@pytest.fixture(scope="module")
def host_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    routing_cu = source_file("routing.cu")
    defines = routing_cu[routing_cu.index("#define GATING_SOFTMAX") : routing_cu.index("// row[k .. k + 3]")]
    kernel = routing_cu[routing_cu.index("// row[k .. k + 3]") : routing_cu.index("// Block-wide best")]
    code = shared_code(kernel_source(())) + defines + kernel + _DRIVER
    return compile_on_host(tmp_path_factory.mktemp("router"), "router", code)


def run_logits(
    binary: Path, x: np.ndarray, router: np.ndarray, bias: np.ndarray | None = None, misaligned: bool = False
) -> np.ndarray:
    (n_tokens, n_embd), n_expert = x.shape, router.shape[0]
    shift = 1 if misaligned else 0
    header = struct.pack("6i", n_tokens, n_embd, n_expert, int(bias is not None), shift, shift)
    b = np.zeros(n_expert, np.float32) if bias is None else bias
    data = header + x.astype(np.float32).tobytes() + router.astype(np.float32).tobytes() + b.tobytes()
    run = subprocess.run([str(binary)], input=data, capture_output=True, check=True)
    return np.frombuffer(run.stdout, np.float32).reshape(n_tokens, n_expert)


@pytest.mark.parametrize(("n_tokens", "n_embd", "n_expert"), [(11, 2048, 20), (3, 203, 9), (1, 64, 128)])
def test_logits_match_the_reference_the_same_bytes_every_way(
    host_logits: Path, rng: np.random.Generator, n_tokens: int, n_embd: int, n_expert: int
) -> None:
    # 11 tokens: a whole block of LOGITS_TOKENS and a partial one; 20 experts: a partial block of
    # experts; n_embd 203: not a multiple of 4, so every load is narrow and the last chunk partial.
    x = rng.standard_normal((n_tokens, n_embd)).astype(np.float32)
    router = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
    bias = rng.standard_normal(n_expert).astype(np.float32)
    logits = run_logits(host_logits, x, router, bias)
    expected = x.astype(np.float64) @ router.astype(np.float64).T + bias
    scale = np.abs(x).astype(np.float64) @ np.abs(router).astype(np.float64).T
    assert (np.abs(logits - expected) <= 1e-5 * scale + 1e-6).all()
    assert run_logits(host_logits, x, router, bias).tobytes() == logits.tobytes(), "another thread order"
    assert run_logits(host_logits, x, router, bias, misaligned=True).tobytes() == logits.tobytes(), "narrow loads"
    alone = np.concatenate([run_logits(host_logits, x[t : t + 1], router, bias) for t in range(n_tokens)])
    assert alone.tobytes() == logits.tobytes(), "a token alone (decode) got other bytes than in a block (prefill)"


def test_the_launch_shape_is_the_kernels() -> None:
    assert routing.LOGITS_EXPERTS * 32 <= 1024
    assert f"#define LOGITS_EXPERTS {routing.LOGITS_EXPERTS} " in source_file("routing.cu")
    assert f"#define LOGITS_TOKENS {routing.LOGITS_TOKENS} " in source_file("routing.cu")


_FUSED_DRIVER = (
    _FIBERS
    + """
// stdin: n_tokens, n_embd, n_expert, has_bias, top_k, gating, has_sel_bias, n_group, n_group_used, norm (int32),
// scale (float32), x, router, bias, sel_bias. stdout: logits, ids, weights of the two launches, then of the
// fused launch (its blocks in reverse order) twice, then the counter after each block of both.
int main() {
    std::vector<int> h = read_array<int>(10);
    const int n_tokens = h[0], n_embd = h[1], n_expert = h[2], has_bias = h[3], top_k = h[4], gating = h[5];
    const int has_sel_bias = h[6], n_group = h[7], n_group_used = h[8], norm = h[9];
    const float scale = read_array<float>(1)[0];
    std::vector<float> x = read_array<float>((size_t)n_tokens * n_embd);
    std::vector<float> r = read_array<float>((size_t)n_expert * n_embd);
    std::vector<float> bias = read_array<float>(n_expert);
    std::vector<float> sel_bias = read_array<float>(n_expert);
    std::vector<float> logits((size_t)n_tokens * n_expert, NAN), weights((size_t)n_tokens * top_k, NAN);
    std::vector<int> ids((size_t)n_tokens * top_k, -7);
    auto out = [&] {
        fwrite(logits.data(), sizeof(float), logits.size(), stdout);
        fwrite(ids.data(), sizeof(int), ids.size(), stdout);
        fwrite(weights.data(), sizeof(float), weights.size(), stdout);
        std::fill(logits.begin(), logits.end(), NAN);
        std::fill(weights.begin(), weights.end(), NAN);
        std::fill(ids.begin(), ids.end(), -7);
    };
    const unsigned grid_x = (n_expert + LOGITS_EXPERTS - 1) / LOGITS_EXPERTS;
    gridDim = EsDim3{grid_x, 1, 1};
    blockDim = EsDim3{LOGITS_THREADS, 1, 1};
    for (unsigned bx = 0; bx < grid_x; ++bx) {
        blockIdx = EsDim3{bx, 0, 0};
        run_block(LOGITS_THREADS, [&] {
            moe_router_logits(x.data(), r.data(), bias.data(), logits.data(), n_tokens, n_embd, n_expert, has_bias);
        });
    }
    gridDim = EsDim3{(unsigned)n_tokens, 1, 1};
    blockDim = EsDim3{SELECT_THREADS, 1, 1};
    for (unsigned bx = 0; bx < (unsigned)n_tokens; ++bx) {
        blockIdx = EsDim3{bx, 0, 0};
        run_block(SELECT_THREADS, [&] {
            moe_router_select(logits.data(), sel_bias.data(), ids.data(), weights.data(), n_tokens, n_expert, top_k,
                              gating, has_sel_bias, n_group, n_group_used, norm, scale);
        });
    }
    out();
    unsigned counter = 0;
    std::vector<int> counts;
    for (int launch = 0; launch < 2; ++launch) {
        gridDim = EsDim3{grid_x, 1, 1};
        blockDim = EsDim3{LOGITS_THREADS, 1, 1};
        for (unsigned bx = grid_x; bx-- > 0;) {
            blockIdx = EsDim3{bx, 0, 0};
            run_block(LOGITS_THREADS, [&] {
                moe_router_logits_select(x.data(), r.data(), bias.data(), logits.data(), &counter, sel_bias.data(),
                                         ids.data(), weights.data(), n_tokens, n_embd, n_expert, has_bias, top_k,
                                         gating, has_sel_bias, n_group, n_group_used, norm, scale);
            });
            counts.push_back((int)counter);
        }
        out();
    }
    fwrite(counts.data(), sizeof(int), counts.size(), stdout);
    return 0;
}
"""
)


def _fused_router_code() -> str:
    """The shared code, the router's kernels (routing.cu before the FFN pieces) and _FUSED_DRIVER."""
    routing_cu = source_file("routing.cu")
    return shared_code(kernel_source(())) + routing_cu[: routing_cu.index("// gpt-oss's SwiGLU")] + _FUSED_DRIVER


@pytest.fixture(scope="module")
def host_fused_router(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH")
    return compile_on_host(tmp_path_factory.mktemp("fused_router"), "fused_router", _fused_router_code())


@pytest.mark.parametrize("arch", sorted(ARCH_ROUTING))
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_fused_router_is_the_bytes_of_logits_then_select(
    host_fused_router: Path, rng: np.random.Generator, arch: str, n_tokens: int
) -> None:
    """moe_router_logits_select, decode's router in one launch, writes the logits, ids and weights the
    two launches write, whichever block counts itself last; each block counts itself once and only the
    last selects, leaving the counter at 0 for the next launch."""
    cfg = ARCH_ROUTING[arch]
    n_embd, n_expert, top_k = 96, 40, 6
    x = rng.standard_normal((n_tokens, n_embd)).astype(np.float32)
    router = rng.standard_normal((n_expert, n_embd)).astype(np.float32)
    bias = rng.standard_normal(n_expert).astype(np.float32)
    sel_bias = rng.standard_normal(n_expert).astype(np.float32)
    has_sel_bias = int(cfg.gating is routing.Gating.SIGMOID)
    fields = (n_tokens, n_embd, n_expert, 1, top_k, int(cfg.gating), has_sel_bias, max(cfg.n_group, 1))
    header = struct.pack("10i", *fields, cfg.n_group_used, int(cfg.norm)) + struct.pack("f", cfg.scale)
    data = header + x.tobytes() + router.tobytes() + bias.tobytes() + sel_bias.tobytes()
    run = subprocess.run([str(host_fused_router)], input=data, capture_output=True, check=True)
    sizes = (n_tokens * n_expert * 4, n_tokens * top_k * 4, n_tokens * top_k * 4)
    runs = [run.stdout[i * sum(sizes) : (i + 1) * sum(sizes)] for i in range(3)]
    blocks = -(-n_expert // routing.LOGITS_EXPERTS)
    counts = list(np.frombuffer(run.stdout[3 * sum(sizes) :], np.int32))
    assert counts == [*range(1, blocks), 0] * 2, "blocks did not count themselves, or the last did not reset"
    two_launches = runs[0]
    ids = np.frombuffer(two_launches[sizes[0] : sizes[0] + sizes[1]], np.int32)
    assert ((ids >= 0) & (ids < n_expert)).all() and np.isfinite(np.frombuffer(two_launches, np.float32)[:1]).all()
    assert runs[1] == two_launches, "the fused launch wrote other bytes than the two launches"
    assert runs[2] == two_launches, "a second fused launch (the counter reused) wrote other bytes"


@pytest.fixture(scope="module")
def host_router_warps(tmp_path_factory: pytest.TempPathFactory, host_fused_router: Path) -> dict[str, Path]:
    """The fused-router driver three ways: the block path (AMD's, and the host's: host_fused_router),
    NVIDIA's warp paths with five shuffles for the warp's largest key (before sm_80), and with
    __reduce_max_sync (sm_80+)."""
    code = _fused_router_code()
    folder = tmp_path_factory.mktemp("router_warps")
    return {
        "block": host_fused_router,
        "warps": compile_on_host(folder, "warps", WARP_EMULATION + code),
        "redux": compile_on_host(folder, "redux", "#define ES_EMULATE_REDUX 1\n" + WARP_EMULATION + code),
    }


# Every architecture's routing at one width; the widths (1 to 16 experts a lane, partial lanes, top_k up
# to 32) with softmax; selection by logit, sigmoid and groups at a wider one.
_WARP_CASES = [
    *((arch, 40, 6) for arch in sorted(ARCH_ROUTING)),
    *(("qwen3moe", n, k) for n, k in ((8, 2), (100, 8), (300, 32), (512, 10))),
    ("gpt-oss", 128, 4),
    ("glm4moe", 256, 8),
    ("deepseek2", 256, 8),
]


@pytest.mark.parametrize(("arch", "n_expert", "top_k"), _WARP_CASES)
def test_warp_paths_are_the_bytes_of_the_block_path(
    host_router_warps: dict[str, Path], rng: np.random.Generator, arch: str, n_expert: int, top_k: int
) -> None:
    """NVIDIA's selection by one warp (1 to 16 experts a lane; the softmax's sum in the block's order; the
    rounds' keys compared as integers) writes the bytes of the block path: ids, weights and logits, for
    random rows, integer rows that tie, and rows with NaN logits."""
    cfg = ARCH_ROUTING[arch]
    assert n_expert % max(cfg.n_group, 1) == 0 and top_k <= n_expert // max(cfg.n_group, 1) * cfg.n_group_used
    n_tokens = 1 if cfg.n_group > 1 else 3  # the emulation's barrier is a yield: one grouped row a block
    n_embd = 64
    cases = {
        "random": rng.standard_normal((n_expert, n_embd)),
        "ties": rng.integers(-1, 2, (n_expert, n_embd)),
        "nan": np.where(rng.random((n_expert, 1)) < 0.2, np.nan, rng.standard_normal((n_expert, n_embd))),
    }
    for name, router in cases.items():
        x = rng.integers(-2, 3, (n_tokens, n_embd)) if name == "ties" else rng.standard_normal((n_tokens, n_embd))
        bias = np.zeros(n_expert) if name == "ties" else rng.standard_normal(n_expert)
        sel_bias = rng.standard_normal(n_expert)
        fields = (n_tokens, n_embd, n_expert, 1, top_k, int(cfg.gating), int(cfg.gating is routing.Gating.SIGMOID))
        header = struct.pack("10i", *fields, max(cfg.n_group, 1), cfg.n_group_used, int(cfg.norm))
        data = (
            header
            + struct.pack("f", cfg.scale)
            + b"".join(np.asarray(a, np.float32).tobytes() for a in (x, router, bias, sel_bias))
        )
        out = {
            way: subprocess.run([str(binary)], input=data, capture_output=True, check=True).stdout
            for way, binary in host_router_warps.items()
        }
        assert out["warps"] == out["block"], f"{name}: the warp path's bytes differ from the block path's"
        assert out["redux"] == out["block"], f"{name}: with __reduce_max_sync the bytes differ"
