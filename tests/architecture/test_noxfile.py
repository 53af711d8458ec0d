"""The nox sessions' pytest runs: a selection that collects no tests fails, with a line that says so."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import nox.command as nox_command
import pytest

ROOT = Path(__file__).resolve().parents[2]


class _Quit(Exception):
    """What session.error raises here: the session ends, failed, with its message."""


class _Session:
    """The part of nox.Session that _pytest uses; pytest "exits" with ``code``."""

    posargs: tuple[str, ...] = ("-k", "no_such_test")

    def __init__(self, code: int) -> None:
        self.code = code
        self.commands: list[tuple[str, ...]] = []

    def run(self, *args: str, **kwargs: Any) -> bool:
        self.commands.append(args)
        if self.code:
            raise nox_command.CommandFailed(f"Returned code {self.code}", return_code=self.code)
        return True

    def error(self, *args: Any) -> None:
        raise _Quit(*args)


@pytest.fixture(scope="module")
def noxfile() -> ModuleType:
    """noxfile.py, loaded once: loading registers its sessions with nox."""
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_that_collects_no_tests_fails_the_session(noxfile: ModuleType) -> None:
    with pytest.raises(_Quit, match="collected no tests"):
        noxfile._pytest(_Session(5), "-q", "tests")


def test_passing_and_failing_runs_keep_their_outcome(noxfile: ModuleType) -> None:
    passing = _Session(0)
    noxfile._pytest(passing, "-q", "tests")
    assert passing.commands == [("python", "-m", "pytest", "-q", "tests", "-k", "no_such_test")]
    with pytest.raises(nox_command.CommandFailed):
        noxfile._pytest(_Session(1), "-q", "tests")
