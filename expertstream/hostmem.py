"""Host-resident tensor data as the scheduler sees it: a region it can enqueue a copy from.

A region of a plain HostBuffer copies with one ``stream.copy_h2d``; other sources (a pinned
staging ring fed from a file mapping) implement the same two members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .backends.base import DeviceBuffer, HostBuffer, InvalidArgument, Stream


@runtime_checkable
class HostSource(Protocol):
    """Bytes in host memory that can be copied to a device buffer."""

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
        if self.start < 0 or self.length < 0 or self.start + self.length > self.buffer.nbytes:
            raise InvalidArgument(
                f"host region [{self.start}, {self.start + self.length}) is outside {self.buffer!r}"
            )

    @property
    def nbytes(self) -> int:
        return self.length

    @property
    def blocks_host(self) -> bool:
        return not self.buffer.is_page_locked

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.length:
            raise InvalidArgument(f"range [{offset}, {offset + nbytes}) is outside a {self.length}-byte host region")
        stream.copy_h2d(dst, dst_offset, self.buffer, self.start + offset, nbytes)
