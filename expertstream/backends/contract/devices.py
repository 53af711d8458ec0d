"""The contract's devices and backends: what one GPU offers and the vendor runtime that holds them."""

from __future__ import annotations

import abc
import enum
import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ... import ggml
from ..._closing import Closing
from ...errors import InvalidArgument
from ...ggml import RowType
from ..dlpack import DLDeviceType, event_handle, stream_handle
from ..tracing import EventTracer
from .host import Host
from .memory import DeviceBuffer, HostBuffer, HostMemory, Usage, as_host_bytes
from .streams import Event, Kernel, Stream

if TYPE_CHECKING:
    from ...timeline import TimelineOp


class Vendor(enum.Enum):
    NVIDIA = "nvidia"
    AMD = "amd"
    SIM = "sim"


UNASKED_SHARED_BYTES = 48 * 1024  # dynamic shared memory any kernel may launch with on every vendor


@dataclass(frozen=True)
class Capabilities:
    async_copies: bool
    events: bool
    host_register: bool
    host_register_read_only: bool
    peer_access: frozenset[int] = field(default_factory=frozenset)  # device indices reachable
    # 16x16x16 bf16 and f16 matrix instructions the kernels use (mul_mat_id's matrix-core path, attention's
    # prefill): NVIDIA sm_80+, AMD gfx90a/gfx94x, gfx11, gfx12
    matrix_cores: bool = False
    # int8 matrix instructions the int8 kernels use (NVIDIA sm_80+: mma.sync m16n8k32 s8)
    int8_matrix_cores: bool = False
    # NVIDIA's mma.sync register fragments (sm_80+), into which direct.cu's kernels decode weights
    mma_fragments: bool = False
    # kernels launched chained to the one before them (NVIDIA sm_90+: programmatic dependent launch),
    # so a kernel's launch overlaps the work of the one it waits for
    chained_launches: bool = False
    # the most shared memory one block may use (NVIDIA: what a kernel may opt into beyond 48 KB;
    # AMD: a workgroup's LDS); Stream.launch holds a launch's dynamic shared memory to it, so a kernel
    # that also declares static shared memory must count that itself
    max_shared_bytes: int = UNASKED_SHARED_BYTES


