"""The staging ring: pinned chunks fed from pageable memory (file mappings) by host threads.

A mechanism only: it copies any byte range of one of a few pageable HostBuffers (the mappings
of a model's shards) to a device at DMA speed through one set of page-locked chunks. Which
tensors go through it is ``placement``'s decision.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass

from .._closing import Closing
from ..backends.base import DeviceBuffer, Event, HostBuffer, Stream, check_range
from ..errors import InvalidArgument, UseAfterClose
from ..scheduler.source import HostRegion


@dataclass(frozen=True)
class _Slot:
    buffer: HostBuffer  # one pinned chunk
    free_event: Event  # recorded after the last DMA that read this chunk


@dataclass(frozen=True)
class _Piece:
    source: HostBuffer
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class _Fill:
    piece: _Piece
    slot: _Slot
    parts: tuple[Future[float], ...]  # each returns the filling thread's clock when done


class StagingRing(Closing):
    """Copies from pageable host memory at DMA speed through a few pinned chunks.

    ``copy`` splits a range into chunk-sized pieces. A pool of host threads memcpys piece
    k+1 (and later ones, up to the number of chunks) into its chunk while the device DMAs
    piece k from its own chunk. A chunk is refilled only after the event recorded behind
    its previous DMA has completed, so the host never overwrites bytes a copy still reads.
    Pinned memory stays at ``chunks * chunk_bytes`` whatever the size of the source.

    ``copy`` blocks the calling thread until the last piece is enqueued; call it from a
    copy worker. One caller at a time: concurrent callers are serialized by a lock.
    """

    def __init__(
        self, sources: HostBuffer | Sequence[HostBuffer], *, chunk_bytes: int, chunks: int, threads: int
    ) -> None:
        if chunk_bytes < 1 or chunks < 2 or threads < 1:
            raise InvalidArgument(
                f"a staging ring needs chunk_bytes >= 1, chunks >= 2 and threads >= 1; got "
                f"{chunk_bytes}, {chunks}, {threads}",
                call="StagingRing",
            )
        self.sources = (sources,) if isinstance(sources, HostBuffer) else tuple(sources)
        if not self.sources or any(s.device is not self.sources[0].device for s in self.sources):
            raise InvalidArgument("a staging ring needs one or more sources of one device", call="StagingRing")
        self.device = self.sources[0].device
        self.chunk_bytes = chunk_bytes
        self._slots: list[_Slot] = []
        try:
            for _ in range(chunks):
                chunk = self.device.alloc_pinned(chunk_bytes)
                try:
                    self._slots.append(_Slot(chunk, self.device.event()))
                except BaseException:
                    chunk.close()
                    raise
        except BaseException:
            self._free_slots()
            raise
        # Parts go to the workers in turn rather than to whichever is idle, so that what each
        # thread does (and, on the simulator, its clock) does not depend on OS scheduling.
        self._workers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"expertstream-ring-{i}") for i in range(threads)
        ]
        self._lock = threading.Lock()
        self._next_slot = 0
        self._next_worker = 0
        self.bytes_staged = 0
        self.closed = False

    @property
    def pinned_bytes(self) -> int:
        return sum(slot.buffer.nbytes for slot in self._slots)

    def region(self, start: int, length: int, source: int = 0) -> RingRegion:
        """Bytes ``[start, start + length)`` of source number ``source``, copied through this ring."""
        return RingRegion(self.sources[source], start, length, self, source)

    def copy(
        self, stream: Stream, dst: DeviceBuffer, dst_offset: int, src_offset: int, nbytes: int, source: int = 0
    ) -> None:
        """Enqueue a copy of ``sources[source][src_offset : src_offset + nbytes]`` into ``dst`` on ``stream``."""
        call = "StagingRing.copy"
        if stream.device is not self.device:
            raise InvalidArgument(
                f"the ring's chunks are pinned for {self.device.label}", call=call, device=stream.device.label
            )
        check_range(call, dst, dst_offset, nbytes)
        host = self.sources[source]
        check_range(call, host, src_offset, nbytes)
        with self._lock:
            if self.closed:
                raise UseAfterClose("staging ring is closed", call=call, device=self.device.label)
            self._pipeline(stream, dst, _pieces(host, src_offset, dst_offset, nbytes, self.chunk_bytes))

    def _pipeline(self, stream: Stream, dst: DeviceBuffer, pieces: deque[_Piece]) -> None:
        in_flight: deque[_Fill] = deque()
        try:
            while pieces or in_flight:
                while pieces and len(in_flight) < len(self._slots):
                    in_flight.append(self._start_fill(pieces.popleft()))
                fill = in_flight[0]
                self._finish_fill(fill)
                stream.copy_h2d(dst, fill.piece.dst_offset, fill.slot.buffer, 0, fill.piece.nbytes)
                stream.record(fill.slot.free_event)
                in_flight.popleft()
                self.bytes_staged += fill.piece.nbytes
        except BaseException:
            # No fill may outlive this call: the next one would reuse its chunk.
            for fill in in_flight:
                wait(fill.parts)
            raise

    def _start_fill(self, piece: _Piece) -> _Fill:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        handoff = self.device.backend.host_timestamp()
        parts = []
        for offset, n in _parts(piece.nbytes, len(self._workers)):
            worker = self._workers[self._next_worker]
            self._next_worker = (self._next_worker + 1) % len(self._workers)
            parts.append(
                worker.submit(self._fill_part, slot, piece.source, piece.src_offset + offset, offset, n, handoff)
            )
        return _Fill(piece, slot, tuple(parts))

    def _fill_part(
        self, slot: _Slot, source: HostBuffer, src_offset: int, chunk_offset: int, nbytes: int, handoff: float
    ) -> float:
        backend = self.device.backend
        backend.host_resume_at(handoff)
        slot.free_event.synchronize()
        self.device.host_copy(slot.buffer, chunk_offset, source, src_offset, nbytes)
        return backend.host_timestamp()

    def _finish_fill(self, fill: _Fill) -> None:
        # Resume at every part's end, not only the latest: each handoff carries what its
        # thread did, and the DMA that follows reads what all of them wrote.
        for part in fill.parts:
            self.device.backend.host_resume_at(part.result())

    def close(self) -> None:
        """Wait for the DMAs still reading the chunks, then free them."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                for worker in self._workers:
                    worker.shutdown(wait=True)
            finally:
                self._free_slots()

    def _free_slots(self) -> None:
        with ExitStack() as stack:  # every chunk is released even if one step fails
            for slot in self._slots:
                stack.callback(slot.free_event.close)
                stack.callback(slot.buffer.close)
                stack.callback(slot.free_event.synchronize)  # runs first: a DMA may still read it
        self._slots.clear()


