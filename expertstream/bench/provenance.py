"""Where a measurement came from: package version and commit, device, driver, libraries, command line."""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import __version__
from ..backends.base import Backend

log = logging.getLogger(__name__)

LIBRARIES = ("numpy", "gguf", "cuda-bindings", "cuda-python", "hip-python")


PACKAGE = Path(__file__).resolve().parents[1]  # the expertstream folder this code runs from


def git_commit(package: Path = PACKAGE, cwd: Path | None = None) -> str | None:
    """The commit this package's code is, or None where no checkout shows which.

    Run from a checkout (an editable install, or PYTHONPATH), its HEAD, with "-modified" after it
    where git sees the package's files changed, added or removed against HEAD (uncommitted edits, or
    a copied tree whose .git is older than its files; files git ignores do not count). Installed (``pip install .``
    copies the files away from the clone): the commit pip recorded for an install from a git URL,
    else the HEAD of a checkout whose expertstream/ at HEAD holds exactly the installed files: the
    folder pip installed from, or the current working directory (``cwd``).
    """
    top = _git(package, "rev-parse", "--show-toplevel")
    if top is not None and (Path(top).resolve() / package.name) == package.resolve():
        head = _git(package, "rev-parse", "HEAD")
        changes = _git(package, "status", "--porcelain", "--untracked-files=normal", "--", ".")
        return head if head is None or not changes else f"{head}-modified"
    origin = _install_origin()
    if origin.get("commit_id"):
        return str(origin["commit_id"])
    for folder in (origin.get("folder"), cwd or Path.cwd()):
        if folder is not None and (commit := _checkout_holding(package, Path(folder))) is not None:
            return commit
    return None


def _git(folder: Path, *argv: str) -> str | None:
    """The output of ``git argv`` run in ``folder`` (None where it fails: no git, no checkout)."""
    try:
        done = subprocess.run(["git", *argv], cwd=folder, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _install_origin() -> dict[str, Any]:
    """What pip recorded of where it installed this package from (PEP 610's direct_url.json)."""
    try:
        text = metadata.distribution("expertstream").read_text("direct_url.json")
        recorded = json.loads(text or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return {}
    url = str(recorded.get("url", ""))
    commit = recorded.get("vcs_info", {}).get("commit_id")
    folder = Path(url.removeprefix("file://")) if url.startswith("file://") and "dir_info" in recorded else None
    return {"commit_id": commit, "folder": folder}


def _checkout_holding(package: Path, folder: Path) -> str | None:
    """HEAD of the checkout around ``folder`` if its expertstream/ at HEAD holds every file of ``package``."""
    head = _git(folder, "rev-parse", "HEAD")
    top = _git(folder, "rev-parse", "--show-toplevel")
    listing = None if top is None else _git(Path(top), "ls-tree", "-r", "HEAD", package.name)
    if head is None or listing is None:
        return None
    committed = {}  # path under the package -> the blob's hash
    for line in listing.splitlines():
        info, path = line.split("\t", 1)
        committed[path.removeprefix(f"{package.name}/")] = info.split()[2]
    for file in package.rglob("*"):
        if file.is_file() and "__pycache__" not in file.parts:
            data = file.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
            if committed.get(file.relative_to(package).as_posix()) != blob:
                return None
    return head


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries a backend or the model code relies on."""
    versions: dict[str, str] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def provenance(backend: Backend, device: int | Sequence[int], command_line: str) -> dict[str, Any]:
    """JSON-ready facts that make a result reproducible and comparable (``device``: index or layer split)."""
    described = backend.describe()
    devices = described.get("devices", [])
    split = [device] if isinstance(device, int) else list(device)
    device = split[0]
    return {
        "version": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "device_index": device,
        "device_split": split,  # the devices the layers are split over, in order
        "device_arch": devices[device]["arch"] if device < len(devices) else None,
        "driver_version": described.get("driver_version"),
        "bindings_version": described.get("bindings_version"),
        "libraries": library_versions(),
        "command_line": command_line,
    }
