"""expertstream: stream host-resident MoE expert weights to the GPU ahead of the compute that needs them."""

from __future__ import annotations

from typing import Any

from .backends import BackendStatus, available_backends, backend
from .backends.base import Backend, HostMemory, Usage, Vendor
from .errors import (
    BackendError,
    BackendUnavailable,
    DeviceError,
    ExpertStreamError,
    HazardError,
    InvalidArgument,
    KernelCompileError,
    OutOfDeviceMemory,
    UseAfterClose,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``Model`` and ``Sampling`` load the engine on first use: importing the package stays light."""
    if name in ("Model", "Sampling"):
        from .engine import model, sampling

        return {"Model": model.Model, "Sampling": sampling.Sampling}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Backend",
    "BackendError",
    "BackendStatus",
    "BackendUnavailable",
    "DeviceError",
    "ExpertStreamError",
    "HazardError",
    "HostMemory",
    "InvalidArgument",
    "KernelCompileError",
    "Model",
    "OutOfDeviceMemory",
    "Sampling",
    "Usage",
    "UseAfterClose",
    "Vendor",
    "__version__",
    "available_backends",
    "backend",
]
