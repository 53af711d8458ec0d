"""Backend registry: pick one vendor backend by name, environment variable or auto-detection.

Each backend module exposes ``probe() -> str | None`` (None when usable, else the reason it
is not) and ``open(**options) -> Backend``. Modules are imported lazily so that a machine
without a vendor library never imports it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable, InvalidArgument
from .base import Backend

ENV_VAR = "EXPERTSTREAM_BACKEND"
_MODULES = {"cuda": ".cuda", "hip": ".hip", "sim": ".sim"}
_AUTO_ORDER = ("cuda", "hip", "sim")


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    reason: str  # empty when usable


def _module(name: str) -> Any:
    return importlib.import_module(_MODULES[name], __name__)


def _probe(name: str) -> str | None:
    try:
        mod = _module(name)
    except ImportError as exc:  # the module itself imports only the stdlib and numpy
        return f"cannot import the {name} backend: {exc}"
    reason: str | None = mod.probe()
    return reason


def available_backends() -> list[BackendStatus]:
    """Every known backend, whether it can run here, and why not."""
    out = []
    for name in _MODULES:
        reason = _probe(name)
        out.append(BackendStatus(name, reason is None, reason or ""))
    return out


def auto_choice() -> str:
    """The backend name ``backend("auto")`` opens: $EXPERTSTREAM_BACKEND, else the first usable of cuda, hip, sim."""
    chosen = os.environ.get(ENV_VAR, "").strip().lower()
    if chosen:
        return chosen
    for candidate in _AUTO_ORDER:
        if _probe(candidate) is None:
            return candidate
    raise BackendUnavailable("no backend is usable, not even the simulator")  # pragma: no cover


def backend(name: str = "auto", **options: Any) -> Backend:
    """Open a backend: an explicit name wins, then $EXPERTSTREAM_BACKEND, then auto-detection.

    Auto picks cuda if a usable NVIDIA device exists, else hip if a usable AMD device
    exists, else the simulator. An explicit name never falls back: if it cannot run,
    BackendUnavailable says why and what else is usable.
    """
    from_env = name == "auto" and bool(os.environ.get(ENV_VAR, "").strip())
    if name == "auto":
        name = auto_choice()
    if name not in _MODULES:
        raise InvalidArgument(
            f"unknown backend {name!r}", call="expertstream.backend", hint=f"choose one of auto, {', '.join(_MODULES)}"
        )
    reason = _probe(name)
    if reason is not None:
        usable = [s.name for s in available_backends() if s.usable]
        raise BackendUnavailable(
            reason,
            call=f"expertstream.backend({name!r})",
            hint=f"usable here: {', '.join(usable) or 'none'}; "
            + (f"set {ENV_VAR} to one of them or unset it" if from_env else "pass one of them"),
        )
    return _module(name).open(**options)


__all__ = ["BackendStatus", "auto_choice", "available_backends", "backend"]
