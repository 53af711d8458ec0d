"""Backend selection: explicit name, then EXPERTSTREAM_BACKEND, then auto; never a silent fallback."""

from __future__ import annotations

import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

import expertstream
from expertstream.backends import ENTRY_POINT_GROUP, ENV_VAR, resolve_name
from expertstream.backends.base import Vendor
from expertstream.backends.sim import SimBackend
from expertstream.errors import BackendUnavailable, InvalidArgument


class _Opened:
    def __init__(self, name: str) -> None:
        self.name = name


def _fake_vendor(monkeypatch: pytest.MonkeyPatch, name: str, reason: str | None) -> None:
    """Stand in for the real vendor module: ``probe()`` gives ``reason``; ``open()`` a marker."""
    module = types.ModuleType(f"expertstream.backends.{name}")
    module.probe = lambda: reason  # type: ignore[attr-defined]
    module.open = lambda **options: _Opened(name)  # type: ignore[attr-defined]
    module.AUTO_ORDER = {"cuda": 10, "hip": 20}.get(name)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ENV_VAR, raising=False)
    return monkeypatch


def test_sim_is_always_usable_and_described() -> None:
    from expertstream.backends import sim

    assert sim.probe() is None
    with expertstream.backend("sim") as backend:
        assert isinstance(backend, SimBackend)
        assert backend.name == "sim" and backend.vendor is Vendor.SIM
        assert backend.describe()["devices"][0]["arch"] == backend.profile.name


def test_auto_prefers_cuda_then_hip_then_sim(no_env: pytest.MonkeyPatch) -> None:
    _fake_vendor(no_env, "cuda", None)
    _fake_vendor(no_env, "hip", None)
    assert isinstance(expertstream.backend(), _Opened) and expertstream.backend().name == "cuda"
    _fake_vendor(no_env, "cuda", "no NVIDIA driver")
    assert expertstream.backend().name == "hip"
    _fake_vendor(no_env, "hip", "no AMD device")
    with expertstream.backend() as backend:
        assert isinstance(backend, SimBackend)


def test_environment_variable_beats_auto(no_env: pytest.MonkeyPatch) -> None:
    _fake_vendor(no_env, "cuda", None)
    no_env.setenv(ENV_VAR, " SIM ")
    with expertstream.backend() as backend:
        assert isinstance(backend, SimBackend)


def test_explicit_name_beats_the_environment(no_env: pytest.MonkeyPatch) -> None:
    _fake_vendor(no_env, "cuda", None)
    no_env.setenv(ENV_VAR, "sim")
    assert expertstream.backend("cuda").name == "cuda"


def test_unknown_names_are_invalid(no_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match="'metal'"):
        expertstream.backend("metal")
    no_env.setenv(ENV_VAR, "opencl")
    with pytest.raises(InvalidArgument, match="'opencl'"):
        expertstream.backend()


def test_unusable_explicit_backend_never_falls_back(no_env: pytest.MonkeyPatch) -> None:
    _fake_vendor(no_env, "cuda", "no NVIDIA driver found")
    _fake_vendor(no_env, "hip", "libamdhip64.so not found")
    with pytest.raises(BackendUnavailable) as info:
        expertstream.backend("cuda")
    text = str(info.value)
    assert "no NVIDIA driver found" in text and "usable here: sim" in text
    no_env.setenv(ENV_VAR, "hip")
    with pytest.raises(BackendUnavailable, match=r"libamdhip64.so not found"):
        expertstream.backend()


def test_available_backends_lists_every_backend_with_reasons(no_env: pytest.MonkeyPatch) -> None:
    _fake_vendor(no_env, "cuda", "no NVIDIA driver found")
    _fake_vendor(no_env, "hip", None)
    statuses = {s.name: s for s in expertstream.available_backends()}
    assert list(statuses) == ["cuda", "hip", "sim"]
    assert not statuses["cuda"].usable and statuses["cuda"].reason == "no NVIDIA driver found"
    assert statuses["hip"].usable and statuses["hip"].reason == ""
    assert statuses["sim"].usable


def test_sim_options_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="colour"):
        expertstream.backend("sim", colour="blue")
    with pytest.raises(InvalidArgument, match="devices"):
        expertstream.backend("sim", devices=0)
    with pytest.raises(InvalidArgument, match="data"):
        expertstream.backend("sim", data="yes")
    with expertstream.backend("sim", devices=3) as backend:
        assert [d.index for d in backend.devices] == [0, 1, 2]


_THIRD_PARTY_MODULE = '''
"""A third-party backend: the simulator under another name, tried before the built-in ones."""
from expertstream.backends.sim import SimBackend, open as open_sim

AUTO_ORDER = 5


class TinyVendorBackend(SimBackend):
    name = "tinyvendor"


def probe():
    return None


def open(**options):
    backend = open_sim(**options)
    backend.__class__ = TinyVendorBackend
    return backend
'''


def _wheel(directory: Path) -> Path:
    """A minimal wheel of a package that registers one backend in the entry-point group."""
    dist = "tinyvendor_backend-1.0.dist-info"
    files = {
        "tinyvendor_backend.py": _THIRD_PARTY_MODULE,
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: tinyvendor-backend\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": f"[{ENTRY_POINT_GROUP}]\ntinyvendor = tinyvendor_backend\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    path = directory / "tinyvendor_backend-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            wheel.writestr(name, text)
    return path


def test_a_third_party_backend_installed_with_pip_is_found_by_name_and_by_auto(
    no_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
         str(_wheel(tmp_path))],
        check=True,
    )  # fmt: skip
    assert "tinyvendor" not in {s.name for s in expertstream.available_backends()}
    no_env.syspath_prepend(str(target))
    no_env.delitem(sys.modules, "tinyvendor_backend", raising=False)
    try:
        assert {"cuda", "hip", "sim", "tinyvendor"} <= {s.name for s in expertstream.available_backends()}
        with expertstream.backend("tinyvendor", devices=2) as named:
            assert named.name == "tinyvendor" and len(named.devices) == 2
        assert resolve_name() == "tinyvendor"  # its AUTO_ORDER comes before the built-in ones
        no_env.setenv(ENV_VAR, "sim")
        assert resolve_name() == "sim"
    finally:
        sys.modules.pop("tinyvendor_backend", None)
