"""What the scheduler copies from: host bytes behind a small protocol.

The scheduler owns this protocol; host memory modes implement it (a plain region of a host
buffer here, a pinned staging ring in ``expertstream.hostmem``). A source may also name a
``Lookahead`` it shares with other sources: told the order of the whole-source copies to come,
it can prepare them before they are asked for (a staging ring fills its chunks ahead).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


@runtime_checkable
class Lookahead(Protocol):
    """What some sources share and can prepare copies with, when told their order in advance."""

    def expect(self, sources: Sequence[HostSource]) -> None:
        """The whole-source copies to come from ``sources`` (this lookahead's), in the order asked.

        Replaces an earlier list; an empty one ends it. Only a hint: copies asked for in another
        order, or of other ranges, are still exact, only not prepared.
        """
        ...


@runtime_checkable
class LookaheadSource(Protocol):
    """The optional part of a HostSource: the lookahead it shares with other sources."""

    @property
    def lookahead(self) -> Lookahead: ...


@runtime_checkable
class RangesSource(Protocol):
    """The optional part of a HostSource that copies several ranges better at once than one by one."""

    def enqueue_h2d_ranges(self, stream: Stream, dst: DeviceBuffer, ranges: Sequence[tuple[int, int]]) -> None:
        """Enqueue copies of each ``[start, end)`` of this source into the same offsets of ``dst``."""
        ...


def enqueue_ranges(source: HostSource, stream: Stream, dst: DeviceBuffer, ranges: Sequence[tuple[int, int]]) -> None:
    """Copy each ``[start, end)`` of ``source`` into the same offsets of ``dst``: at once where the source can."""
    if isinstance(source, RangesSource):
        source.enqueue_h2d_ranges(stream, dst, ranges)
        return
    with stream.device.backend.host.bare_calls():  # back to back: none of the job's work between them
        for start, end in ranges:
            source.enqueue_h2d(stream, dst, start, start, end - start)


@runtime_checkable
class StagedSource(Protocol):
    """The optional part of a HostSource that blocks its caller while it stages the bytes into
    page-locked memory and then DMAs them from there (a staging ring)."""

    @property
    def staged(self) -> bool: ...


def copies_pageable(source: HostSource) -> bool:
    """Whether copies from ``source`` read pageable memory.

    A wait enqueued on another stream after such a copy may resolve at the copy stream's tail
    (reported on ROCm), so the next lookahead copy must not go out before the consumer's wait.
    A staged source blocks its caller too, but its DMAs read page-locked chunks, which we take to
    resolve like any DMA (the report concerns pageable copies; not yet run on ROCm).
    """
    return source.blocks_host and not (isinstance(source, StagedSource) and source.staged)


def expect_copies(sources: Iterable[HostSource]) -> list[Lookahead]:
    """Tell each lookahead behind ``sources`` its part of this order of whole-source copies.

    Returns the lookaheads told, to end their lists with ``expect(())`` when the copies are over.
    Sources without a lookahead (plain host memory) need no telling.
    """
    told: dict[int, tuple[Lookahead, list[HostSource]]] = {}
    for source in sources:
        if isinstance(source, LookaheadSource):
            lookahead = source.lookahead
            told.setdefault(id(lookahead), (lookahead, []))[1].append(source)
    for lookahead, mine in told.values():
        lookahead.expect(mine)
    return [lookahead for lookahead, _ in told.values()]


@dataclass(frozen=True)
class HostRegion:
    """A byte range of a HostBuffer."""

    buffer: HostBuffer
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, HostBuffer):
            raise InvalidArgument(
                f"a host region is a range of a HostBuffer, not of {argument_kind(self.buffer)}",
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


def argument_kind(obj: object) -> str:
    """What was passed, in the contract's words (a backend's own buffer class is a DeviceBuffer)."""
    return "a DeviceBuffer (device memory)" if isinstance(obj, DeviceBuffer) else f"a {type(obj).__name__}"


__all__ = [
    "HostRegion",
    "HostSource",
    "Lookahead",
    "LookaheadSource",
    "RangesSource",
    "StagedSource",
    "argument_kind",
    "copies_pageable",
    "enqueue_ranges",
    "expect_copies",
]
