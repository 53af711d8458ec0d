"""Compile a kernel source as hipRTC does, for one AMD target, and read its matrix instructions.

hipRTC (ROCm 6.x) runs clang on the program with its own options first, then the caller's:

    -O3 --hip-version=M.m.p -DHIP_VERSION_MAJOR=M -DHIP_VERSION_MINOR=m -DHIP_VERSION_PATCH=p
    -D__HIPCC_RTC__ -include hiprtc_runtime.h -std=c++14 -nogpuinc
    -Wno-gnu-line-marker -Wno-missing-prototypes  <caller's options>

links ROCm's device libraries and returns the code object. ``compile_for`` runs the same clang
driver line (device-only, one code object) with the HIP backend's own options
(expertstream.backends.hip.compile_options); the only additions say where this machine keeps the
header and the device libraries hipRTC carries inside itself.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from expertstream.backends.hip import compile_options

from .toolchain import Toolchain

SOURCE_NAME = "kernels.cu"  # the one source kernel_source() concatenates


@dataclass(frozen=True)
class Target:
    name: str
    family: str  # the architecture family, for the report
    matrix: str | None  # "mfma", "wmma", or None where the SIMT path is the only one


TARGETS = {
    target.name: target
    for target in (
        Target("gfx90a", "CDNA2 (MI200)", "mfma"),
        Target("gfx942", "CDNA3 (MI300)", "mfma"),
        Target("gfx1100", "RDNA3 (RX 7900)", "wmma"),
        Target("gfx1201", "RDNA4 (R9700, RX 9070)", "wmma"),
        Target("gfx1030", "RDNA2 (RX 6900), no matrix cores", None),
    )
}

# The source's AMD matrix-core path: a builtin of either family (or its instruction in asm).
_MATRIX_SOURCE = re.compile(r"\b(?:__builtin_amdgcn_|v_)(?:mfma|smfmac|wmma|swmmac)_\w+")
_KERNEL_DEFINITION = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?(?!__launch_bounds__)(\w+)\('
)
_FUNCTION = re.compile(r"^[0-9a-f]+ <(?P<name>[^>]+)>:$")
_MNEMONIC = re.compile(r"^\s+(?P<mnemonic>[a-z][a-z0-9_]*)\b")
_MATRIX_MNEMONIC = {"mfma": re.compile(r"^v_s?mfmac?_"), "wmma": re.compile(r"^v_s?wmmac?_")}
# Kernels the launchers take on devices with matrix cores (Capabilities.matrix_cores): mul_mat_id's
# bf16 path and attention's f16 prefill. Each must hold its target's matrix instructions.
MATRIX_KERNEL_PREFIXES = ("moe_mul_mat_id_mma_", "attn_prefill_mma_")


def source_matrix_builtins(source: str) -> set[str]:
    """The AMD matrix builtins (or instructions) the source names; empty when it has no such path."""
    return {match.group(0) for match in _MATRIX_SOURCE.finditer(source)}


def defined_kernels(source: str) -> set[str]:
    """Kernels the source defines by name (not those a macro names: add them from their tables)."""
    return set(_KERNEL_DEFINITION.findall(source))


@dataclass(frozen=True)
class Disassembly:
    """Instruction mnemonics of a code object, per function."""

    functions: dict[str, Counter[str]]

    @classmethod
    def parse(cls, text: str) -> Disassembly:
        functions: dict[str, Counter[str]] = {}
        current: Counter[str] | None = None
        for line in text.splitlines():
            label = _FUNCTION.match(line)
            if label:
                current = functions.setdefault(label.group("name"), Counter())
                continue
            instruction = _MNEMONIC.match(line)
            if current is not None and instruction:
                current[instruction.group("mnemonic")] += 1
        return cls(functions)

    def total(self) -> int:
        return sum(sum(counts.values()) for counts in self.functions.values())

    def matrix(self, family: str) -> Counter[str]:
        """Instructions of one matrix family ("mfma" or "wmma"), by mnemonic, over all functions."""
        pattern = _MATRIX_MNEMONIC[family]
        found: Counter[str] = Counter()
        for counts in self.functions.values():
            found.update({m: n for m, n in counts.items() if pattern.match(m)})
        return found

    def matrix_in(self, function: str) -> int:
        """Matrix instructions of either family in one function (0 for a function it lacks)."""
        counts = self.functions.get(function, Counter())
        return sum(n for m, n in counts.items() if any(p.match(m) for p in _MATRIX_MNEMONIC.values()))

    def dot4_in(self, function: str) -> int:
        """Integer dot-product instructions (v_dot4*: four signed bytes a word) in one function."""
        return sum(n for m, n in self.functions.get(function, Counter()).items() if m.startswith("v_dot4"))

    def matrix_functions(self, family: str) -> dict[str, int]:
        pattern = _MATRIX_MNEMONIC[family]
        per_function = {
            name: sum(n for m, n in counts.items() if pattern.match(m)) for name, counts in self.functions.items()
        }
        return {name: n for name, n in per_function.items() if n}


@dataclass
class Result:
    target: Target
    command: list[str]
    compiled: bool
    log: str
    kernels: set[str] = field(default_factory=set)
    disassembly: Disassembly = field(default_factory=lambda: Disassembly({}))

    def matrix_count(self, family: str) -> int:
        return sum(self.disassembly.matrix(family).values())


def command(toolchain: Toolchain, target: Target, source: Path, output: Path) -> list[str]:
    """The clang line hipRTC runs for ``target`` with the HIP backend's options."""
    major, minor, patch = toolchain.hip_version
    hiprtc_own = [
        "-O3",
        f"--hip-version={major}.{minor}.{patch}",
        f"-DHIP_VERSION_MAJOR={major}",
        f"-DHIP_VERSION_MINOR={minor}",
        f"-DHIP_VERSION_PATCH={patch}",
        "-D__HIPCC_RTC__",
        "-include",
        "hiprtc_runtime.h",
        "-std=c++14",
        "-nogpuinc",
        "-Wno-gnu-line-marker",
        "-Wno-missing-prototypes",
    ]
    backend = [option.decode() for option in compile_options(target.name)]
    where = [f"-I{toolchain.include}", f"--rocm-device-lib-path={toolchain.bitcode}"]
    driver = [toolchain.tool("clang"), "-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output"]
    return [*driver, *hiprtc_own, *backend, *where, str(source), "-o", str(output)]


