"""Backend selection for the whole suite.

``--backend NAME`` (repeatable, or a comma list) runs backend-parametrized tests on exactly
those backends and fails the run at start if one of them cannot run here. Without it they
run on every usable backend and are skipped, with the reason, on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import expertstream
from expertstream.backends import BackendStatus
from expertstream.backends.base import Backend, Device
from expertstream.bench.report import Row
from expertstream.model import make_model

_STATUSES = pytest.StashKey[dict[str, BackendStatus]]()


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache_of_this_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Compiled kernel images go to a folder of this run, never to the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXPERTSTREAM_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernel-cache")))
        yield


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset on disk: 2 layers, 8 experts, top-2, Q4_0 tensors of 221184 bytes, F32 routers.

    The down tensors' rows (192) need the quantized-row padding.
    """
    return make_model("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", seed=3)


ROW_DEFAULTS: dict[str, object] = {
    "slots": 0,
    "host_memory": "registered",
    "tokens": 512,
    "ubatch": 512,
    "ttft_s": 1.0,
    "prefill_tokens_per_s": 512.0,
    "h2d_bytes": 1,
    "h2d_gbps": 1.0,
    "h2d_pct_of_peak": 1.0,
    "transfer_only_s": 1.0,
    "compute_only_s": 1.0,
    "overlap_efficiency": 1.0,
    "over_compute_ms": 0.0,
    "slot_wait_ms": None,
    "fires": 0,
    "fallbacks": {},
    "prefill_sha256": "",
}


@pytest.fixture
def make_row() -> Callable[..., Row]:
    """A report row built by hand: round defaults, the fields a test is about given."""
    return lambda **fields: Row(**{**ROW_DEFAULTS, **fields})  # type: ignore[arg-type]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run backend tests on these backends only (cuda, hip, sim; repeat or comma-separate); "
        "a named backend that cannot run here fails the run",
    )


def _requested(config: pytest.Config) -> list[str]:
    names: list[str] = []
    for value in config.getoption("--backend"):
        for name in value.split(","):
            name = name.strip().lower()
            if name and name not in names:
                names.append(name)
    return names


def _statuses(config: pytest.Config) -> dict[str, BackendStatus]:
    """Probe every backend once per run."""
    if _STATUSES not in config.stash:
        config.stash[_STATUSES] = {s.name: s for s in expertstream.available_backends()}
    return config.stash[_STATUSES]


def pytest_configure(config: pytest.Config) -> None:
    requested = _requested(config)
    if not requested:
        return
    statuses = _statuses(config)
    for name in requested:
        if name not in statuses:
            raise pytest.UsageError(f"--backend {name}: unknown backend; known: {', '.join(statuses)}")
        if not statuses[name].usable:
            raise pytest.UsageError(f"--backend {name} was asked for but cannot run here: {statuses[name].reason}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" not in metafunc.fixturenames:
        return
    requested = _requested(metafunc.config)
    params = []
    for status in _statuses(metafunc.config).values():
        if requested and status.name not in requested:
            continue
        marks = [] if status.usable else [pytest.mark.skip(reason=f"{status.name} backend: {status.reason}")]
        params.append(pytest.param(status.name, id=status.name, marks=marks))
    metafunc.parametrize("backend_name", params, indirect=True, scope="module")


@pytest.fixture(scope="module")
def backend_name(request: pytest.FixtureRequest) -> str:
    """The backend under test (parametrized over the selected backends)."""
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def backend(backend_name: str) -> Iterator[Backend]:
    """The backend opened once per test module, closed after it."""
    opened = expertstream.backend(backend_name)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(scope="module")
def device(backend: Backend) -> Device:
    return backend.device(0)
