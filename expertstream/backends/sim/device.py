"""A simulated GPU: memory accounting, streams, events, kernel twins, host memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import DeviceError, InvalidArgument, OutOfDeviceMemory
from ...timeline import OpKind
from ..base import (
    Capabilities,
    Device,
    HostBuffer,
    HostMemory,
    Kernel,
    Usage,
    as_host_bytes,
)
from ..dlpack import DLDeviceType
from .core import Simulation
from .hazards import Touch
from .kernels import SimKernel, checked_twin, lookup_kernel
from .memory import GARBAGE_BYTE, SimDeviceBuffer, SimHostBuffer, untouched_host_bytes
from .streams import SimEvent, SimStream

if TYPE_CHECKING:
    from .backend import SimBackend

_ALIGNMENT = 256


class SimDevice(Device):
    def __init__(self, backend: SimBackend, index: int, sim: Simulation, peer_access_allowed: bool) -> None:
        super().__init__(backend, index, sim.profile.device_name)
        self.sim = sim
        self._peer_access_allowed = peer_access_allowed
        self._peers: set[SimDevice] = set()  # devices, not indices: another backend's device 0 is not ours
        self._used = 0
        self._next_address = (index + 1) << 40  # distinct, plausible device addresses per device
        self._kernels: dict[str, SimKernel] = {}
        self.capturing_streams: set[int] = set()  # ids of this device's streams between begin and end capture

    # -- description ---------------------------------------------------------------------
    @property
    def total_memory(self) -> int:
        return self.sim.profile.memory_bytes

    def free_memory(self) -> int:
        with self.sim.lock:
            return self.total_memory - self._used

    @property
    def capabilities(self) -> Capabilities:
        profile = self.sim.profile
        return Capabilities(
            async_copies=True,
            events=True,
            host_register=profile.host_register,
            host_register_read_only=profile.host_register_read_only,
            peer_access=frozenset(peer.index for peer in self._peers),
            matrix_cores=profile.matrix_cores,
            int8_matrix_cores=profile.int8_matrix_cores,
            mma_fragments=profile.mma_fragments,
            max_shared_bytes=profile.max_shared_bytes,
        )

    @property
    def arch(self) -> str:
        return self.sim.profile.name

    @property
    def dlpack_device(self) -> tuple[DLDeviceType, int]:
        """Simulated device bytes are numpy arrays: other libraries see them as CPU memory."""
        return (DLDeviceType.CPU, 0)

    # -- device memory -------------------------------------------------------------------
    def _alloc(self, nbytes: int, alloc_size: int, usage: Usage) -> SimDeviceBuffer:
        if self.capturing_streams:  # what CUDA and HIP answer in their default (global) capture mode
            raise DeviceError(
                "operation not permitted when stream is capturing",
                call="Device.alloc",
                device=self.label,
                code="stream capture unsupported",
                hint="allocate what the captured work needs before the capture begins",
            )
        with self.sim.lock:
            free = self.free_memory()
            if alloc_size > free:
                raise OutOfDeviceMemory(
                    f"cannot allocate {alloc_size} bytes: {free} of {self.total_memory} bytes free",
                    call="Device.alloc",
                    device=self.label,
                    hint="free buffers first, or allocate fewer or smaller ones",
                )
            array = None
            if self.sim.data:
                try:
                    array = np.full(alloc_size, GARBAGE_BYTE, dtype=np.uint8)
                except MemoryError:
                    raise OutOfDeviceMemory(
                        f"the host memory behind the simulated device cannot hold {alloc_size} bytes",
                        call="Device.alloc",
                        device=self.label,
                        hint="open the simulator with data=False for runs at full scale",
                    ) from None
            address = self._next_address
            self._next_address += -(-max(alloc_size, 1) // _ALIGNMENT) * _ALIGNMENT
            self._used += alloc_size
            return SimDeviceBuffer(self, nbytes, alloc_size, usage, address, array)

    def release(self, buffer: SimDeviceBuffer) -> None:
        """Called when a buffer closes: refuse while work may still use it, else return its memory."""
        self.sim.check_release(buffer, "DeviceBuffer.close")
        with self.sim.lock:
            self._used -= buffer.alloc_size

    # -- streams, events, kernels --------------------------------------------------------
    def stream(self, name: str | None = None) -> SimStream:
        """A new stream; ``name`` labels it in the timeline (default "stream <id>")."""
        return SimStream(self, self.sim.new_stream(self.index, self.label, name))

    def stream_from_handle(self, handle: int) -> SimStream:
        call = "Device.stream_from_handle"
        state = self.sim.stream_by_id(int(handle)) if isinstance(handle, (int, np.integer)) else None
        if state is None or state.destroyed:
            raise InvalidArgument(
                f"no live simulated stream has handle {handle!r}",
                call=call,
                device=self.label,
                hint="pass the .handle of a stream of this device that is not closed",
            )
        if state.device != self.index:
            raise InvalidArgument(
                f"stream {handle} belongs to {state.device_label}",
                call=call,
                device=self.label,
                hint="wrap it with that device",
            )
        return SimStream(self, state, owned=False)

    def event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def compile(self, source: str, name: str, twin: object | None = None, chained: bool = False) -> Kernel:
        """Kernel ``name`` running ``twin`` (a KernelSpec of that name), else the twin registered under it."""
        spec = lookup_kernel(name, self.label) if twin is None else checked_twin(twin, name, self.label)
        kernel = self._kernels.get(name)
        if kernel is None or kernel.spec is not spec:
            kernel = self._kernels[name] = SimKernel(self, spec)
        return kernel

    def synchronize(self) -> None:
        self.sim.synchronize_device(self.index, self.label)

    def enable_peer_access(self, other: Device) -> None:
        call = "Device.enable_peer_access"
        if not isinstance(other, SimDevice) or other.backend is not self.backend:
            raise InvalidArgument(f"{other!r} is not a device of this backend", call=call, device=self.label)
        if other is self:
            raise InvalidArgument("a device cannot be its own peer", call=call, device=self.label)
        if not self._peer_access_allowed:
            raise DeviceError(
                f"peer access from {self.label} to {other.label} is not available",
                call=call,
                device=self.label,
                hint="open the simulator with peer_access=True, or stage the data through host memory",
            )
        self._peers.add(other)

    def can_access_peer(self, other: Device) -> bool:
        return other is self or other in self._peers

    # -- host memory ---------------------------------------------------------------------
    def alloc_pinned(self, nbytes: int) -> HostBuffer:
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise InvalidArgument(f"cannot allocate {nbytes!r} bytes", call="Device.alloc_pinned", device=self.label)
        if not self.sim.data:
            return self.placeholder_host(int(nbytes), HostMemory.PINNED)
        array = np.empty(int(nbytes), dtype=np.uint8)
        return SimHostBuffer(self, array, HostMemory.PINNED, owner=array)

    def placeholder_host(self, nbytes: int, kind: HostMemory = HostMemory.PAGEABLE) -> HostBuffer:
        """Host memory of ``nbytes`` that takes no RAM until written: stands for weights in timing-only runs."""
        if kind is HostMemory.REGISTERED:
            raise InvalidArgument(
                "placeholder memory is pageable or pinned",
                call="SimDevice.placeholder_host",
                hint="register() it afterwards",
            )
        array, owner = untouched_host_bytes(int(nbytes))
        return SimHostBuffer(self, array, kind, owner=owner)

    def wrap_host(self, obj: Any) -> HostBuffer:
        array, owner = as_host_bytes(obj)
        return SimHostBuffer(self, array, HostMemory.PAGEABLE, owner=owner)

    def _check_host_access(self, host: HostBuffer, offset: int, nbytes: int, write: bool, call: str) -> None:
        what = "host write (numpy view)" if write else "host read (numpy view)"
        self.sim.host_access((Touch(host, offset, offset + nbytes, write=write),), what, call)

    def _host_register(self, host: HostBuffer, read_only: bool) -> None:
        profile = self.sim.profile
        if not profile.host_register:
            raise DeviceError(
                f"host registration is not supported by simulator profile {profile.name!r}",
                call="HostBuffer.register",
                device=self.label,
                hint="copy the data into pinned memory instead",
            )
        self.sim.host_work(OpKind.HOST_REGISTER, "host register", host.nbytes / profile.host_register_bps, host.nbytes)

    def _host_unregister(self, host: HostBuffer) -> None:
        self.sim.check_release(host, "HostBuffer.unregister")

    def _host_free_pinned(self, host: HostBuffer) -> None:
        self.sim.check_release(host, "HostBuffer.close")


__all__ = ["SimDevice"]
