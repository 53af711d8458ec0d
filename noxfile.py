"""Test and lint sessions. `nox -s tests` is what CI runs (no GPU needed)."""

from __future__ import annotations

import os
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PYTEST_NO_TESTS = 5


def _pytest(session: nox.Session, *args: str) -> None:
    """Run pytest; a run that collects no tests (pytest's exit 5) fails the session, saying so."""
    try:
        session.run("python", "-m", "pytest", *args, *session.posargs)
    except CommandFailed as failed:
        if getattr(failed, "return_code", None) == PYTEST_NO_TESTS:  # older nox: no code, a plain failure
            session.error("pytest collected no tests: the paths or the -k/-m selection match none")
        raise


@nox.session
def tests(session: nox.Session) -> None:
    """The simulated backend and everything pure Python: the CI session."""
    session.install("-e", ".[test]")
    session.env["EXPERTSTREAM_BACKEND"] = "sim"
    _pytest(session, "-q", "tests", "--backend", "sim")


def _vendor_tests(session: nox.Session, name: str, extra: str) -> None:
    session.install("-e", f".[test,{extra}]")
    # conftest turns "backend not usable" into a failure when it is named explicitly.
    _pytest(session, "-q", "tests", "--backend", name)


@nox.session
def tests_cuda(session: nox.Session) -> None:
    """The whole suite on the CUDA backend; fails if no usable NVIDIA device."""
    _vendor_tests(session, "cuda", "cuda")


@nox.session
def tests_hip(session: nox.Session) -> None:
    """The whole suite on the HIP backend (a ROCm machine); fails if no usable AMD device."""
    _vendor_tests(session, "hip", "hip")


@nox.session
def tests_hip_on_cuda(session: nox.Session) -> None:
    """The HIP backend on NVIDIA silicon through the HIP-to-CUDA shim (needs nvcc and a CUDA device)."""
    session.install("-e", ".[test,hip]")
    session.run(
        "bash",
        str(ROOT / "tests" / "hipshim" / "run_tests.sh"),
        *session.posargs,
        external=True,
        env={"PYTHON": os.path.join(session.bin, "python")},
    )


@nox.session
def kernels_amd(session: nox.Session) -> None:
    """The kernel source compiled as hipRTC compiles it, for real AMD targets, without a GPU.

    Installs clang-19 (apt) and fetches ROCm's device libraries and hipRTC header from Debian
    (tests/amdcompile/toolchain.py), tests the checks, then compiles for gfx90a, gfx942, gfx1100,
    gfx1201 and gfx1030 and fails unless each compiles cleanly and, once the source has the AMD
    matrix-core path, emits MFMA/WMMA where the target has them. Arguments go to
    `python -m tests.amdcompile check` (e.g. `-- --target gfx942 --keep out/amd`).
    """
    session.install("-e", ".[test]")
    session.run("python", "-m", "tests.amdcompile", "fetch")
    session.run("python", "-m", "pytest", "-q", "tests/amdcompile", env={"EXPERTSTREAM_REQUIRE_AMD_TOOLCHAIN": "1"})
    session.run("python", "-m", "tests.amdcompile", "check", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The GGUF loader against 10,000 mutated files (CI's `tests` runs the first 1,000 of them).

    EXPERTSTREAM_FUZZ_FILES sets another count; the cases are the same fixed sequence.
    """
    session.install("-e", ".[test]")
    session.env["EXPERTSTREAM_FUZZ_FILES"] = os.environ.get("EXPERTSTREAM_FUZZ_FILES", "10000")
    _pytest(session, "-q", "tests/model/test_fuzz.py", "-p", "no:cacheprovider")


@nox.session
def mutation(session: nox.Session) -> None:
    """Mutation testing of scheduler/ and the simulator's hazard checker (mutmut; not CI).

    A full run took 12.5 minutes with 2 workers on a 2-core machine (docs/results/reliability.md).

    Scope and tests are in pyproject.toml's [tool.mutmut]; posargs name mutants to re-run.
    """
    session.install("-e", ".[test]", "mutmut>=3.3")
    session.run("mutmut", "run", *session.posargs)
    session.run("mutmut", "results")
    session.run("mutmut", "export-cicd-stats")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (with its complexity and RUF rules), ruff format and mypy (typed definitions required): run in CI."""
    session.install("-e", ".[dev,test]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
