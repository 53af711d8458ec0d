"""The hazard checker: finds missing orderings between device operations as they are enqueued.

Happens-before is tracked with vector clocks. Every stream and every host thread is an
agent with a clock; an operation gets its stream's clock joined with the enqueuing thread's
(what the host knew when it enqueued), plus the clocks of the events its stream waited for.
An earlier operation E is ordered before a later one whose clock is C iff
``C[E.agent] >= E.seq``. Per buffer an interval map keeps, for every byte range, the last
writer and the latest reader of each agent, so a check costs a few dictionary lookups.

Host buffers are tracked where device work reaches them after the call that enqueued it
returned (page-locked memory, which the DMA reads or writes in place), and so are host-side
accesses to them (host copies, numpy views handed out): a host thread's accesses are
operations of its own agent, checked against device work like any other.
"""

from __future__ import annotations

import enum
import functools
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ...errors import HazardError
from ..base import DeviceBuffer, HostBuffer, Usage

VectorClock = dict[int, int]

_ORDERING_HINT = "record an event after the earlier operation and make the later one's stream wait for it"
_HOST_HINT = "synchronize the stream, or an event recorded after that work, before the host touches those bytes"
_HANDOFF_HINT = (
    "enqueue from the thread that touched the bytes, or hand its backend.host.timestamp() to the enqueuing "
    "thread's backend.host.resume_at() first"
)


class HazardKind(enum.Enum):
    READ_AFTER_WRITE = "read-after-write"
    UNINITIALIZED_READ = "uninitialized read"
    WRITE_AFTER_READ = "write-after-read"
    WRITE_AFTER_WRITE = "write-after-write"
    USE_AFTER_FREE = "use-after-free"
    CROSS_DEVICE = "cross-device"
    STALE_PADDING = "stale padding"


class SimHazardError(HazardError):
    """A hazard found by the simulator; ``kind`` says which."""

    def __init__(self, kind: HazardKind, message: str, *, call: str, device: str, hint: str) -> None:
        self.kind = kind
        super().__init__(message, call=call, device=device, hint=hint)


@dataclass(frozen=True)
class OpInfo:
    """An enqueued operation as the checker remembers it."""

    agent: int  # the stream's agent id (its stream id)
    seq: int  # position on that stream
    what: str  # "h2d copy", "memset", "kernel 'name'", ...
    stream_name: str
    device: str
    zero_fill: bool = False  # a memset with value 0: what padding must have been last written by

    @property
    def on_host(self) -> bool:
        return self.agent < 0  # host threads have negative agent ids

    @property
    def short(self) -> str:
        return f"{self.what} on {self.stream_name}" if self.on_host else f"{self.what} on stream {self.agent}"

    def __str__(self) -> str:
        if self.on_host:
            return self.short
        return f"{self.what} on stream {self.agent} ({self.stream_name!r} on {self.device})"


@dataclass(frozen=True)
class Touch:
    """Bytes ``[start, end)`` of a device or host buffer that an operation reads or writes."""

    buffer: DeviceBuffer | HostBuffer
    start: int
    end: int
    write: bool
    padded_from: int | None = None


def join(dst: VectorClock, src: Mapping[int, int]) -> None:
    for agent, seq in src.items():
        if dst.get(agent, 0) < seq:
            dst[agent] = seq


def _ordered(earlier: OpInfo, clock: Mapping[int, int]) -> bool:
    return clock.get(earlier.agent, 0) >= earlier.seq


class _Segment:
    __slots__ = ("readers", "writer")

    def __init__(self, writer: OpInfo | None, readers: dict[int, OpInfo]) -> None:
        self.writer = writer
        self.readers = readers  # latest reader per stream agent


