"""Old import paths kept for one release: the name still resolves, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

REMOVED_IN = "0.3"


def moved(module: str, targets: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each old name in ``targets`` to ``"new.module.Name"``."""

    def __getattr__(name: str) -> Any:
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, attr = target.rpartition(".")
        warnings.warn(
            f"{module}.{name} moved to {target}; the old name goes away in {REMOVED_IN}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_module), attr)

    return __getattr__


def alias_module(old: str, new: str) -> None:
    """Make the module being imported as ``old`` the module ``new``, with a DeprecationWarning."""
    warnings.warn(f"{old} moved to {new}; the old name goes away in {REMOVED_IN}", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
