"""Compile the kernel source as hipRTC does for AMD targets, without a GPU, and report what it emits.

    python -m tests.amdcompile fetch                  # clang-19 and ROCm's files from Debian (idempotent)
    python -m tests.amdcompile check [--target gfx942 ...] [--keep DIR] [--source FILE]

``check`` prints the toolchain, the clang line per target, a table of instruction counts from
the disassembly and one of the matrix instructions in each attention kernel, and exits 1 if a
target does not compile cleanly, lacks a kernel the package launches, or has matrix cores but no
matrix instruction (in all, or in a kernel the launchers take there) while the source has the
AMD matrix-core path (tests/amdcompile/hiprtc.py says what that is).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expertstream.backends._gpu import gather_source
from expertstream.kernels import kernel_source, type_kernels
from expertstream.kernels.attention import NVIDIA_ONLY_KERNELS
from expertstream.kernels.layout import FORMATS

from . import hiprtc, toolchain


def _required_kernels(source: str) -> set[str]:
    """Every kernel the source defines, less those it defines for NVIDIA's mma.sync alone (the
    launcher never asks an AMD device for them)."""
    by_type = {name for fmt in FORMATS.values() for name in type_kernels(fmt)}
    return (by_type | hiprtc.defined_kernels(source)) - set(NVIDIA_ONLY_KERNELS)


def _matrix_functions(result: hiprtc.Result) -> dict[str, int]:
    found: dict[str, int] = {}
    for family in ("mfma", "wmma"):
        found.update(result.disassembly.matrix_functions(family))
    return found


def _table(results: list[hiprtc.Result]) -> list[str]:
    rows = [
        "| target | family | compiles | kernels | instructions | v_mfma_* | v_wmma_* | matrix kernels |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        target = result.target
        if not result.compiled:
            rows.append(f"| {target.name} | {target.family} | no | | | | | |")
            continue
        rows.append(
            f"| {target.name} | {target.family} | yes | {len(result.kernels)} | {result.disassembly.total()} "
            f"| {result.matrix_count('mfma')} | {result.matrix_count('wmma')} | {len(_matrix_functions(result))} |"
        )
    return rows


def _mnemonics(results: list[hiprtc.Result]) -> list[str]:
    lines = []
    for result in results:
        per_kernel = _matrix_functions(result)
        if not per_kernel:
            continue
        counts = result.disassembly.matrix("mfma") + result.disassembly.matrix("wmma")
        listed = ", ".join(f"{m} x{n}" for m, n in sorted(counts.items()))
        spread = f"{min(per_kernel.values())}-{max(per_kernel.values())} per kernel"
        lines.append(f"- {result.target.name}: {listed} ({spread})")
    return lines


def attention_table(results: list[hiprtc.Result]) -> list[str]:
    """Matrix instructions (v_mfma_* and v_wmma_*) per attention kernel and compiled target."""
    compiled = [result for result in results if result.compiled]
    kernels = sorted({kernel for result in compiled for kernel in result.kernels if kernel.startswith("attn_")})
    if not kernels:
        return []
    rows = [
        "| kernel | " + " | ".join(result.target.name for result in compiled) + " |",
        "| --- |" + " ---: |" * len(compiled),
    ]
    for kernel in kernels:
        counts = [str(result.disassembly.matrix_in(kernel)) for result in compiled]
        rows.append(f"| {kernel} | " + " | ".join(counts) + " |")
    return rows


# A matrix-vector kernel on the int8 activations (gemv.cu's dot4_i8): where the source has AMD's integer dot
# builtins, every target must emit v_dot4* in it.
DOT4_KERNEL = "moe_gate_up_vec_id_q4_k"
DOT4_BUILTINS = ("__builtin_amdgcn_sdot4", "__builtin_amdgcn_sudot4")


def _dot4_problems(results: list[hiprtc.Result], source: str) -> list[str]:
    if not any(builtin in source for builtin in DOT4_BUILTINS):
        return []
    return [
        f"{result.target.name}: the source has AMD's integer dot builtins but {DOT4_KERNEL} has no v_dot4*"
        for result in results
        if result.compiled and DOT4_KERNEL in result.kernels and not result.disassembly.dot4_in(DOT4_KERNEL)
    ]


def check(names: list[str], keep: Path | None, source_file: Path | None) -> int:
    chain = toolchain.locate()
    source = source_file.read_text() if source_file else kernel_source() + "\n" + gather_source()
    builtins = hiprtc.source_matrix_builtins(source)
    required = _required_kernels(source)
    targets = [hiprtc.TARGETS[name] for name in names]
    print("toolchain:", ", ".join(f"{package} {version}" for package, version in sorted(chain.packages.items())))
    print(f"cache: {chain.root}")
    if builtins:
        print(f"AMD matrix-core path in the source: {', '.join(sorted(builtins))}")
    else:
        print("AMD matrix-core path in the source: none yet (matrix instructions are reported, not required)")
    workers = min(len(targets), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(
            pool.map(lambda t: hiprtc.compile_for(chain, t, source, keep / t.name if keep else None), targets)
        )
    for result in results:
        print(f"\n{result.target.name}: {shlex.join(result.command)}")
    print()
    print("\n".join(_table(results)))
    mnemonics = _mnemonics(results)
    if mnemonics:
        print("\nmatrix instructions by mnemonic, over the kernels that have them:")
        print("\n".join(mnemonics))
    attention = attention_table(results)
    if attention:
        print("\nmatrix instructions per attention kernel:")
        print("\n".join(attention))
    print(
        f"\nv_dot4* in {DOT4_KERNEL}: "
        + ", ".join(
            f"{result.target.name} {result.disassembly.dot4_in(DOT4_KERNEL)}" for result in results if result.compiled
        )
    )
    dot4 = _dot4_problems(results, source)
    failures = [problem for result in results for problem in hiprtc.problems(result, builtins, required)] + dot4
    print()
    for problem in failures:
        print(f"FAIL {problem}", file=sys.stderr)
    failed = {problem.split(":", 1)[0] for problem in dot4}
    passed = sum(
        1 for result in results if not hiprtc.problems(result, builtins, required) and result.target.name not in failed
    )
    print(f"kernels_amd: {passed} passed, {len(results) - passed} failed")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.amdcompile", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fetch", help="install clang-19 and fetch ROCm's device libraries and hipRTC header")
    checker = commands.add_parser("check", help="compile for each target and check the disassembly")
    checker.add_argument("--target", action="append", choices=sorted(hiprtc.TARGETS), help="default: all")
    checker.add_argument("--keep", type=Path, help="write each target's source, code object and disassembly here")
    checker.add_argument("--source", type=Path, help="compile this file instead of the package's kernel source")
    args = parser.parse_args()
    try:
        if args.command == "fetch":
            chain = toolchain.fetch()
            print(f"AMD toolchain ready in {chain.root}: " + ", ".join(f"{p} {v}" for p, v in chain.packages.items()))
            return 0
        return check(args.target or list(hiprtc.TARGETS), args.keep, args.source)
    except toolchain.ToolchainMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