class _RangeMap:
    """Byte ranges of one buffer -> last writer and latest readers; segments cover [0, size)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._starts: list[int] = [0]
        self._segs: list[_Segment] = [_Segment(None, {})]

    def segments(self, a: int, b: int) -> Iterator[tuple[int, int, _Segment]]:
        if a >= b:
            return  # an empty range touches nothing
        i = bisect_right(self._starts, a) - 1
        n = len(self._starts)
        while i < n and self._starts[i] < b:
            seg_end = self._starts[i + 1] if i + 1 < n else self._size
            yield max(self._starts[i], a), min(seg_end, b), self._segs[i]
            i += 1

    def write(self, a: int, b: int, op: OpInfo) -> None:
        i, j = self._split_range(a, b)
        self._starts[i:j] = [a]
        self._segs[i:j] = [_Segment(op, {})]

    def read(self, a: int, b: int, op: OpInfo) -> None:
        i, j = self._split_range(a, b)
        for k in range(i, j):
            self._segs[k].readers[op.agent] = op

    def _split_range(self, a: int, b: int) -> tuple[int, int]:
        i = self._split(a)
        j = self._split(b) if b < self._size else len(self._starts)
        return i, j

    def _split(self, p: int) -> int:
        """Index of the segment starting at ``p``, splitting the one that contains it."""
        i = bisect_right(self._starts, p) - 1
        if self._starts[i] == p:
            return i
        seg = self._segs[i]
        self._starts.insert(i + 1, p)
        self._segs.insert(i + 1, _Segment(seg.writer, dict(seg.readers)))
        return i + 1


class _BufferState:
    __slots__ = ("ranges", "users")

    def __init__(self, size: int) -> None:
        self.ranges = _RangeMap(size)
        self.users: dict[int, OpInfo] = {}  # latest operation per stream that touched the buffer


@dataclass(frozen=True)
class _Conflict:
    kind: HazardKind
    other: OpInfo | None
    lo: int
    hi: int


class HazardChecker:
    """Vector clocks per agent (streams: their id; host threads: negative ids) and buffer state."""

    def __init__(self) -> None:
        self._clocks: dict[int, VectorClock] = {}
        self._buffers: weakref.WeakKeyDictionary[DeviceBuffer | HostBuffer, _BufferState] = weakref.WeakKeyDictionary()

    # -- clocks --------------------------------------------------------------------------
    def knowledge(self, agent: int) -> VectorClock:
        """A copy of what ``agent`` has observed (for events and host timestamps)."""
        return dict(self._clocks.get(agent, {}))

    def observe(self, agent: int, knowledge: Mapping[int, int]) -> None:
        """``agent`` (a host thread after a synchronize) now knows everything in ``knowledge``."""
        join(self._clocks.setdefault(agent, {}), knowledge)

    def stage(self, stream_agent: int, thread_agent: int, waited: Mapping[int, int] | None = None) -> VectorClock:
        """The clock the next operation on ``stream_agent`` gets; nothing changes until commit."""
        clock = dict(self._clocks.get(stream_agent, {}))
        join(clock, self._clocks.get(thread_agent, {}))
        if waited:
            join(clock, waited)
        clock[stream_agent] = clock.get(stream_agent, 0) + 1
        return clock

    # -- operations ----------------------------------------------------------------------
    def check(self, op: OpInfo, clock: Mapping[int, int], touches: Sequence[Touch], call: str) -> None:
        """Raise SimHazardError if ``op`` with ``clock`` conflicts with earlier work."""
        for touch in touches:
            if touch.end <= touch.start:
                continue
            conflict = self._first_conflict(touch, clock)
            if conflict is not None:
                raise _report(conflict, op, touch, call)

    def commit(self, op: OpInfo, clock: VectorClock, touches: Sequence[Touch]) -> None:
        self._clocks[op.agent] = clock
        for touch in touches:
            if touch.end > touch.start:
                self._record(op, touch).users[op.agent] = op

    def host_access(self, thread_agent: int, thread: int, touches: Sequence[Touch], what: str, call: str) -> None:
        """A host thread reads or writes host bytes: raise if device work may still use them.

        Only buffers device work can reach after its call returned are checked and remembered
        (page-locked ones, and any such work already touched), so that later device work is
        checked against the host's access too.
        """
        touches = [t for t in touches if t.end > t.start and self._tracked(t.buffer)]
        if not touches:
            return
        clock = dict(self._clocks.get(thread_agent, {}))
        clock[thread_agent] = clock.get(thread_agent, 0) + 1
        op = OpInfo(thread_agent, clock[thread_agent], what, f"host thread {thread}", touches[0].buffer.device.label)
        for touch in touches:
            conflicts_of = functools.partial(_ordering, write=touch.write, clock=clock, compute=False)
            conflict = _first(self._state(touch.buffer).ranges.segments(touch.start, touch.end), conflicts_of)
            if conflict is not None:
                raise _report(conflict, op, touch, call)
        self._clocks[thread_agent] = clock
        for touch in touches:
            self._record(op, touch)

    def check_release(self, buffer: DeviceBuffer | HostBuffer, thread_agent: int, thread: int, call: str) -> None:
        """Raise unless all work touching ``buffer`` is ordered before the calling host thread."""
        state = self._buffers.get(buffer)
        if state is None:
            return
        clock = self._clocks.get(thread_agent, {})
        for other in state.users.values():
            if not _ordered(other, clock):
                raise SimHazardError(
                    HazardKind.USE_AFTER_FREE,
                    f"use-after-free hazard: closing {buffer!r} on host thread {thread} while {other} may still "
                    f"use it; no synchronize or event wait orders the {other.short} before the close",
                    call=call,
                    device=buffer.device.label,
                    hint="synchronize the stream, or an event recorded after that work, before closing",
                )

    # -- internals -----------------------------------------------------------------------
    def _state(self, buffer: DeviceBuffer | HostBuffer) -> _BufferState:
        state = self._buffers.get(buffer)
        if state is None:
            state = _BufferState(buffer.alloc_size if isinstance(buffer, DeviceBuffer) else buffer.nbytes)
            self._buffers[buffer] = state
        return state

    def _record(self, op: OpInfo, touch: Touch) -> _BufferState:
        state = self._state(touch.buffer)
        if touch.write:
            state.ranges.write(touch.start, touch.end, op)
        else:
            state.ranges.read(touch.start, touch.end, op)
        return state

    def _tracked(self, buffer: DeviceBuffer | HostBuffer) -> bool:
        return buffer in self._buffers or (isinstance(buffer, HostBuffer) and buffer.is_page_locked)

    def _first_conflict(self, touch: Touch, clock: Mapping[int, int]) -> _Conflict | None:
        ranges = self._state(touch.buffer).ranges
        compute = isinstance(touch.buffer, DeviceBuffer) and touch.buffer.usage is Usage.COMPUTE
        if touch.padded_from is not None:
            found = _first(ranges.segments(max(touch.padded_from, touch.start), touch.end), _stale_padding)
            if found is not None:
                return found
        return _first(ranges.segments(touch.start, touch.end), lambda seg: _ordering(seg, touch.write, clock, compute))


_Found = list[tuple[HazardKind, OpInfo | None]]
_ConflictsOf = Callable[[_Segment], _Found]


def _stale_padding(seg: _Segment) -> _Found:
    if seg.writer is None or not seg.writer.zero_fill:
        return [(HazardKind.STALE_PADDING, seg.writer)]
    return []


def _ordering(seg: _Segment, write: bool, clock: Mapping[int, int], compute: bool) -> _Found:
    found: _Found = []
    writer = seg.writer
    if write:
        if writer is not None and not _ordered(writer, clock):
            found.append((HazardKind.WRITE_AFTER_WRITE, writer))
        found.extend((HazardKind.WRITE_AFTER_READ, r) for r in seg.readers.values() if not _ordered(r, clock))
    elif writer is None:
        if compute:
            found.append((HazardKind.UNINITIALIZED_READ, None))
    elif not _ordered(writer, clock):
        found.append((HazardKind.READ_AFTER_WRITE, writer))
    return found


def _first(segments: Iterator[tuple[int, int, _Segment]], conflicts_of: _ConflictsOf) -> _Conflict | None:
    """The first conflict, its byte range extended over the following segments that share it."""
    first: _Conflict | None = None
    for lo, hi, seg in segments:
        found = conflicts_of(seg)
        if first is None:
            if found:
                kind, other = found[0]
                first = _Conflict(kind, other, lo, hi)
        elif lo == first.hi and (first.kind, first.other) in found:
            first = _Conflict(first.kind, first.other, first.lo, hi)
        else:
            break
    return first


def _report(conflict: _Conflict, op: OpInfo, touch: Touch, call: str) -> SimHazardError:
    buf = touch.buffer
    span = f"bytes [{conflict.lo}, {conflict.hi})"
    other = conflict.other
    orders = "no synchronize or event wait" if op.on_host or (other and other.on_host) else "no event wait"
    missing = f"{orders} orders the {other.short} before the {op.short}" if other else ""
    kind = conflict.kind
    hint = _HOST_HINT if op.on_host else _HANDOFF_HINT if other and other.on_host else _ORDERING_HINT
    if kind is HazardKind.READ_AFTER_WRITE:
        text = f"read-after-write hazard: {op} reads {buf!r} {span} last written by {other}; {missing}"
    elif kind is HazardKind.UNINITIALIZED_READ:
        text = f"uninitialized read: {op} reads {buf!r} {span}, which nothing has written (COMPUTE memory is garbage)"
        hint = "write or clear those bytes first"
    elif kind is HazardKind.WRITE_AFTER_READ:
        text = f"write-after-read hazard: {op} writes {buf!r} {span} that {other} reads; {missing}"
    elif kind is HazardKind.WRITE_AFTER_WRITE:
        text = f"write-after-write hazard: {op} writes {buf!r} {span} also written by {other}; {missing}"
    else:
        written = f"that {other} wrote after they were last zeroed" if other else "that were never zeroed"
        text = f"stale padding: {op} reads padding {span} of {buf!r} {written}"
        hint = "clear the padding with memset(buffer, offset, n, 0) after every copy into the buffer"
    return SimHazardError(kind, text, call=call, device=op.device, hint=hint)


__all__ = ["HazardChecker", "HazardKind", "OpInfo", "SimHazardError", "Touch", "VectorClock", "join"]