# A fill is not split into parts smaller than this: on the H200 host, 64 MiB chunks split
# into 4 MiB parts over 16 threads streamed slower (23 GB/s) than 5.3 MiB parts over 12
# (27.5 GB/s), and 16 MiB chunks in 1.3 MiB parts fell to 12 GB/s.
_MIN_PART_BYTES = 4 << 20


def _pieces(source: HostBuffer, src_offset: int, dst_offset: int, nbytes: int, chunk_bytes: int) -> deque[_Piece]:
    return deque(
        _Piece(source, src_offset + start, dst_offset + start, min(chunk_bytes, nbytes - start))
        for start in range(0, nbytes, chunk_bytes)
    )


def _parts(nbytes: int, threads: int) -> list[tuple[int, int]]:
    """(offset, size) of the pieces one chunk fill is split into, one per thread at most."""
    count = max(1, min(threads, nbytes // _MIN_PART_BYTES))
    step = -(-nbytes // count)
    return [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]


@dataclass(frozen=True)
class RingRegion(HostRegion):
    """A byte range of one of a StagingRing's sources; copies from it go through the ring's chunks."""

    ring: StagingRing
    source: int = 0  # index into ring.sources

    @property
    def blocks_host(self) -> bool:
        return True  # the caller waits for the chunk fills

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        self._check_range(offset, nbytes)
        self.ring.copy(stream, dst, dst_offset, self.start + offset, nbytes, self.source)