def compile_for(toolchain: Toolchain, target: Target, source: str, keep: Path | None = None) -> Result:
    """Compile ``source`` for ``target``; on success, disassemble it and list its kernels."""
    with tempfile.TemporaryDirectory(prefix=f"amdcompile-{target.name}-") as scratch:
        folder = Path(scratch) if keep is None else keep
        folder.mkdir(parents=True, exist_ok=True)
        source_path = folder / SOURCE_NAME
        source_path.write_text(source)
        code_object = folder / f"kernels-{target.name}.co"
        line = command(toolchain, target, source_path, code_object)
        done = subprocess.run(line, capture_output=True, text=True)
        result = Result(target, line, done.returncode == 0, (done.stdout + done.stderr).strip())
        if not result.compiled:
            return result
        text = _tool(toolchain, "llvm-objdump", "--disassemble", f"--mcpu={target.name}", str(code_object))
        if keep is not None:
            (folder / f"kernels-{target.name}.s").write_text(text)
        result.disassembly = Disassembly.parse(text)
        symbols = _tool(toolchain, "llvm-nm", "--defined-only", "--just-symbol-name", str(code_object))
        result.kernels = {name.removesuffix(".kd") for name in symbols.split() if name.endswith(".kd")}
        return result


def _tool(toolchain: Toolchain, name: str, *arguments: str) -> str:
    return subprocess.run([toolchain.tool(name), *arguments], capture_output=True, text=True, check=True).stdout


def problems(result: Result, matrix_builtins: set[str], required_kernels: set[str]) -> list[str]:
    """Why ``result`` fails the session (empty when it passes).

    A target with matrix cores must emit its family's instructions once the source has the AMD
    matrix-core path (``matrix_builtins`` not empty), in every kernel of ``MATRIX_KERNEL_PREFIXES``
    it exports; before that, none is asked for.
    """
    name = result.target.name
    if not result.compiled:
        return [f"{name}: does not compile:\n{result.log}"]
    found: list[str] = []
    if result.log:
        found.append(f"{name}: compiler output (warnings count as failures):\n{result.log}")
    missing = sorted(required_kernels - result.kernels)
    if missing:
        found.append(f"{name}: kernels missing from the code object: {', '.join(missing)}")
    family = result.target.matrix
    if family and matrix_builtins and result.matrix_count(family) == 0:
        found.append(
            f"{name}: the source has an AMD matrix-core path ({', '.join(sorted(matrix_builtins)[:3])}...) "
            f"but the code object has no v_{family}_* instruction"
        )
    elif family and matrix_builtins:
        pattern = _MATRIX_MNEMONIC[family]
        without = sorted(
            kernel
            for kernel in result.kernels
            if kernel.startswith(MATRIX_KERNEL_PREFIXES)
            and not any(pattern.match(m) for m in result.disassembly.functions.get(kernel, Counter()))
        )
        if without:
            found.append(f"{name}: matrix-core kernels without a v_{family}_* instruction: {', '.join(without)}")
    return found
