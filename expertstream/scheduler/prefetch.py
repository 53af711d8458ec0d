"""Lookahead prefetch on one device: a copy stream, N prefetch slots (device buffers), a ready and free event each.

A copy into a slot waits (on the copy stream) for the slot's free event, recorded after the
last kernel that read it; the consumer waits (on its compute stream) for the slot's ready
event, recorded after the copy and the clearing of the slot's padded tail. Sources whose copy
can block the host (pageable memory, a staging ring) are copied from a worker thread so that
compute launches keep flowing meanwhile; a copy from pageable memory goes out only after the
consumer's wait for the previous unit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

from ..backends.base import BufferView, Device, DeviceBuffer, Event, Stream, Usage
from ..errors import BackendError
from .plan import Input
from .source import copies_pageable
from .stats import DeviceStats, Fallback

log = logging.getLogger(__name__)


@dataclass
class Unit:
    """One prefetch-eligible host input of one split, in this device's firing order."""

    input: Input
    position: int  # order among this device's units in the plan
    valid: bool = True  # False once it must take the stock path (prefetch off before it was fired)
    recorded: threading.Event = field(default_factory=threading.Event)
    recorded_at: float = 0.0  # host clock of the thread that enqueued the ready record
    error: BaseException | None = None  # why its fill failed, raised to the consumer
    waited: threading.Event = field(default_factory=threading.Event)  # its consumer's wait is enqueued
    waited_at: float = 0.0
    # Copies the launching thread makes before this unit's in the run's order (stock copies of earlier
    # splits): the worker enqueues this unit's copy only after them, so that a lookahead's announced
    # order (a staging ring's) is the order its copies are asked for.
    after: Milestone | None = None
    view: BufferView | None = None  # the slot bytes the split reads, once consumed


class Milestone:
    """A point the launching thread reaches once in a run (a split launched), which other threads wait for."""

    def __init__(self) -> None:
        self._reached = threading.Event()
        self._at = 0.0

    def reach(self, at: float) -> None:
        self._at = at
        self._reached.set()

    def wait(self) -> float:
        """Block until reached; the launching thread's timestamp then (the simulator resumes there)."""
        self._reached.wait()
        return self._at

    @property
    def reached(self) -> bool:
        return self._reached.is_set()


def prefetch_footprint(slots: int, largest_input_bytes: int) -> int:
    """The most device bytes one device's prefetch slots take in a run: ``slots`` buffers of the
    largest input (``largest_input_bytes``, the largest padded size, ``Input.padded_nbytes``, of the
    inputs prefetched on that device). A fresh scheduler's run holds ``sum(slot_sizes(slots, its
    sizes))``; a kept one holds each slot at the largest it has needed in any run so far."""
    return slots * largest_input_bytes


def slot_sizes(slots: int, input_bytes: Sequence[int]) -> list[int]:
    """The bytes of each of ``slots`` prefetch slots for a run that prefetches inputs of
    ``input_bytes`` (padded sizes, in the order they are fired on one device).

    The input fired n-th goes to slot n % slots, so each slot is sized for the largest input it
    will hold: a model whose layers stream a gate, an up and a larger down tensor through three
    slots holds two slots of the smaller size and one of the larger. A slot no input goes to is 0
    bytes and never allocated. A Scheduler keeps its slots between runs, each sized for the largest
    input it has held so far.
    """
    sizes = [0] * slots
    for position, nbytes in enumerate(input_bytes):
        sizes[position % slots] = max(sizes[position % slots], nbytes)
    return sizes


@dataclass
class _PrefetchSlot:
    buffer: DeviceBuffer
    ready: Event
    free: Event
    read: bool = False  # a split has read it: a fill must wait for its free event first


