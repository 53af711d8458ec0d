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

from .test_kernels_on_host import _FIBERS, CXX, compile_on_host, shared_code

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
