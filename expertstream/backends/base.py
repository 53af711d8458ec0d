"""The backend contract: every vendor backend implements exactly this, nothing more.

Public methods here validate their arguments once, for every backend, and then call a
small set of abstract ``_primitives`` that each backend fills in. A backend never returns
an error tuple: failures become one of the exceptions of ``expertstream.errors``, whose message
names the call, the device, the code and what the user can do about it.

This module is the contract's face: the classes live in ``backends/contract/`` by concern
(memory, streams, devices, host) and everything is imported from here.
"""

from __future__ import annotations

from .._deprecated import moved
from ..errors import (  # the contract raises these; importable from here as well
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
from ..ggml import RowType
from .contract.devices import UNASKED_SHARED_BYTES, Backend, Capabilities, Device, Vendor
from .contract.host import Host
from .contract.memory import (
    BufferView,
    DeviceBuffer,
    HostBuffer,
    HostMemory,
    RowGather,
    Usage,
    as_host_bytes,
    check_range,
    check_sharing,
    gathered_at_most,
)
from .contract.streams import Dim3, Event, Graph, Kernel, KernelArg, Stream, dim3

__all__ = [
    "UNASKED_SHARED_BYTES",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "BufferView",
    "Capabilities",
    "Device",
    "DeviceBuffer",
    "DeviceError",
    "Dim3",
    "Event",
    "ExpertStreamError",
    "Graph",
    "HazardError",
    "Host",
    "HostBuffer",
    "HostMemory",
    "InvalidArgument",
    "Kernel",
    "KernelArg",
    "KernelCompileError",
    "OutOfDeviceMemory",
    "RowGather",
    "RowType",
    "Stream",
    "Usage",
    "UseAfterClose",
    "Vendor",
    "as_host_bytes",
    "check_range",
    "check_sharing",
    "dim3",
    "gathered_at_most",
]

__getattr__ = moved(
    __name__,
    {
        "MATRIX_ROW_PADDING": "expertstream.ggml.MATRIX_ROW_PADDING",
        "is_quantized": "expertstream.ggml.is_quantized",
        "row_size": "expertstream.ggml.row_size",
        "padded_size": "expertstream.ggml.padded_size",
        "HostSource": "expertstream.scheduler.source.HostSource",
        "HostRegion": "expertstream.scheduler.source.HostRegion",
    },
)