class PrefetchSlots:
    """The prefetch slots of one device and the stream and thread that fill them.

    The scheduler owns the slot count; a PrefetchSlots learns it for each run in ``configure``.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.n_slots = 0
        self.slot_sizes: list[int] = []  # the bytes slot i holds (slot_sizes), the most of any run so far
        self.disabled = False
        self._copy_stream: Stream | None = None
        self._slots: list[_PrefetchSlot] = []
        self._worker: _CopyWorker | None = None
        # Timing events around ready waits, for the stats: pairs in flight, and pairs to reuse.
        self._timed_waits: deque[tuple[Event, Event]] = deque()
        self._spare_pairs: list[tuple[Event, Event]] = []
        self._waited_ms = 0.0

    @property
    def device_bytes(self) -> int:
        """Device bytes the slots allocated so far hold."""
        return sum(slot.buffer.alloc_size for slot in self._slots if not slot.buffer.closed)

    @property
    def slot_bytes(self) -> int:
        """The largest slot's bytes (0 before the first run)."""
        return max(self.slot_sizes, default=0)

    # -- configuration (only between runs, after drain) --------------------------------
    def grows(self, sizes: Sequence[int]) -> bool:
        """Whether ``configure(sizes)`` reallocates a slot already allocated (callers then make sure no
        kernel still reads it, and drain)."""
        return self._first_too_small(sizes) is not None

    def configure(self, sizes: Sequence[int]) -> None:
        """Set up for a run of ``len(sizes)`` slots, slot i holding inputs of up to ``sizes[i]`` bytes
        (``slot_sizes``): keep the slots that still fit, free the rest. Callers drain first."""
        too_small = self._first_too_small(sizes)
        if too_small is not None:
            self._free_slots(too_small)  # slots are allocated in order: those after it go too
        old = self.slot_sizes
        self.slot_sizes = [max(n, old[i] if i < len(old) else 0) for i, n in enumerate(sizes)]
        self.keep(len(sizes))
        self.n_slots = len(sizes)

    def _first_too_small(self, sizes: Sequence[int]) -> int | None:
        """The first allocated slot that ``sizes`` needs larger, or None."""
        return next((i for i in range(min(len(sizes), len(self._slots))) if sizes[i] > self.slot_sizes[i]), None)

    def keep(self, n_slots: int) -> None:
        """Free the slots past the first ``n_slots``. Callers drain first."""
        if n_slots < len(self._slots):
            self._free_slots(n_slots)

    def free_buffers_but(self, positions: set[int]) -> int:
        """Once turned off and drained: close the buffers of the slots that hold none of the units
        at ``positions`` (their events stay, for the releases still to come); returns the bytes freed."""
        assert self.disabled
        kept = {position % self.n_slots for position in positions}
        freed = 0
        for index, slot in enumerate(self._slots):
            if index not in kept and not slot.buffer.closed:
                freed += slot.buffer.alloc_size
                slot.buffer.close()
        return freed

    def reset_run(self) -> None:
        self._harvest(block=True)  # the previous run drained: every pair is complete
        self._waited_ms = 0.0

    # -- the three operations of the lookahead ------------------------------------------
    def fire(self, unit: Unit, stats: DeviceStats, blocks_host: bool, previous: Unit | None) -> None:
        """Enqueue the copy of ``unit`` into its slot, or hand it to the copy worker.

        A copy from pageable memory the worker enqueues only once the consumer's wait for
        ``previous`` is enqueued: on ROCm a wait issued after a pageable copy resolves against the
        copy stream's tail, so a copy that slipped in ahead of that wait would hold the previous
        split back until it ends. A staged copy (a staging ring's DMAs from pinned chunks, which we
        take to resolve like any DMA there; not yet run on ROCm) goes out as soon as its bytes are
        staged, so the ring's threads are not held up by the launching thread.
        """
        slot = self._slot(unit.position % self.n_slots, stats)
        if slot is None:
            unit.valid = False
            return
        stats.fires += 1
        stats.bytes_prefetched += unit.input.nbytes
        if blocks_host:
            assert unit.input.host is not None
            pageable = copies_pageable(unit.input.host)
            gate = previous if previous is not None and previous.valid and pageable else None
            self._worker_thread().submit(self._fill_job(slot, unit, gate))
        else:
            self._fill_job(slot, unit, None)()

    def consume(self, compute: Stream, unit: Unit, stats: DeviceStats) -> BufferView:
        """Make ``compute`` wait until the unit's slot is filled; return the bytes to read."""
        # The timing records around the wait go out before and after the part the copy worker
        # waits for (the fill's record, then this wait), so they cost its next copy nothing.
        pair = self._wait_event_pair()
        if pair is None:
            stats.untimed_waits += 1
        else:
            compute.record(pair[0])
        try:
            if not unit.recorded.is_set():
                unit.recorded.wait()
            if unit.error is not None:
                raise unit.error
        except BaseException:
            if pair is not None:
                self._spare_pairs.append(pair)  # no wait to time: the pair is free again
            raise
        backend = self.device.backend
        backend.host.resume_at(unit.recorded_at)
        slot = self._slots[unit.position % self.n_slots]
        compute.wait(slot.ready)
        unit.waited_at = backend.host.timestamp()
        unit.waited.set()
        if pair is not None:
            compute.record(pair[1])
            self._timed_waits.append(pair)
        stats.consumed += 1
        return slot.buffer.view(0, unit.input.padded_nbytes)

    def release(self, compute: Stream, unit: Unit) -> None:
        """Mark the slot reusable once the kernels enqueued so far on ``compute`` are done."""
        slot = self._slots[unit.position % self.n_slots]
        compute.record(slot.free)
        slot.read = True

    # -- bookkeeping ---------------------------------------------------------------------
    def ready_wait_ms(self) -> float:
        """Time the compute stream spent waiting on ready events this run (after drain; waits for the last)."""
        self._harvest(block=True)
        return self._waited_ms

    def drain(self) -> None:
        """Wait until every fired copy is done; the worker's errors surface here."""
        if self._worker is not None:
            self._worker.join_idle()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        if self._worker is not None:
            self._worker.raise_error()

    def close(self) -> None:
        """Drain, then release everything, even if draining failed."""
        try:
            self.drain()
        finally:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
            self._free_slots(0)
            for before, after in [*self._timed_waits, *self._spare_pairs]:
                before.close()
                after.close()
            self._timed_waits.clear()
            self._spare_pairs.clear()
            if self._copy_stream is not None:
                self._copy_stream.close()
                self._copy_stream = None

    # -- internals -------------------------------------------------------------------------
    def _fill_job(self, slot: _PrefetchSlot, unit: Unit, gate: Unit | None) -> Callable[[], None]:
        copy_stream = self._copy_stream
        assert copy_stream is not None and unit.input.host is not None
        source = unit.input.host
        nbytes, padded = unit.input.nbytes, unit.input.padded_nbytes
        backend = self.device.backend
        read = slot.read  # a fresh slot has no kernel to wait for

        def job() -> None:
            try:
                if read:
                    copy_stream.wait(slot.free)  # no overwrite while a kernel may still read the slot
                if padded > nbytes:
                    # The slot may have held a larger tensor: clear the tail the kernels will read.
                    # Before the gate: only the copy must wait for it, and the clear costs it nothing.
                    copy_stream.memset(slot.buffer, nbytes, padded - nbytes, 0)
                if gate is not None:
                    gate.waited.wait()
                    backend.host.resume_at(gate.waited_at)
                if unit.after is not None:
                    backend.host.resume_at(unit.after.wait())
                source.enqueue_h2d(copy_stream, slot.buffer, 0, 0, nbytes)
                copy_stream.record(slot.ready)
            except BaseException as exc:
                unit.error = exc  # the consumer must not read a slot this fill never completed
                raise
            finally:  # a failed fill must not leave the consumer waiting forever
                unit.recorded_at = backend.host.timestamp()
                unit.recorded.set()

        return job

    def _slot(self, index: int, stats: DeviceStats) -> _PrefetchSlot | None:
        """The slot, allocated on first use; None (and prefetch off) if allocation fails."""
        if self.disabled:
            stats.fallbacks[Fallback.DISABLED] += 1
            return None
        if index < len(self._slots):
            return self._slots[index]
        with ExitStack() as undo:
            try:
                if self._copy_stream is None:
                    self._copy_stream = self.device.stream()
                buffer = self.device.alloc(self.slot_sizes[index], Usage.COMPUTE)
                undo.callback(buffer.close)
                ready = self.device.event()
                undo.callback(ready.close)
                free = self.device.event()
            except BackendError as exc:
                self._turn_off(index, exc, stats)
                return None
            undo.pop_all()
        self._slots.append(_PrefetchSlot(buffer, ready, free))
        return self._slots[index]

    def _turn_off(self, index: int, exc: BackendError, stats: DeviceStats) -> None:
        # Slots already filled stay valid for the splits that own them and are freed after the
        # run's drain; every later unit takes the stock path.
        self.disabled = True
        stats.fallbacks[Fallback.ALLOC_FAILED] += 1
        try:
            free = f"{self.device.free_memory()} bytes free"
        except BackendError:
            free = "free memory unknown"
        log.warning(
            "%s: lookahead prefetch turned off: allocating prefetch slot %d of %d (%d bytes) failed with %s (%s); "
            "using the stock copy path",
            self.device.label,
            index + 1,
            self.n_slots,
            self.slot_sizes[index],
            free,
            exc.detail,
        )

    def _wait_event_pair(self) -> tuple[Event, Event] | None:
        """Two timing events for one ready wait, to record around it; None if the device cannot give more."""
        if not self._spare_pairs:
            self._harvest(block=False)  # only then: each harvest queries events, on the per-split path
        if self._spare_pairs:
            pair = self._spare_pairs.pop()
        else:
            try:
                with ExitStack() as undo:
                    before = self.device.event(timing=True)
                    undo.callback(before.close)
                    after = self.device.event(timing=True)
                    undo.pop_all()
            except BackendError:
                return None
            pair = (before, after)
        return pair

    def _harvest(self, block: bool) -> None:
        """Add up the waits that are over and keep their events for reuse; ``block``: wait for each in turn."""
        while self._timed_waits:
            before, after = self._timed_waits[0]
            if block:
                after.synchronize()
            elif not after.query():
                return
            self._timed_waits.popleft()
            self._waited_ms += before.elapsed_ms(after)
            self._spare_pairs.append((before, after))

    def _worker_thread(self) -> _CopyWorker:
        if self._worker is None:
            self._worker = _CopyWorker(self.device)
        return self._worker

    def _free_slots(self, keep: int) -> None:
        for slot in self._slots[keep:]:
            if not slot.buffer.closed:  # a lost prefetch's slots may be freed already (free_buffers_but)
                slot.buffer.close()
            slot.ready.close()
            slot.free.close()
        del self._slots[keep:]


class _CopyWorker:
    """One host thread that enqueues copies which may block it (pageable sources), in order."""

    def __init__(self, device: Device) -> None:
        self._backend = device.backend
        self._jobs: queue.Queue[tuple[Callable[[], None], float] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"expertstream-copy-{device.label}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put((job, self._backend.host.timestamp()))

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                job, submitted_at = item
                self._backend.host.resume_at(submitted_at)
                job()
            except BaseException as exc:  # surfaced on the launching thread by raise_error()
                self._error = self._error or exc
            finally:
                self._jobs.task_done()

    def join_idle(self) -> None:
        self._jobs.join()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()
