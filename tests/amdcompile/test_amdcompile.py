"""The checks of the kernels_amd session: they pass real matrix code and fail what they should.

The parsing and the rules run everywhere. The compiling tests need the toolchain
(``python -m tests.amdcompile fetch``); without it they are skipped with the reason, and the
nox session, which sets EXPERTSTREAM_REQUIRE_AMD_TOOLCHAIN, turns that skip into a failure.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from expertstream.backends import hip
from expertstream.backends.hip import compile_options

from . import hiprtc, toolchain
from .__main__ import attention_table

# One kernel with each family's matrix instruction where the target has it, a plain loop elsewhere.
MATRIX_KERNEL = """
typedef _Float16 half4 __attribute__((ext_vector_type(4)));
typedef _Float16 half8 __attribute__((ext_vector_type(8)));
typedef _Float16 half16 __attribute__((ext_vector_type(16)));
typedef float float4v __attribute__((ext_vector_type(4)));
typedef float float8v __attribute__((ext_vector_type(8)));

extern "C" __global__ void tile(const _Float16* a, float* c) {
#if MFMA_TARGETS
    half4 x = *(const half4*)(a + 4 * threadIdx.x);
    float4v acc = {0.0f, 0.0f, 0.0f, 0.0f};
    *(float4v*)(c + 4 * threadIdx.x) = __builtin_amdgcn_mfma_f32_16x16x16f16(x, x, acc, 0, 0, 0);
#elif defined(__gfx1100__)
    half16 x = *(const half16*)(a + 16 * threadIdx.x);
    float8v acc = {};
    *(float8v*)(c + 8 * threadIdx.x) = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(x, x, acc);
#elif defined(__gfx1201__)
    half8 x = *(const half8*)(a + 8 * threadIdx.x);
    float8v acc = {};
    *(float8v*)(c + 8 * threadIdx.x) = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(x, x, acc);
#else
    c[threadIdx.x] = expf((float)a[threadIdx.x]);
#endif
}
"""
BOTH_CDNA = MATRIX_KERNEL.replace("MFMA_TARGETS", "defined(__gfx90a__) || defined(__gfx942__)")
ONLY_GFX90A = MATRIX_KERNEL.replace("MFMA_TARGETS", "defined(__gfx90a__)")

OBJDUMP = """
/tmp/kernels-gfx942.co:\tfile format elf64-amdgpu

Disassembly of section .text:

0000000000001900 <moe_swiglu>:
\ts_load_dwordx4 s[0:3], s[0:1], 0x0                         // 000000001900: C00A0000 00000000
\tv_mov_b32_e32 v1, 0                                        // 000000001908: 7E020280
\ts_endpgm                                                   // 00000000190C: BF810000

