"""Backend registry: pick one backend by name, environment variable or auto-detection.

Backends are found through the ``expertstream.backends`` entry-point group, the built-in ones
included (see pyproject.toml), so a third-party package adds a vendor by declaring one entry
point that names its module. A backend module exposes:

- ``probe() -> str | None``: None when usable here, else the reason it is not;
- ``open(**options) -> Backend``;
- ``AUTO_ORDER: int | None``: its place in auto-detection (lower is tried first), None to be
  used only when named.

Modules are imported lazily, so a machine without a vendor library never imports it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..errors import BackendUnavailable, InvalidArgument
from .base import Backend

log = logging.getLogger(__name__)

ENV_VAR = "EXPERTSTREAM_BACKEND"
ENTRY_POINT_GROUP = "expertstream.backends"
DISTRIBUTION = "expertstream"
# What pyproject.toml registers; used only when running from a source tree that was never
# installed, where no entry-point metadata exists.
_SOURCE_TREE_BUILTINS = {name: f"{__name__}.{name}" for name in ("cuda", "hip", "sim")}


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    reason: str  # empty when usable


def _registered() -> dict[str, str]:
    """Backend name -> module path, from the entry-point group (read on every call: cheap)."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        log.debug("expertstream is not installed: using the built-in backends of the source tree")
        found = {**_SOURCE_TREE_BUILTINS, **found}
    return found


def _module(name: str) -> ModuleType:
    return importlib.import_module(_registered()[name])


def _probe(name: str) -> str | None:
    try:
        mod = _module(name)
    except ImportError as exc:  # a backend module imports only light dependencies at import time
        return f"cannot import the {name} backend: {exc}"
    reason: str | None = mod.probe()
    return reason


def _auto_order() -> list[str]:
    ranked = []
    for name in _registered():
        try:
            order = getattr(_module(name), "AUTO_ORDER", None)
        except ImportError:
            continue
        if order is not None:
            ranked.append((order, name))
    return [name for _, name in sorted(ranked)]


def available_backends() -> list[BackendStatus]:
    """Every registered backend, whether it can run here, and why not."""
    out = []
    for name in sorted(_registered()):
        reason = _probe(name)
        out.append(BackendStatus(name, reason is None, reason or ""))
    return out


def resolve_name(name: str = "auto") -> str:
    """The backend ``backend(name)`` would open: explicit name, else $EXPERTSTREAM_BACKEND, else auto."""
    if name == "auto":
        name = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if name == "auto":
        for candidate in _auto_order():
            if _probe(candidate) is None:
                return candidate
        raise BackendUnavailable("no backend is usable, not even the simulator")  # pragma: no cover
    return name


def backend(name: str = "auto", **options: Any) -> Backend:
    """Open a backend: an explicit name wins, then $EXPERTSTREAM_BACKEND, then auto-detection.

    Auto tries the registered backends by their ``AUTO_ORDER`` (cuda, then hip, then the
    simulator among the built-in ones). An explicit name never falls back: if it cannot run,
    BackendUnavailable says why and what else is usable.
    """
    from_env = name == "auto" and bool(os.environ.get(ENV_VAR, "").strip())
    name = resolve_name(name)
    registered = _registered()
    if name not in registered:
        raise InvalidArgument(
            f"unknown backend {name!r}",
            call="expertstream.backend",
            hint=f"choose one of auto, {', '.join(sorted(registered))}",
        )
    reason = _probe(name)
    if reason is not None:
        usable = [s.name for s in available_backends() if s.usable]
        hint = f"usable here: {', '.join(usable) or 'none'}"
        hint += f"; set {ENV_VAR} to one of them or unset it" if from_env else "; pass one of them"
        raise BackendUnavailable(reason, call=f"expertstream.backend({name!r})", hint=hint)
    opened: Backend = _module(name).open(**options)
    return opened


__all__ = ["ENTRY_POINT_GROUP", "ENV_VAR", "BackendStatus", "available_backends", "backend", "resolve_name"]
