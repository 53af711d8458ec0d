"""Names that moved keep working for one release, each with a DeprecationWarning naming the new home."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import expertstream.ggml
import expertstream.scheduler


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("padded_size", expertstream.ggml.padded_size),
        ("row_size", expertstream.ggml.row_size),
        ("is_quantized", expertstream.ggml.is_quantized),
        ("MATRIX_ROW_PADDING", expertstream.ggml.MATRIX_ROW_PADDING),
        ("HostRegion", expertstream.scheduler.HostRegion),
        ("HostSource", expertstream.scheduler.HostSource),
    ],
)
def test_moved_contract_names_resolve_with_a_warning(old: str, new: object) -> None:
    base = importlib.import_module("expertstream.backends.base")
    with pytest.warns(DeprecationWarning, match=f"backends.base.{old} moved to expertstream"):
        assert getattr(base, old) is new


def test_unknown_names_still_raise_attribute_error() -> None:
    base = importlib.import_module("expertstream.backends.base")
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        base.not_a_name  # noqa: B018


def test_the_old_kernels_package_path_still_imports() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n"
        "    import expertstream.backends.kernels\n"
        "except DeprecationWarning as w:\n"
        "    print(w)\n"
        "warnings.simplefilter('ignore')\n"
        "from expertstream.backends.kernels import MoeKernels\n"
        "from expertstream.backends.kernels.reference import mul_mat_id\n"
        "import expertstream.kernels as k\n"
        "print(MoeKernels is k.MoeKernels, mul_mat_id is k.reference.mul_mat_id)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "moved to expertstream.kernels" in out and out.strip().endswith("True True")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("expertstream.moe.runner", "expertstream.engine.runner"),
        ("expertstream.moe.measure", "expertstream.bench.measure"),
        ("expertstream.moe.commands", "expertstream.cli.prefill"),
        ("expertstream.moe.tune_command", "expertstream.cli.tune"),
        ("expertstream.model.commands", "expertstream.cli.make_model"),
        ("expertstream.model.layout", "expertstream.model.schema"),
        ("expertstream.moe.tune", "expertstream.bench.tuner"),
        ("expertstream.clitools", "expertstream.cli.tools"),
        ("expertstream.plot", "expertstream.cli.plot"),
    ],
)
def test_the_old_module_paths_of_the_workload_still_import(old: str, new: str) -> None:
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"print(old is importlib.import_module({new!r}), [str(w.message) for w in seen])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("True") and f"{old} moved to {new}" in out


def test_the_old_dlpack_module_path_still_imports() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    from expertstream.backends.interop import DLDeviceType, TypedView, live_exports\n"
        "import expertstream.backends.dlpack as new\n"
        "same = (DLDeviceType, TypedView, live_exports) == (new.DLDeviceType, new.TypedView, new.live_exports)\n"
        "print(same, [str(w.message) for w in seen])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("True") and "expertstream.backends.interop moved to expertstream.backends.dlpack" in out


def test_the_old_name_of_the_preferred_host_memory_mode_still_resolves() -> None:
    from expertstream.hostmem import HostMemoryMode

    with pytest.warns(DeprecationWarning, match="'auto' is now 'preferred'"):
        assert HostMemoryMode("auto") is HostMemoryMode.PREFERRED
    with pytest.raises(ValueError, match="'bogus'"):
        HostMemoryMode("bogus")
