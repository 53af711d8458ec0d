"""The layers of docs/design.md, checked on the import graph of every module (function-level imports too)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import expertstream

PACKAGE = Path(expertstream.__file__).parent
LEAVES = {"errors", "ggml", "timeline", "_closing", "_deprecated", "_env"}

# Which top-level parts of expertstream each part may import (besides itself).
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "ggml": {"errors"},
    "timeline": set(),
    "_closing": set(),
    "_deprecated": set(),
    "_env": {"errors"},
    "backends": {"errors", "ggml", "timeline", "_closing", "_deprecated", "_env"},
    "kernels": {"backends", "errors", "ggml", "_closing", "_env"},
    "scheduler": {"backends", "errors", "ggml", "_closing"},
    "model": {"errors", "ggml", "_closing"},
    "hostmem": {"backends", "scheduler", "model", "errors", "_closing", "_deprecated"},
    "engine": {"backends", "kernels", "scheduler", "model", "hostmem", *LEAVES},
    "bench": {"engine", "backends", "kernels", "scheduler", "model", "hostmem", *LEAVES},
    "interop": {"backends", "scheduler", *LEAVES},
    "cli": {"bench", "engine", "backends", "kernels", "scheduler", "model", "hostmem", "interop", *LEAVES},
}
# The package's front door may import anything.
ENTRY_MODULES = {"expertstream", "expertstream.__main__"}
# Inside backends/, only the registry reaches the vendor modules; outside, only the contract and the simulator.
VENDOR_MODULES = {"cuda", "hip", "_gpu", "_gpu_api"}
# Aliases kept for one release that re-export a moved module; each imports its new home.
DEPRECATED_ALIASES = {"expertstream.backends.kernels", "expertstream.clitools", "expertstream.plot"} | {
    f"expertstream.{name}" for name in ("model.commands", "model.layout", "moe", "moe.commands", "moe.tune_command")
}
DEPRECATED_ALIASES |= {
    f"expertstream.moe.{name}"
    for name in (
        *("measure", "tune", "probes", "predict", "report", "provenance", "placeholder"),
        *("runner", "arch", "layersplit", "offload", "standin"),
    )
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every expertstream module ``module`` imports, with the line, except in ``__getattr__`` aliases."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            skipped.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "expertstream":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "expertstream":
                continue
            for alias in node.names:  # `from . import x`: x may be a module or a name
                yield (f"{target}.{alias.name}" if _is_module(f"{target}.{alias.name}") else target), node.lineno


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _file_violations(path: Path, module: str) -> list[str]:
    found = []
    here = _part(module)
    allowed = MAY_IMPORT[here]
    for target, line in _imports(path, module):
        there = _part(target)
        where = f"{module}:{line} imports {target}"
        if there and there != here and there not in allowed:
            found.append(f"{where}: {here} may not import {there}")
        vendor = target.split(".")[2] if target.startswith("expertstream.backends.") else ""
        if vendor in VENDOR_MODULES and here != "backends":
            found.append(f"{where}: vendor code is reached only through the registry")
        if here == "hostmem" and there == "scheduler" and target != "expertstream.scheduler.source":
            found.append(f"{where}: host memory implements the scheduler's source protocol, nothing else")
    return found


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module not in ENTRY_MODULES and module not in DEPRECATED_ALIASES:
            found += _file_violations(path, module)
    return found


def test_every_part_of_the_package_has_a_layer() -> None:
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")} - DEPRECATED_ALIASES
    parts = {_part(module) for module in modules} - {"", "__main__"}
    assert parts <= set(MAY_IMPORT), f"add {sorted(parts - set(MAY_IMPORT))} to MAY_IMPORT and docs/design.md"


def test_imports_follow_the_layers() -> None:
    assert _violations() == []


def test_the_checker_sees_violations(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from ..hostmem import HostWeights\nfrom ..backends import cuda\nimport expertstream.backends._gpu\n",
        encoding="utf-8",
    )
    found = _file_violations(probe, "expertstream.scheduler.probe")
    assert len(found) == 3
    assert "scheduler may not import hostmem" in found[0]
    assert all("only through the registry" in v for v in found[1:])
