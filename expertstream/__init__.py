"""expertstream: stream host-resident MoE expert weights to the GPU ahead of the compute that needs them."""

from __future__ import annotations

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
    "OutOfDeviceMemory",
    "Usage",
    "UseAfterClose",
    "Vendor",
    "__version__",
    "available_backends",
    "backend",
]