class Device(abc.ABC):
    """One GPU (or one simulated GPU)."""

    foreign_handles: ClassVar[bool] = False  # whether streams and events of other libraries can exist here

    def __init__(self, backend: Backend, index: int, name: str) -> None:
        self.backend = backend
        self.index = index
        self.name = name
        self._utility: Stream | None = None
        self._utility_lock = threading.Lock()
        self._page_locked_bytes = 0

    @property
    def label(self) -> str:
        return f"{self.backend.name}:{self.index}"

    @property
    def page_locked_bytes(self) -> int:
        """Host memory page-locked through this device and not yet released (pinned and registered)."""
        return self._page_locked_bytes

    def _count_page_locked(self, nbytes: int) -> None:
        with self._utility_lock:
            self._page_locked_bytes += nbytes

    # -- primitives ---------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def total_memory(self) -> int: ...

    @abc.abstractmethod
    def free_memory(self) -> int: ...

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @property
    @abc.abstractmethod
    def arch(self) -> str:
        """Compile target: 'sm_90', 'gfx942', or the simulator's profile name."""

    @abc.abstractmethod
    def _alloc(self, nbytes: int, alloc_size: int, usage: Usage) -> DeviceBuffer:
        """Allocate ``alloc_size`` bytes; raise OutOfDeviceMemory naming asked and free bytes."""

    @abc.abstractmethod
    def stream(self) -> Stream:
        """A new non-blocking stream."""

    @abc.abstractmethod
    def stream_from_handle(self, handle: int) -> Stream:
        """Wrap a native stream handle; the wrapper does not own it."""

    def event_from_handle(self, handle: int, timing: bool = False) -> Event:
        """Wrap a native event handle; the wrapper does not own it (``timing``: it was created with timing)."""
        raise InvalidArgument(
            f"the {self.backend.name} backend has no native event handles",
            call="Device.event_from_handle",
            device=self.label,
        )

    @property
    @abc.abstractmethod
    def dlpack_device(self) -> tuple[DLDeviceType, int]:
        """Where this device's buffers live for DLPack: (device type, device id)."""

    @abc.abstractmethod
    def event(self, timing: bool = False) -> Event: ...

    @abc.abstractmethod
    def compile(self, source: str, name: str, twin: object | None = None, chained: bool = False) -> Kernel:
        """Compile ``extern "C" __global__`` source and return kernel ``name`` (cached).

        ``twin``: what a backend that runs kernels on the host runs instead (the simulator takes a
        ``sim.KernelSpec``, else the one registered under ``name``); GPU backends ignore it.
        ``chained``: the kernel opens by waiting for the kernels before it to finish (the package's
        ``KERNEL_PROLOGUE``), so it may be launched chained to them (``Capabilities.chained_launches``);
        any other kernel is launched on its own.
        """

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work on this device is done."""

    @abc.abstractmethod
    def enable_peer_access(self, other: Device) -> None:
        """Let this device's kernels and copies touch ``other``'s memory."""

    @abc.abstractmethod
    def alloc_pinned(self, nbytes: int) -> HostBuffer: ...

    @abc.abstractmethod
    def _host_register(self, host: HostBuffer, read_only: bool) -> None: ...

    @abc.abstractmethod
    def _host_unregister(self, host: HostBuffer) -> None: ...

    @abc.abstractmethod
    def _host_free_pinned(self, host: HostBuffer) -> None: ...

    # -- validated API ------------------------------------------------------------------
    def alloc_size(self, nbytes: int, row_type: RowType | None = None, ne0: int | None = None) -> int:
        """Bytes to allocate for a tensor, including the quantized-row padding kernels read."""
        return ggml.padded_size(nbytes, row_type, ne0)

    def alloc(
        self,
        nbytes: int,
        usage: Usage = Usage.ANY,
        *,
        row_type: RowType | None = None,
        ne0: int | None = None,
    ) -> DeviceBuffer:
        """Allocate a buffer for ``nbytes`` of tensor data (plus padding for ``row_type``/``ne0``).

        The padding of WEIGHTS and ANY buffers is zeroed here; COMPUTE buffers are left as
        they are, and whoever fills one must clear the padding it relies on.
        """
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise InvalidArgument(f"cannot allocate {nbytes!r} bytes", call="Device.alloc", device=self.label)
        if not isinstance(usage, Usage):
            raise InvalidArgument(f"usage must be a Usage member, got {usage!r}", call="Device.alloc")
        size = self.alloc_size(int(nbytes), row_type, ne0)
        buf = self._alloc(int(nbytes), size, usage)
        if usage is not Usage.COMPUTE and size > nbytes:
            try:
                stream = self._utility_stream()
                stream.memset(buf, int(nbytes), size - int(nbytes), 0)
                stream.synchronize()
            except BaseException:
                buf.close()
                raise
        return buf

    def upload(self, data: Any, usage: Usage = Usage.ANY) -> DeviceBuffer:
        """Allocate a buffer holding a copy of ``data`` (synchronous)."""
        arr, _ = as_host_bytes(data)
        buf = self.alloc(arr.nbytes, usage)
        try:
            buf.write(arr)
        except BaseException:
            buf.close()
            raise
        return buf

    def stream_from(self, obj: Any) -> Stream:
        """Wrap a stream of this device made elsewhere; closing the wrapper leaves it alone.

        Takes a Stream of this device, an int handle, and on GPUs a torch.cuda.Stream, a CuPy
        stream or any object with ``__cuda_stream__``. Anything else is an InvalidArgument
        naming its type.
        """
        if isinstance(obj, Stream):
            if obj.device is not self:
                raise InvalidArgument(
                    f"the stream belongs to {obj.device.label}", call="Device.stream_from", device=self.label
                )
            return self.stream_from_handle(obj.handle)
        return self.stream_from_handle(stream_handle(obj, self, foreign=self.foreign_handles))

    def event_from(self, obj: Any, timing: bool = False) -> Event:
        """Wrap an event made elsewhere (an int handle, torch.cuda.Event, CuPy event); not owned."""
        if isinstance(obj, Event):
            raise InvalidArgument(
                f"{obj!r} is an event of this library already; use it as it is", call="Device.event_from"
            )
        return self.event_from_handle(event_handle(obj, self, foreign=self.foreign_handles), timing)

    def wrap_host(self, obj: Any) -> HostBuffer:
        """Wrap a numpy array, bytes-like object or mmap as pageable host memory (no copy)."""
        arr, owner = as_host_bytes(obj)
        return HostBuffer(self, arr, HostMemory.PAGEABLE, owner=owner)

    def can_access_peer(self, other: Device) -> bool:
        """Whether this device's kernels and copies may touch ``other``'s memory (a device of this backend)."""
        return other is self or (other.backend is self.backend and other.index in self.capabilities.peer_access)

    def _check_host_access(  # noqa: B027 - a no-op unless a backend checks host accesses
        self, host: HostBuffer, offset: int, nbytes: int, write: bool, call: str
    ) -> None:
        """The calling thread is about to read (or write) these host bytes; the simulator checks them."""

    def _utility_stream(self) -> Stream:
        with self._utility_lock:
            if self._utility is None or self._utility.closed:
                self._utility = self.stream()
            return self._utility

    def close(self) -> None:
        if self._utility is not None:
            self._utility.close()
            self._utility = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label} {self.name!r}>"


class Backend(abc.ABC, Closing):
    """One vendor runtime and its devices. Exactly one is active per use; see backends.backend()."""

    name: ClassVar[str]
    vendor: ClassVar[Vendor]
    _tracer: EventTracer | None = None
    _opened: ClassVar[dict[str, Iterator[int]]] = {}  # backend name -> the numbers of those opened

    def __init__(self, host: Host | None = None) -> None:
        # The host's clock, memcpy and staging-ring defaults: this host as it is, or the simulator's.
        self.host = Host() if host is None else host
        self._number = next(Backend._opened.setdefault(self.name, itertools.count(1)))

    @property
    def instance_name(self) -> str:
        """The name and the number of this backend among those of its name opened in this process
        ("sim#2"): what tells apart devices of two of them, whose labels are alike ("sim:0")."""
        return f"{self.name}#{self._number}"

    @property
    @abc.abstractmethod
    def devices(self) -> Sequence[Device]: ...

    def device(self, index: int = 0) -> Device:
        devs = self.devices
        if not 0 <= index < len(devs):
            raise InvalidArgument(
                f"no device {index}; this backend has {len(devs)}",
                call="Backend.device",
                hint=f"use an index in 0..{len(devs) - 1}",
            )
        return devs[index]

    def close(self) -> None:
        if self._tracer is not None:
            self._tracer.close()
            self._tracer = None
        for d in self.devices:
            d.close()

    @property
    def timeline(self) -> Sequence[TimelineOp] | None:
        """Every operation with its start and end: always on the simulator, after start_trace() elsewhere."""
        return None if self._tracer is None else self._tracer.timeline()

    def mark(self, name: str) -> None:
        """Note the moment ``name`` (a phase of a run beginning) in the timeline, where one is kept."""
        if self._tracer is not None:
            self._tracer.mark(name)

    @contextmanager
    def profiler_range(self) -> Iterator[None]:
        """The work inside is what a vendor profiler started with profiling off records (ncu's
        ``--profile-from-start off``); where the backend has no such control, it runs as it would."""
        yield

    def start_trace(self) -> None:
        """Record every copy, memset and kernel from now on, for ``timeline``.

        Costs two timing events per operation; a backend that always records (the simulator)
        ignores it.
        """
        if self._tracer is None and self.timeline is None:
            self._tracer = EventTracer()

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description: name, vendor, devices with memory and capabilities."""
        return {
            "name": self.name,
            "vendor": self.vendor.value,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "arch": d.arch,
                    "total_memory": d.total_memory,
                    "free_memory": d.free_memory(),
                    "capabilities": {
                        "async_copies": d.capabilities.async_copies,
                        "events": d.capabilities.events,
                        "host_register": d.capabilities.host_register,
                        "host_register_read_only": d.capabilities.host_register_read_only,
                        "peer_access": sorted(d.capabilities.peer_access),
                        "matrix_cores": d.capabilities.matrix_cores,
                        "int8_matrix_cores": d.capabilities.int8_matrix_cores,
                        "mma_fragments": d.capabilities.mma_fragments,
                        "chained_launches": d.capabilities.chained_launches,
                        "max_shared_bytes": d.capabilities.max_shared_bytes,
                    },
                }
                for d in self.devices
            ],
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {len(self.devices)} device(s)>"


__all__ = ["Backend", "Capabilities", "Device", "Vendor"]
