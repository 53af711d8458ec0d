"""A kernel's module compiles the shared code and its own weight type's instances only.

Compile time grows with the instances (every type's kernels took ~50 s through nvcc, one
type's ~5 s), so a model of one type must not compile the others. The split keeps the
contract: every kernel of the whole source is in exactly one per-type module, with the
same name, and the shared kernels are in every module.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import GGMLQuantizationType

import expertstream
from expertstream.backends._gpu import gather_source
from expertstream.kernels import MoeKernels, kernel_source, module_types, type_kernels
from expertstream.kernels.launcher import TWINS
from expertstream.kernels.layout import FORMATS

# An instance line of a per-type kernel: one of the instance macros, then the kernel's name.
_INSTANCE = re.compile(
    r"^(?:MOE_(?:MUL_MAT_ID|MUL_MAT_VEC_\w+|GATE_UP)\w*|DENSE_(?:GET_ROWS|MUL_MAT_VEC_\w+))\((\w+),", re.M
)
# A kernel the shared code defines by name (the per-type ones come from instance macros).
_SHARED_KERNEL = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?(?!__launch_bounds__)(\w+)\('
)


def _instances(source: str) -> list[str]:
    return _INSTANCE.findall(source)


def test_every_kernel_of_the_whole_source_is_in_its_types_module() -> None:
    whole = _instances(kernel_source())
    names = [name for fmt in FORMATS.values() for name in type_kernels(fmt)]
    assert sorted(whole) == sorted(names) and len(set(whole)) == len(whole)
    assert _instances(kernel_source(())) == []  # the shared code alone
    per_type = {fmt.qtype: _instances(kernel_source([fmt.qtype])) for fmt in FORMATS.values()}
    assert sorted(n for names in per_type.values() for n in names) == sorted(whole)
    for name in whole:
        (w_type,) = module_types(name)
        assert name in per_type[w_type]
    assert module_types("moe_swiglu") == () and module_types("moe_group_by_expert") == ()
    shared = kernel_source(())
    assert all(kernel_source([t]).startswith(shared) for t in per_type)


def test_every_kernel_of_the_source_has_a_twin_and_every_twin_a_kernel() -> None:
    """The simulator runs the twin MoeKernels hands to each compile: none may be missing or stray."""
    shared = set(_SHARED_KERNEL.findall(kernel_source(())))
    per_type = {name for fmt in FORMATS.values() for name in type_kernels(fmt)}
    assert "moe_swiglu" in shared and "moe_rms_norm" in shared
    assert shared | per_type == set(TWINS)


class _CountingDevice:
    """Stands in for a device: records the sources it is asked to compile."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self.sources: dict[str, set[str]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def compile(self, source: str, name: str, twin: object | None = None, chained: bool = False) -> Any:
        assert chained, f"{name}: the package's kernels open with KERNEL_PROLOGUE and may launch chained"
        self.sources.setdefault(source, set()).add(name)
        return self._device.compile(source, name, twin, chained)


def test_a_model_of_one_type_compiles_two_modules() -> None:
    q4_0 = GGMLQuantizationType.Q4_0
    with expertstream.backend("sim", data=False) as sim:
        device = _CountingDevice(sim.device(0))
        with MoeKernels(device) as kernels:
            kernels.prepare([q4_0])
            kernels.prepare([q4_0])  # compiled once
            for name in ("moe_combine", kernels.mul_mat_id_kernel(q4_0, 4096 * 8, 128, 2048)):
                kernels.kernel(name)
    assert set(device.sources) == {kernel_source(()), kernel_source([q4_0])}


_BODY_START = re.compile(r"__global__[^{]*\{[\s\\]*(\w+)(?:<[\w, ]+>)?\([^;]*;[\s\\]*(\w*)")
_PREFETCH = re.compile(r"__device__ void (prefetch_\w+)\(")


def test_every_kernel_opens_with_the_chained_launch_wait() -> None:
    """A chained launch (Capabilities.chained_launches) may start a kernel while the one before it
    runs: a kernel whose first statement is not KERNEL_PROLOGUE could read that one's output early.
    The one exception: a prefetch_* helper first (weights asked into L2, which reads nothing), then
    KERNEL_PROLOGUE."""
    sources = {"kernels": kernel_source(()), "gather.cu": gather_source()}
    for where, source in sources.items():
        opening = _BODY_START.findall(source)
        assert len(opening) == source.count("__global__") > 0, where
        for first, second in opening:
            assert first == "KERNEL_PROLOGUE" or (first.startswith("prefetch_") and second == "KERNEL_PROLOGUE"), (
                where, first, second)  # fmt: skip
    kernels = sources["kernels"]
    assert len(_BODY_START.findall(kernels)) >= 30
    # the helpers only ask lines into L2: no load, store or atomic in their bodies
    for name in set(_PREFETCH.findall(kernels)):
        body = kernels[kernels.index(f"void {name}(") :]
        body = body[: body.index("\n}\n")]
        assert "PREFETCH_L2" in body or "prefetch_" in body.split("{", 1)[1], name
        assert not re.search(r"=\s*\*|\w\[[^]]*\]\s*=|atomic", body.split("{", 1)[1]), name
