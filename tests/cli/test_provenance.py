"""The JSON's git_commit names the code that ran, installed from a clone too, and nothing it cannot show."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from expertstream.bench import provenance
from expertstream.bench.provenance import git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(folder: Path, *argv: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *argv],
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def clone_and_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str]:
    """A clone with a small expertstream/ committed, and a copy of it as pip installs one."""
    monkeypatch.setattr(provenance, "_install_origin", lambda: {})  # nothing recorded by pip
    clone = tmp_path / "clone"
    (clone / "expertstream" / "kernels").mkdir(parents=True)
    (clone / "expertstream" / "__init__.py").write_text("__version__ = '1'\n")
    (clone / "expertstream" / "kernels" / "moe.cu").write_text("// kernels\n")
    (clone / "README.md").write_text("not installed\n")
    _git(clone, "init", "-q")
    _git(clone, "add", ".")
    _git(clone, "commit", "-q", "-m", "first")
    installed = tmp_path / "site-packages" / "expertstream"
    shutil.copytree(clone / "expertstream", installed)
    (installed / "__pycache__").mkdir()
    (installed / "__pycache__" / "x.pyc").write_bytes(b"compiled")
    return clone, installed, _git(clone, "rev-parse", "HEAD")


def test_a_checkout_running_its_own_code_gives_its_head(clone_and_install: tuple[Path, Path, str]) -> None:
    clone, _, head = clone_and_install
    assert git_commit(clone / "expertstream") == head


def test_a_checkout_whose_files_are_not_its_head_says_so(clone_and_install: tuple[Path, Path, str]) -> None:
    """Uncommitted edits, or a tree copied over an older .git: the HEAD alone would name other code."""
    clone, _, head = clone_and_install
    (clone / "expertstream" / "kernels" / "moe.cu").write_text("// kernels, edited\n")
    assert git_commit(clone / "expertstream") == f"{head}-modified"
    (clone / "expertstream" / "kernels" / "moe.cu").write_text("// kernels\n")
    (clone / "expertstream" / "new.py").write_text("x = 1\n")  # a file HEAD does not have
    assert git_commit(clone / "expertstream") == f"{head}-modified"
    (clone / "expertstream" / "new.py").unlink()
    (clone / "expertstream" / "kernels" / "moe.cu").unlink()  # a file HEAD has, gone
    assert git_commit(clone / "expertstream") == f"{head}-modified"
    _git(clone, "checkout", "--", ".")
    (clone / ".gitignore").write_text("*.so\n")
    (clone / "expertstream" / "built.so").write_bytes(b"\x7fELF")  # ignored by git: not a change
    assert git_commit(clone / "expertstream") == head


def test_an_install_from_a_clone_is_found_from_the_clone(
    clone_and_install: tuple[Path, Path, str], tmp_path: Path
) -> None:
    clone, installed, head = clone_and_install
    assert git_commit(installed, cwd=clone) == head
    assert git_commit(installed, cwd=tmp_path) is None  # no checkout here: null, not a guess


def test_a_clone_that_moved_on_or_another_repository_is_not_taken(
    clone_and_install: tuple[Path, Path, str], tmp_path: Path
) -> None:
    clone, installed, _ = clone_and_install
    (clone / "expertstream" / "__init__.py").write_text("__version__ = '2'\n")
    _git(clone, "commit", "-q", "-am", "second")
    assert git_commit(installed, cwd=clone) is None  # its HEAD is not the code installed

    # a virtual environment inside some other repository: that repository's HEAD is not ours
    project = tmp_path / "project"
    venv_copy = project / ".venv" / "lib" / "site-packages" / "expertstream"
    shutil.copytree(installed, venv_copy)
    (project / "main.py").write_text("print()\n")
    _git(project, "init", "-q")
    _git(project, "add", "main.py")
    _git(project, "commit", "-q", "-m", "a project")
    assert git_commit(venv_copy, cwd=project) is None


def test_the_install_source_pip_recorded_is_used(
    clone_and_install: tuple[Path, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clone, installed, head = clone_and_install
    monkeypatch.setattr(provenance, "_install_origin", lambda: {"folder": clone})
    assert git_commit(installed, cwd=tmp_path) == head
    monkeypatch.setattr(provenance, "_install_origin", lambda: {"commit_id": "ab" * 20})
    assert git_commit(installed, cwd=tmp_path) == "ab" * 20
