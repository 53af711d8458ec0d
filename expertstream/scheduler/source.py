"""What the scheduler copies from: host bytes behind a small protocol.

The scheduler owns this protocol; host memory modes implement it (a plain region of a host
buffer here, a pinned staging ring in ``expertstream.hostmem``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..backends.base import DeviceBuffer, HostBuffer, Stream
from ..errors import InvalidArgument


@runtime_checkable
class HostSource(Protocol):
    """Host bytes a scheduler can copy to a device: a HostBuffer region or a staging ring."""

    @property
    def nbytes(self) -> int: ...

    @property
    def blocks_host(self) -> bool:
        """True when enqueuing a copy from here can block the calling thread (pageable memory)."""
        ...

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        """Enqueue a copy of ``[offset, offset + nbytes)`` of this source into ``dst`` on ``stream``."""
        ...


@dataclass(frozen=True)
class HostRegion:
    """A byte range of a HostBuffer."""

    buffer: HostBuffer
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, HostBuffer):
            raise InvalidArgument(
                f"a host region is a range of a HostBuffer, not of a {type(self.buffer).__name__}",
                call="HostRegion",
                hint="wrap host memory with device.wrap_host() or alloc_pinned(); device-resident data enters a "
                "plan as Input(device_data=buffer.view())",
            )
        if self.start < 0 or self.length < 0 or self.start + self.length > self.buffer.nbytes:
            raise InvalidArgument(f"host region [{self.start}, {self.start + self.length}) is outside {self.buffer!r}")

    @property
    def nbytes(self) -> int:
        return self.length

    @property
    def blocks_host(self) -> bool:
        return not self.buffer.is_page_locked

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        self._check_range(offset, nbytes)
        stream.copy_h2d(dst, dst_offset, self.buffer, self.start + offset, nbytes)

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise InvalidArgument(f"range [{offset}, {offset + nbytes}) is outside a {self.length}-byte host region")


__all__ = ["HostRegion", "HostSource"]
