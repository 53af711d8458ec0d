"""Timelines on real GPUs: timing events around every copy, memset and kernel while tracing is on.

The simulator records its own timeline in virtual time. A GPU backend records one only after
``Backend.start_trace()``: each operation is bracketed by two timing events on its stream, and
``timeline()`` turns their device times into TimelineOp on the host clock (seconds since the
trace started), which ``expertstream.timeline.write_chrome_trace`` exports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..timeline import OpKind, TimelineOp

if TYPE_CHECKING:
    from .base import Device, Event, Stream

# An enqueue that keeps the host longer than this was a blocking copy (pageable memory), not
# Python overhead: it is drawn on the host thread's track too.
HOST_BLOCKED_S = 0.5e-3


@dataclass
class _Pending:
    kind: OpKind
    name: str
    nbytes: int
    device: Device
    stream: int
    thread: int
    issued: float
    blocked: bool
    start: Event
    end: Event


class EventTracer:
    """Collects bracketed operations; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._origins: dict[Device, tuple[Event, float]] = {}  # per device: first event, its host time
        self._streams: dict[int, int] = {}  # id(stream) -> track number
        self._threads: dict[int, int] = {}
        self._pending: list[_Pending] = []
        self._done: list[TimelineOp] = []

    def around(self, stream: Stream, kind: OpKind, name: str, nbytes: int, enqueue: Callable[[], None]) -> None:
        """Enqueue one operation with ``enqueue`` between two timing events on ``stream``."""
        device = stream.device
        start, end = device.event(timing=True), device.event(timing=True)
        with self._lock:
            if device not in self._origins:
                origin = device.event(timing=True)
                stream._record(origin)
                self._origins[device] = (origin, time.perf_counter() - self._t0)
            track = self._streams.setdefault(id(stream), len(self._streams))
            thread = self._threads.setdefault(threading.get_ident(), len(self._threads))
        issued = time.perf_counter()
        stream._record(start)
        enqueue()
        stream._record(end)
        blocked = time.perf_counter() - issued > HOST_BLOCKED_S
        with self._lock:
            self._pending.append(
                _Pending(kind, name, nbytes, device, track, thread, issued - self._t0, blocked, start, end)
            )

    def mark(self, name: str) -> None:
        """A named moment on the host clock (OpKind.MARK), in the timeline with the operations."""
        with self._lock:
            thread = self._threads.setdefault(threading.get_ident(), len(self._threads))
            now = time.perf_counter() - self._t0
            self._done.append(TimelineOp(OpKind.MARK, name, now, now, thread, now))

    def timeline(self) -> tuple[TimelineOp, ...]:
        """Every traced operation so far; waits for the pending ones to finish."""
        with self._lock:
            pending, self._pending = self._pending, []
        for op in pending:
            origin, origin_host = self._origins[op.device]
            op.end.synchronize()
            start = origin_host + origin.elapsed_ms(op.start) / 1e3
            end = origin_host + origin.elapsed_ms(op.end) / 1e3
            self._done.append(
                TimelineOp(
                    op.kind,
                    op.name,
                    start,
                    end,
                    op.thread,
                    op.issued,
                    device=op.device.index,
                    stream=op.stream,
                    stream_name=f"stream {op.stream}",
                    nbytes=op.nbytes,
                    host_blocked=op.blocked,
                )
            )
            op.start.close()
            op.end.close()
        return tuple(self._done)

    def close(self) -> None:
        with self._lock:
            for op in self._pending:
                op.start.close()
                op.end.close()
            self._pending.clear()
            for origin, _ in self._origins.values():
                origin.close()
            self._origins.clear()
