"""The simulation core: one per simulated backend, shared by its devices, streams and events.

Every operation's start and end are computed when it is enqueued: start = max(enqueue time,
end of the previous operation on its stream, times of the events it waits for) + latency,
then the earliest idle gap of its engine that fits it. The timeline therefore grows as work
is enqueued, and the host thread's clock moves only when the host pays for a call or blocks.
Data effects wait in a queue until a host thread observes the device (see EffectQueue).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ...timeline import OpKind, TimelineOp
from ..base import DeviceBuffer, HostBuffer
from .engine import BusyTrack, EffectQueue, EngineKind, HostClocks, HostTimestamp
from .hazards import HazardChecker, OpInfo, Touch, VectorClock
from .profiles import Profile


@dataclass(eq=False)
class StreamState:
    """The queue behind a stream handle; wrappers made with from_handle share it."""

    id: int
    device: int
    device_label: str
    name: str
    tail: float = 0.0  # when the last enqueued operation ends
    destroyed: bool = False
    last_pageable: int = -1  # enqueue number of the last copy from or to pageable memory


@dataclass(frozen=True)
class Recorded:
    """An event's most recent record: when it completes and what it orders after."""

    time: float
    knowledge: VectorClock
    stream: StreamState | None = None  # where it was recorded
    seq: int = -1  # its enqueue number there


@dataclass(frozen=True)
class CapturedEvent:
    """An event record or wait inside a capture: ``key`` names the record (one per record)."""

    key: int
    wait: bool


@dataclass(frozen=True)
class Work:
    """One operation to enqueue, fully described by the stream that builds it."""

    kind: OpKind
    name: str  # for the timeline
    what: str  # for hazard reports: "h2d copy", "kernel 'name'"
    call: str
    nbytes: int = 0
    engine: EngineKind | None = None
    latency: float = 0.0
    duration: float = 0.0
    blocks_host: bool = False
    effect: Callable[[], None] | None = None
    touches: Sequence[Touch] = ()  # device bytes, and host bytes the device reaches after the call returns
    zero_fill: bool = False
    pageable: bool = False  # a copy from or to pageable host memory