0000000000001a00 <moe_tile_mma>:
\tv_mfma_f32_16x16x16_f16 a[0:3], v[0:1], v[0:1], a[0:3]     // 000000001A00: D3CD8000 04020100
\tv_mfma_f32_16x16x16_f16 a[4:7], v[2:3], v[2:3], a[4:7]     // 000000001A08: D3CD8004 04120502
\tv_mov_b32_e32 v1, 0                                        // 000000001A10: 7E020280
\ts_endpgm                                                   // 000000001A14: BF810000
"""


def _compiled(target: str, counts: dict[str, Counter[str]], log: str = "") -> hiprtc.Result:
    result = hiprtc.Result(hiprtc.TARGETS[target], [], True, log, set(counts))
    result.disassembly = hiprtc.Disassembly(counts)
    return result


def test_source_matrix_builtins_finds_each_family_and_nothing_else() -> None:
    source = "acc = __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, acc, 0, 0, 0);\n__builtin_amdgcn_s_barrier();"
    assert hiprtc.source_matrix_builtins(source) == {"__builtin_amdgcn_mfma_f32_16x16x16f16"}
    wmma = "x = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(a, b, c);"
    assert hiprtc.source_matrix_builtins(wmma) == {"__builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12"}
    assert hiprtc.source_matrix_builtins("__syncthreads(); fmaf(a, b, c);") == set()


def test_defined_kernels_reads_plain_definitions() -> None:
    source = (
        'extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) moe_router_topk(const float* x) {}\n'
        'extern "C" __global__ void moe_swiglu(const float* gate) {}\n'
        '#define K(NAME) extern "C" __global__ void __launch_bounds__(128)   \\\n    NAME(const float* w) {}\n'
    )
    assert hiprtc.defined_kernels(source) == {"moe_router_topk", "moe_swiglu"}


def test_disassembly_counts_instructions_per_function() -> None:
    disassembly = hiprtc.Disassembly.parse(OBJDUMP)
    assert disassembly.total() == 7
    assert disassembly.matrix("mfma") == Counter({"v_mfma_f32_16x16x16_f16": 2})
    assert disassembly.matrix("wmma") == Counter()
    assert disassembly.matrix_functions("mfma") == {"moe_tile_mma": 2}
    assert disassembly.matrix_in("moe_tile_mma") == 2
    assert disassembly.matrix_in("moe_swiglu") == 0 and disassembly.matrix_in("absent") == 0


def test_a_matrix_target_without_matrix_instructions_fails_once_the_source_has_the_path() -> None:
    simt = {"moe_swiglu": Counter({"v_fma_f32": 4})}
    builtins = {"__builtin_amdgcn_wmma_f32_16x16x16_f16_w32"}
    (problem,) = hiprtc.problems(_compiled("gfx1201", simt), builtins, {"moe_swiglu"})
    assert problem.startswith("gfx1201:") and "no v_wmma_* instruction" in problem
    assert hiprtc.problems(_compiled("gfx1201", simt), set(), {"moe_swiglu"}) == []
    assert hiprtc.problems(_compiled("gfx1030", simt), builtins, {"moe_swiglu"}) == []
    wmma = {"moe_swiglu": Counter({"v_wmma_f32_16x16x16_f16": 1})}
    assert hiprtc.problems(_compiled("gfx1201", wmma), builtins, {"moe_swiglu"}) == []


def test_a_matrix_core_kernel_left_without_matrix_instructions_fails() -> None:
    """The launchers take attention's and mul_mat_id's matrix-core kernels on matrix-core devices:
    one that fell back to FMAs fails even where other kernels hold matrix instructions."""
    builtins = {"__builtin_amdgcn_mfma_f32_16x16x16f16"}
    counts = {
        "moe_mul_mat_id_mma_q8_0_m64": Counter({"v_mfma_f32_16x16x16_bf16": 16}),
        "attn_prefill_mma_d64": Counter({"v_fma_f32": 900}),
        "attn_prefill_simt_d64": Counter({"v_fma_f32": 400}),
    }
    (problem,) = hiprtc.problems(_compiled("gfx942", counts), builtins, set(counts))
    assert problem == "gfx942: matrix-core kernels without a v_mfma_* instruction: attn_prefill_mma_d64"
    counts["attn_prefill_mma_d64"] = Counter({"v_mfma_f32_16x16x16_f16": 32})
    assert hiprtc.problems(_compiled("gfx942", counts), builtins, set(counts)) == []
    assert hiprtc.problems(_compiled("gfx1030", {"attn_prefill_mma_d64": Counter()}), builtins, set()) == []


def test_the_report_lists_matrix_instructions_per_attention_kernel() -> None:
    cdna = _compiled("gfx942", {"attn_prefill_mma_d64": Counter({"v_mfma_f32_16x16x16_f16": 32, "v_exp_f32": 9})})
    cdna.kernels.add("attn_prefill_simt_d64")
    rdna2 = _compiled("gfx1030", {"attn_prefill_mma_d64": Counter({"v_fma_f32": 9}), "moe_swiglu": Counter()})
    failed = hiprtc.Result(hiprtc.TARGETS["gfx1201"], [], False, "error")
    assert attention_table([cdna, rdna2, failed]) == [
        "| kernel | gfx942 | gfx1030 |",
        "| --- | ---: | ---: |",
        "| attn_prefill_mma_d64 | 32 | 0 |",
        "| attn_prefill_simt_d64 | 0 | 0 |",
    ]
    assert attention_table([failed]) == []


def test_failed_compiles_warnings_and_missing_kernels_are_problems() -> None:
    failed = hiprtc.Result(hiprtc.TARGETS["gfx942"], [], False, "kernels.cu:3:1: error: expected ';'")
    (problem,) = hiprtc.problems(failed, set(), set())
    assert "gfx942: does not compile" in problem and "expected ';'" in problem
    warned = _compiled("gfx942", {"k": Counter()}, log="kernels.cu:9:5: warning: unused variable 'x'")
    assert any("warnings count as failures" in p for p in hiprtc.problems(warned, set(), {"k"}))
    (missing,) = hiprtc.problems(_compiled("gfx942", {"k": Counter()}), set(), {"k", "moe_swiglu"})
    assert missing == "gfx942: kernels missing from the code object: moe_swiglu"


def test_the_compile_line_carries_the_hip_backends_options_after_hiprtcs_own() -> None:
    chain = toolchain.Toolchain(Path("/cache"), Path("/cache/bitcode"), Path("/cache/include"), (6, 4, 3), {})
    line = hiprtc.command(chain, hiprtc.TARGETS["gfx942"], Path("kernels.cu"), Path("kernels.co"))
    backend = [option.decode() for option in compile_options("gfx942")]
    start = line.index(backend[0])
    assert line[start : start + len(backend)] == backend
    assert line.index("-D__HIPCC_RTC__") < start and line.index("hiprtc_runtime.h") < start
    assert line.index("-std=c++14") < line.index("-std=c++17"), "the backend's dialect must come last to win"


@pytest.mark.parametrize("target", sorted(hiprtc.TARGETS))
def test_the_backend_takes_the_matrix_path_exactly_where_the_session_asks_for_matrix_instructions(
    target: str,
) -> None:
    assert hip._has_bf16_matrix_cores(target) == (hiprtc.TARGETS[target].matrix is not None)


@pytest.fixture(scope="module")
def chain() -> toolchain.Toolchain:
    try:
        return toolchain.locate()
    except toolchain.ToolchainMissing as exc:
        if os.environ.get("EXPERTSTREAM_REQUIRE_AMD_TOOLCHAIN"):
            pytest.fail(f"the AMD toolchain is required here: {exc}")
        pytest.skip(f"no AMD toolchain: {exc}")


@pytest.mark.parametrize("target", sorted(hiprtc.TARGETS))
def test_matrix_code_compiles_to_its_family_on_every_target(chain: toolchain.Toolchain, target: str) -> None:
    source = BOTH_CDNA
    result = hiprtc.compile_for(chain, hiprtc.TARGETS[target], source)
    assert hiprtc.problems(result, hiprtc.source_matrix_builtins(source), {"tile"}) == []
    family = hiprtc.TARGETS[target].matrix
    assert result.matrix_count("mfma") == (1 if family == "mfma" else 0)
    assert result.matrix_count("wmma") == (1 if family == "wmma" else 0)


def test_a_cdna_target_left_on_the_simt_path_fails(chain: toolchain.Toolchain) -> None:
    source = ONLY_GFX90A
    result = hiprtc.compile_for(chain, hiprtc.TARGETS["gfx942"], source)
    assert result.compiled and result.kernels == {"tile"}
    (problem,) = hiprtc.problems(result, hiprtc.source_matrix_builtins(source), {"tile"})
    assert "gfx942" in problem and "no v_mfma_* instruction" in problem


def test_compile_errors_and_warnings_reach_the_log(chain: toolchain.Toolchain) -> None:
    broken = hiprtc.compile_for(chain, hiprtc.TARGETS["gfx1201"], 'extern "C" __global__ void k() { int x = }')
    assert not broken.compiled and "error" in broken.log
    warned = hiprtc.compile_for(
        chain, hiprtc.TARGETS["gfx1201"], '#warning "left over"\nextern "C" __global__ void k() {}'
    )
    assert warned.compiled and "left over" in warned.log
    assert hiprtc.problems(warned, set(), {"k"})
