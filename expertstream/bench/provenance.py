"""Where a measurement came from: package version and commit, device, driver, libraries, command line."""

from __future__ import annotations

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


def git_commit() -> str | None:
    """The commit of the source tree this package runs from, when it is a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


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