class Simulation:
    def __init__(self, profile: Profile, *, data: bool, check_hazards: bool) -> None:
        self.profile = profile
        self.data = data
        self.lock = threading.RLock()
        self.clocks = HostClocks()
        self.checker = HazardChecker() if check_hazards else None
        self._effects = EffectQueue()
        self._timeline: list[TimelineOp] = []
        self._tracks: dict[tuple[int, EngineKind], BusyTrack] = {}
        self._streams: dict[int, StreamState] = {}
        self._stream_ids = itertools.count(1)
        self._enqueue_seq = itertools.count()
        self._bare = threading.local()  # .depth: inside bare_calls on this thread

    # -- streams -------------------------------------------------------------------------
    def new_stream(self, device: int, device_label: str, name: str | None) -> StreamState:
        with self.lock:
            sid = next(self._stream_ids)
            state = StreamState(sid, device, device_label, name or f"stream {sid}")
            self._streams[sid] = state
            return state

    def stream_by_id(self, sid: int) -> StreamState | None:
        with self.lock:
            return self._streams.get(sid)

    # -- enqueueing ----------------------------------------------------------------------
    @contextmanager
    def bare_calls(self) -> Iterator[None]:
        """The calling thread's calls inside cost the profile's call_s, not enqueue_s."""
        self._bare.depth = getattr(self._bare, "depth", 0) + 1
        try:
            yield
        finally:
            self._bare.depth -= 1

    def _call_s(self) -> float:
        """Host seconds of one call on the calling thread."""
        call_s = self.profile.call_s
        bare = int(getattr(self._bare, "depth", 0)) > 0
        return call_s if call_s is not None and bare else self.profile.enqueue_s

    def submit(self, stream: StreamState, work: Work, waited: Recorded | None = None, *, call_s: bool = True) -> float:
        """Enqueue ``work`` on ``stream``; return when it ends. Raises before changing anything on a hazard.

        ``call_s``: the host pays a call for it (not so for each operation of a graph launch).
        """
        with self.lock:
            staged = self._stage_hazards(stream, work, waited)
            issued = self.clocks.spend(self._call_s()) if call_s else self.clocks.now()
            reached = max(issued, stream.tail)
            ready = max(reached, self._released_at(waited)) if waited is not None else reached
            ready += work.latency
            start = self._tracks_for(stream.device, work.engine).place(ready, work.duration) if work.engine else ready
            end = start + work.duration
            stream.tail = end
            seq = next(self._enqueue_seq)
            if work.pageable:
                stream.last_pageable = seq
            if staged is not None and self.checker is not None:
                self.checker.commit(staged[0], staged[1], work.touches)
            if work.effect is not None and self.data:
                self._effects.push(start, seq, work.effect)
            if work.blocks_host:
                self.clocks.advance_to(end)
                self._effects.apply_until(end)
            self._timeline.append(
                TimelineOp(
                    kind=work.kind,
                    name=work.name,
                    start=reached if work.kind is OpKind.WAIT else start,
                    end=end,
                    thread=self.clocks.thread_index(),
                    issued=issued,
                    device=stream.device,
                    stream=stream.id,
                    stream_name=stream.name,
                    nbytes=work.nbytes,
                    host_blocked=work.blocks_host,
                )
            )
            return end

    def launch_graph(self, lanes: Mapping[int, StreamState], items: Sequence[tuple[int, Work | CapturedEvent]]) -> None:
        """Enqueue a graph's operations for the host cost of one call.

        ``items``: (captured stream's id, its work or event) in capture order; ``lanes``: the
        stream each captured stream's work goes to now.
        """
        wait = Work(OpKind.WAIT, "wait", "event wait", "Graph.launch")
        record = Work(OpKind.RECORD, "record", "event record", "Graph.launch")
        with self.lock:
            self.clocks.spend(self._call_s())
            records: dict[int, Recorded] = {}
            for sid, item in items:
                stream = lanes[sid]
                if isinstance(item, Work):
                    self.submit(stream, item, call_s=False)
                elif item.wait:
                    self.submit(stream, wait, records[item.key], call_s=False)
                else:
                    time = self.submit(stream, record, call_s=False)
                    knowledge = self.checker.knowledge(stream.id) if self.checker is not None else {}
                    records[item.key] = Recorded(time, knowledge, stream, next(self._enqueue_seq))

    def capture_call(self) -> None:
        """The host's cost of one call recorded into a capture (nothing is enqueued)."""
        with self.lock:
            self.clocks.spend(self._call_s())

    def record(self, stream: StreamState, name: str) -> Recorded:
        with self.lock:
            time = self.submit(stream, Work(OpKind.RECORD, name, "event record", "Stream.record"))
            knowledge = self.checker.knowledge(stream.id) if self.checker is not None else {}
            return Recorded(time, knowledge, stream, next(self._enqueue_seq))

    def _released_at(self, waited: Recorded) -> float:
        """When a wait enqueued now on ``waited`` lets its stream go on."""
        source = waited.stream
        if self.profile.pageable_wait_binds_tail and source is not None and source.last_pageable > waited.seq:
            return max(waited.time, source.tail)
        return waited.time

    def _stage_hazards(
        self, stream: StreamState, work: Work, waited: Recorded | None
    ) -> tuple[OpInfo, VectorClock] | None:
        if self.checker is None:
            return None
        clock = self.checker.stage(stream.id, self.thread_agent(), waited.knowledge if waited else None)
        op = OpInfo(stream.id, clock[stream.id], work.what, stream.name, stream.device_label, work.zero_fill)
        self.checker.check(op, clock, work.touches, work.call)
        return op, clock

    def _tracks_for(self, device: int, engine: EngineKind) -> BusyTrack:
        return self._tracks.setdefault((device, engine), BusyTrack())

    # -- the host observing the device ---------------------------------------------------
    def synchronize_stream(self, stream: StreamState) -> None:
        with self.lock:
            self._observe(stream.tail, [stream.id], f"synchronize {stream.name}")

    def synchronize_device(self, device: int, label: str) -> None:
        with self.lock:
            streams = [s for s in self._streams.values() if s.device == device]
            until = max((s.tail for s in streams), default=0.0)
            self._observe(until, [s.id for s in streams], f"synchronize {label}")

    def query_stream(self, stream: StreamState) -> bool:
        with self.lock:
            if self.clocks.spend(self._call_s()) < stream.tail:
                return False
            self._observe(stream.tail, [stream.id], f"query {stream.name}")
            return True

    def synchronize_event(self, recorded: Recorded | None) -> None:
        if recorded is None:
            return  # never recorded: nothing to wait for
        with self.lock:
            self._observe(recorded.time, [], "synchronize event", recorded.knowledge)

    def query_event(self, recorded: Recorded | None) -> bool:
        if recorded is None:
            return True
        with self.lock:
            if self.clocks.spend(self._call_s()) < recorded.time:
                return False
            self._observe(recorded.time, [], "query event", recorded.knowledge)
            return True

    def _observe(
        self, until: float, stream_ids: Sequence[int], name: str, knowledge: Mapping[int, int] | None = None
    ) -> None:
        before = self.clocks.now()
        now = self.clocks.advance_to(until)
        if self.checker is not None:
            agent = self.thread_agent()
            for sid in stream_ids:
                self.checker.observe(agent, self.checker.knowledge(sid))
            if knowledge is not None:
                self.checker.observe(agent, knowledge)
        self._effects.apply_until(now)
        if now > before:
            self._host_op(OpKind.HOST_SYNC, name, before, now, 0)

    # -- host threads --------------------------------------------------------------------
    def thread_agent(self) -> int:
        """The calling host thread's agent id for the hazard checker (streams use positive ids)."""
        return -(self.clocks.thread_index() + 1)

    def host_work(self, kind: OpKind, name: str, seconds: float, nbytes: int) -> None:
        """The calling thread spends ``seconds`` on host work (a registration)."""
        with self.lock:
            before = self.clocks.now()
            self._host_op(kind, name, before, self.clocks.spend(seconds), nbytes)

    def host_copy(self, nbytes: int, sharing: int = 1, *, fixed_cost: bool = True) -> None:
        """The calling thread copies ``nbytes`` host -> host after the profile's fixed cost per copy
        (where ``fixed_cost``), at one thread's rate or at 1 / ``sharing`` of the host memory bus,
        whichever is lower.

        The share is what the caller says it runs at once, not what other threads have booked: a
        shared track takes copies in the order the OS happens to run their threads, so one run
        would take different virtual times from one time to the next.
        """
        profile = self.profile
        rate = profile.host_memcpy_bps
        if profile.host_memcpy_total_bps is not None:
            rate = min(rate, profile.host_memcpy_total_bps / sharing)
        with self.lock:
            before = self.clocks.now()
            end = before + (profile.host_copy_latency_s if fixed_cost else 0.0) + nbytes / rate
            self._host_op(OpKind.HOST_COPY, "host copy", before, self.clocks.advance_to(end), nbytes)

    def host_read(self, nbytes: int, depth: int = 1) -> None:
        """The calling thread reads ``nbytes`` from the profile's drive while ``depth`` such reads are in
        flight (its own included): the drive's latency, then its bytes at 1 / ``depth`` of what the
        drive reads at that depth. As for ``host_copy``, the depth is what the caller says it runs."""
        profile = self.profile
        with self.lock:
            before = self.clocks.now()
            end = before + profile.disk_latency_s + nbytes * depth / profile.disk_rate(depth)
            self._host_op(OpKind.HOST_COPY, "disk read", before, self.clocks.advance_to(end), nbytes)

    def mark(self, name: str) -> None:
        """A named moment at the calling thread's virtual time (OpKind.MARK)."""
        with self.lock:
            now = self.clocks.now()
            self._timeline.append(TimelineOp(OpKind.MARK, name, now, now, self.clocks.thread_index(), now))

    def _host_op(self, kind: OpKind, name: str, start: float, end: float, nbytes: int) -> None:
        self._timeline.append(
            TimelineOp(
                kind=kind,
                name=name,
                start=start,
                end=end,
                thread=self.clocks.thread_index(),
                issued=start,
                nbytes=nbytes,
                host_blocked=True,
            )
        )

    def host_timestamp(self) -> HostTimestamp:
        with self.lock:
            knowledge = self.checker.knowledge(self.thread_agent()) if self.checker is not None else {}
            return HostTimestamp(self.clocks.now(), knowledge)

    def host_resume_at(self, timestamp: float) -> None:
        with self.lock:
            self.clocks.advance_to(float(timestamp))
            if self.checker is not None and isinstance(timestamp, HostTimestamp):
                self.checker.observe(self.thread_agent(), timestamp.knowledge)

    def host_access(self, touches: Sequence[Touch], what: str, call: str) -> None:
        """The calling thread reads or writes host bytes; raise a hazard if device work may still use them."""
        if self.checker is None:
            return
        with self.lock:
            self.checker.host_access(self.thread_agent(), self.clocks.thread_index(), touches, what, call)

    def check_release(self, buffer: DeviceBuffer | HostBuffer, call: str) -> None:
        """Raise a use-after-free hazard unless work touching ``buffer`` is ordered before this thread."""
        if self.checker is None:
            return
        with self.lock:
            self.checker.check_release(buffer, self.thread_agent(), self.clocks.thread_index(), call)

    def timeline(self) -> tuple[TimelineOp, ...]:
        with self.lock:
            return tuple(self._timeline)


__all__ = ["Recorded", "Simulation", "StreamState", "Work"]
