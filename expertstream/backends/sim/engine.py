"""Virtual time: engine occupancy with backfill, per-thread host clocks, deferred data effects.

Nothing here knows about buffers or streams; the simulation core (core.py) combines these
pieces. Times are float seconds from the backend's creation.
"""

from __future__ import annotations

import enum
import heapq
import threading
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class EngineKind(enum.Enum):
    """The independent queues of one device: copies each way, device-local copies, compute.

    A memset takes the D2D engine or none, as the profile's ``memset_engine`` says.
    """

    H2D = "h2d"
    D2H = "d2h"
    D2D = "d2d"
    COMPUTE = "compute"  # kernels


class BusyTrack:
    """The busy intervals of one engine, sorted and disjoint.

    An operation takes the earliest idle gap at or after its ready time that fits it, so a
    short copy enqueued late can run before a long one that waits for an event (backfill).
    """

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []

    def place(self, ready: float, duration: float) -> float:
        """Reserve ``duration`` seconds at the earliest fitting start >= ``ready``; return that start."""
        if duration <= 0:
            return ready
        i = bisect_right(self._ends, ready)  # the first interval still busy after ``ready``
        start = ready
        while i < len(self._starts) and start + duration > self._starts[i]:
            start = max(start, self._ends[i])
            i += 1
        self._insert(i, start, start + duration)
        return start

    def _insert(self, i: int, start: float, end: float) -> None:
        # Merge with touching neighbours so back-to-back work keeps the lists short.
        if i > 0 and self._ends[i - 1] == start:
            i -= 1
            start = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == end:
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)


class HostTimestamp(float):
    """A host thread's clock reading that also carries what the thread knew (its vector clock).

    Handing it to another thread with ``Host.resume_at`` moves that thread's clock forward and,
    with the hazard checker on, orders it after everything the sender had observed.
    """

    knowledge: Mapping[int, int]

    def __new__(cls, value: float, knowledge: Mapping[int, int]) -> HostTimestamp:
        obj = super().__new__(cls, value)
        obj.knowledge = knowledge
        return obj


class HostClocks:
    """One virtual clock per host thread, and a small index per thread for reports and traces."""

    def __init__(self) -> None:
        self._now: dict[int, float] = {}
        self._index: dict[int, int] = {}

    def now(self) -> float:
        return self._now.get(threading.get_ident(), 0.0)

    def spend(self, seconds: float) -> float:
        """The calling thread works for ``seconds``; return its new time."""
        ident = threading.get_ident()
        t = self._now.get(ident, 0.0) + seconds
        self._now[ident] = t
        return t

    def advance_to(self, t: float) -> float:
        """The calling thread cannot go on before ``t``; return its new time."""
        ident = threading.get_ident()
        now = max(self._now.get(ident, 0.0), t)
        self._now[ident] = now
        return now

    def thread_index(self) -> int:
        return self._index.setdefault(threading.get_ident(), len(self._index))


@dataclass(order=True)
class _Effect:
    start: float
    seq: int
    apply: Callable[[], None] = field(compare=False)


class EffectQueue:
    """Data effects of enqueued operations, applied in virtual start order when the host looks.

    Applying by start time (ties: enqueue order) makes a racy schedule produce data a real GPU
    could produce, and a correctly ordered one deterministic.
    """

    def __init__(self) -> None:
        self._heap: list[_Effect] = []

    def push(self, start: float, seq: int, apply: Callable[[], None]) -> None:
        heapq.heappush(self._heap, _Effect(start, seq, apply))

    def apply_until(self, t: float) -> None:
        """Apply every effect that started at or before ``t``."""
        while self._heap and self._heap[0].start <= t:
            heapq.heappop(self._heap).apply()


__all__ = ["BusyTrack", "EffectQueue", "EngineKind", "HostClocks", "HostTimestamp"]
