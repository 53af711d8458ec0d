"""The simulated backend: exact data on numpy memory, virtual time, and a hazard checker.

``expertstream.backend("sim", profile="cuda-h200", devices=1, peer_access=True, data=True,
check_hazards=True)``. Kernels run as Python twins: the one ``Device.compile`` is given, else the one
registered under the kernel's name with ``register_kernel``.
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidArgument
from .backend import SimBackend
from .hazards import HazardKind, SimHazardError
from .kernels import Access, KernelSpec, register_kernel
from .profiles import BUILTIN_PROFILES, PROFILE_ENV, Profile, resolve_profile

AUTO_ORDER = 90  # the fallback of auto-detection: it runs everywhere
_OPTIONS = ("profile", "devices", "peer_access", "data", "check_hazards")


def probe() -> str | None:
    """The simulator runs everywhere."""
    return None


def open(**options: Any) -> SimBackend:
    """Open a simulated backend; see the module docstring for the options and their defaults."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InvalidArgument(
            f"unknown simulator option(s) {', '.join(unknown)}",
            call="backend('sim')",
            hint=f"options: {', '.join(_OPTIONS)}",
        )
    devices = options.get("devices", 1)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise InvalidArgument(f"devices must be a positive integer, got {devices!r}", call="backend('sim')")
    flags = {}
    for flag in ("peer_access", "data", "check_hazards"):
        value = options.get(flag, True)
        if not isinstance(value, bool):
            raise InvalidArgument(f"{flag} must be True or False, got {value!r}", call="backend('sim')")
        flags[flag] = value
    return SimBackend(resolve_profile(options.get("profile")), devices=devices, **flags)


__all__ = [
    "AUTO_ORDER",
    "BUILTIN_PROFILES",
    "PROFILE_ENV",
    "Access",
    "HazardKind",
    "KernelSpec",
    "Profile",
    "SimBackend",
    "SimHazardError",
    "open",
    "probe",
    "register_kernel",
]
