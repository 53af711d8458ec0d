"""The staging ring: pinned chunks fed from pageable memory (file mappings) by host workers.

A mechanism only: it copies any byte range of one of a few pageable HostBuffers (the mappings
of a model's shards) to a device at DMA speed through one set of page-locked chunks. Which
tensors go through it is ``placement``'s decision. The workers that fill the chunks are processes
where they can be (``fillproc``: on a GPU, sources that map files, Linux), else threads. Given a
``FileReader`` (mode disk), threads read the chunks' bytes from the files instead of the mappings.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass

from .._closing import Closing
from ..backends.base import DeviceBuffer, Event, HostBuffer, Stream, check_range
from ..errors import BackendError, InvalidArgument, UseAfterClose
from ..scheduler.source import HostRegion, HostSource, argument_kind
from .diskread import FileReader
from .fillproc import FileSpan, FillProcessError, FillProcesses, SharedChunks, close_spans, file_spans

log = logging.getLogger(__name__)

_UNANNOUNCED = -1  # the ticket of the pieces of a copy that was not expected

# A chunk's fill is not split into parts smaller than this. Each part costs its thread about
# 0.3 ms besides the copy on the H200 host (a prefill with 4 MiB parts spent that much more thread
# time per part than one with 16 MiB parts, for the same bytes); 8 MiB parts of 32 MiB chunks gave
# the fastest prefill there (docs/results/hostmem-h200.md).
DEFAULT_RING_PART_BYTES = 8 << 20
# 8 chunks of 32 MiB keep 32 parts of 8 MiB in flight for the threads in 256 MiB of pinned memory.
# On the H200 host, prefill through them moved 35-45 GB/s (medians of 3 runs per setting) where 4
# chunks of 64 MiB moved 33-40, and 8 chunks of 64 MiB copied slower per thread than either.
DEFAULT_RING_CHUNK_BYTES = 32 << 20
DEFAULT_RING_CHUNKS = 8
# With fill processes, chunks small enough to stay in the last-level cache between their fill and
# their DMA. Alone, 16 chunks of 4-8 MiB staged 51-54 GB/s on the H200 host (97% of the pinned
# peak) where 8 chunks of 32 MiB staged 32. Inside a prefill of the whole 48-layer file, 16 chunks
# of 8 MiB in 4 MiB parts (two processes per chunk, half the hand-offs of 4 MiB chunks) moved
# 41-44 GB/s against 36-41 (docs/results/hostmem-h200.md).
PROCESS_RING_CHUNKS = 16
PROCESS_RING_CHUNK_BYTES = 8 << 20
PROCESS_RING_PART_BYTES = 4 << 20


class RingFill(enum.Enum):
    """Who fills a staging ring's chunks."""

    AUTO = "auto"  # processes where they can run (a GPU, sources that map files, Linux), else threads
    THREADS = "threads"  # host threads of this process: the simulator times these
    PROCESSES = "processes"  # helper processes; threads (with a warning) if they cannot run


def _parse_fill(fill: RingFill | str) -> RingFill:
    try:
        return RingFill(fill)
    except ValueError:
        raise InvalidArgument(
            f"unknown staging ring fill {fill!r}",
            call="StagingRing",
            hint=f"choose one of {', '.join(f.value for f in RingFill)}",
        ) from None


def _fill_with_reader(fill: RingFill, reader: FileReader | None, sources: int) -> tuple[RingFill, str | None]:
    """Who fills a ring that reads from files (threads: a read releases the interpreter lock, so they
    keep several in flight), and why where processes were asked for."""
    if reader is None:
        return fill, None
    if len(reader.paths) != sources:
        raise InvalidArgument(
            f"a staging ring's reader names {len(reader.paths)} files for {sources} sources", call="StagingRing"
        )
    note = "reads from the files are made by threads" if fill is RingFill.PROCESSES else None
    return RingFill.THREADS, note


@dataclass
class RingStats:
    """Where a staging ring's workers spent their time (backend.host.timestamp, virtual on the simulator).

    ``fill_s`` is summed over the workers: with ``threads`` workers over ``wall`` seconds, ``fill_s /
    (threads * wall)`` is how busy copying kept them. ``chunk_wait_s`` is summed over who waits for
    chunks: the threads, or the ring's caller where it hands chunks to fill processes. Workers that
    copy nearly all the time mean the host's copy rate bounds the ring; long chunk waits mean the
    DMAs (or whatever the copying stream waits for) hold the chunks back.
    """

    bytes_filled: int = 0  # copied into chunks, fills dropped and redone included
    bytes_cached: int = 0  # of those, read from files out of the page cache rather than from the drive
    bytes_staged: int = 0  # handed to DMAs from the chunks: the bytes the copies asked for
    fill_s: float = 0.0  # worker-seconds spent copying into chunks
    # Seconds spent waiting for a chunk's previous DMA to end: by the threads, or, where the caller
    # waits before handing a chunk on (fill processes), by the caller.
    chunk_wait_s: float = 0.0

    def __sub__(self, other: RingStats) -> RingStats:
        return RingStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})

    def __add__(self, other: RingStats) -> RingStats:
        return RingStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    @property
    def thread_gbps(self) -> float | None:
        """One thread's copy rate while copying, GB/s (None before any fill)."""
        return self.bytes_filled / self.fill_s / 1e9 if self.fill_s > 0 else None


@dataclass(frozen=True)
class _Chunk:
    index: int
    buffer: HostBuffer  # one pinned chunk
    free_event: Event  # recorded after the last DMA that read this chunk
    base: int = 0  # where fills start in the buffer: the first aligned byte, for reads from a file


@dataclass(frozen=True)
class _Piece:
    ticket: int  # the copy it belongs to: its place in the expected order, or _UNANNOUNCED
    source: HostBuffer
    src_offset: int
    offset: int  # in the destination, from the dst_offset its copy was asked with
    nbytes: int


@dataclass(frozen=True)
class _ProcessPart:
    process: int
    seq: int  # the copy's number in that process's order
    nbytes: int


@dataclass(frozen=True)
class _Read:
    """One part of a chunk's fill read from a file: aligned offset, place in the chunk and size."""

    source: int
    file_offset: int
    chunk_offset: int
    nbytes: int
    wanted: int  # the bytes that must come: those before the piece's end


@dataclass(frozen=True)
class _Fill:
    piece: _Piece
    chunk: _Chunk
    # Thread fills: each part returns the filling thread's clock when done. Process fills: where
    # each part was sent.
    parts: tuple[Future[float], ...] | tuple[_ProcessPart, ...]
    chunk_offset: int = 0  # where the piece's bytes begin in the chunk (a read from a file starts aligned below)


def _host_buffers(sources: object) -> tuple[HostBuffer, ...]:
    """The ring's sources, each a HostBuffer, or InvalidArgument naming what was passed instead."""
    found = tuple(sources) if isinstance(sources, Iterable) else (sources,)
    for source in found:
        if not isinstance(source, HostBuffer):
            raise InvalidArgument(
                f"a staging ring copies from HostBuffers (host memory), not from {argument_kind(source)}",
                call="StagingRing",
                hint="wrap host memory with device.wrap_host(); device-resident data needs no staging",
            )
    return found


class StagingRing(Closing):
    """Copies from pageable host memory at DMA speed through a few pinned chunks.

    ``copy`` splits a range into chunk-sized pieces. A pool of host workers memcpys the next
    pieces (up to the number of chunks) into their chunks while the device DMAs earlier ones
    from theirs. A chunk is refilled only after the event recorded behind its previous DMA
    has completed, so the host never overwrites bytes a copy still reads. Pinned memory stays
    at ``chunks * chunk_bytes`` whatever the size of the source.

    Told the copies to come (``expect``, in the order they will be asked for), the workers
    go on filling chunks for the next copies while the current one's last pieces are DMAed
    and between calls, so the ring does not drain at every copy. A copy asked for out of that
    order is still exact: the fills made ahead for copies announced before it are dropped, or,
    if it was not announced at all, they are redone after it.

    ``fill`` picks the workers (``RingFill``); ``chunks``, ``chunk_bytes`` and ``part_bytes``
    default to what suits them, chunks no larger than ``max_copy_bytes`` where it is given. If
    fill processes fail, the ring says so once in the log, drops their fills and goes on with
    threads (``fill`` turns to THREADS, ``fill_note`` says why).

    ``reader``: the files behind the sources (source i is the whole of file i), read with
    O_DIRECT into the chunks by the threads instead of copying from the sources; each chunk has
    room for a piece rounded out to the reader's alignment.

    ``copy`` blocks the calling thread until the last piece is enqueued; call it from a
    copy worker. One caller at a time: concurrent callers are serialized by a lock.
    """

    def __init__(
        self,
        sources: HostBuffer | Sequence[HostBuffer],
        *,
        threads: int,
        chunk_bytes: int | None = None,
        chunks: int | None = None,
        part_bytes: int | None = None,
        fill: RingFill | str = RingFill.AUTO,
        max_copy_bytes: int | None = None,
        reader: FileReader | None = None,
    ) -> None:
        self.sources = (sources,) if isinstance(sources, HostBuffer) else _host_buffers(sources)
        if not self.sources or any(s.device is not self.sources[0].device for s in self.sources):
            raise InvalidArgument("a staging ring needs one or more sources of one device", call="StagingRing")
        self._reader = reader
        self.device = self.sources[0].device
        # Why the chunks are filled by threads where processes were meant.
        fill, self.fill_note = _fill_with_reader(_parse_fill(fill), reader, len(self.sources))
        given = {"chunk_bytes": chunk_bytes, "chunks": chunks, "part_bytes": part_bytes}
        least = {"chunk_bytes": 1, "chunks": 2, "part_bytes": 1}
        if threads < 1 or any(value is not None and value < least[key] for key, value in given.items()):
            raise InvalidArgument(
                f"a staging ring needs chunk_bytes >= 1, chunks >= 2, threads >= 1 and part_bytes >= 1; got "
                f"{chunk_bytes}, {chunks}, {threads}, {part_bytes}",
                call="StagingRing",
            )
        backend = self.device.backend
        # The simulator times threads: a process's copies would take no time there. Under auto it
        # stands for its profile's machine: where that fills with processes, timed threads are
        # handed chunks as processes are (the caller waits for each chunk's last DMA first).
        self._timed_as_processes = (
            fill is RingFill.AUTO and backend.host.virtual_time and backend.host.ring_fill == RingFill.PROCESSES.value
        )
        spans: list[FileSpan] | None = None
        if fill is RingFill.PROCESSES or (fill is RingFill.AUTO and not backend.host.virtual_time):
            found = file_spans(self.sources)
            if isinstance(found, str):
                self.fill_note = f"fill processes cannot read the sources: {found}"
            else:
                spans = found
        use_processes = spans is not None or self._timed_as_processes
        if chunks is None:
            chunks = PROCESS_RING_CHUNKS if use_processes else DEFAULT_RING_CHUNKS
        if chunk_bytes is None:
            chunk_bytes = PROCESS_RING_CHUNK_BYTES if use_processes else DEFAULT_RING_CHUNK_BYTES
        if max_copy_bytes is not None:
            chunk_bytes = max(1, min(chunk_bytes, max_copy_bytes))  # a bigger chunk would be wasted
        if part_bytes is None:
            part_bytes = PROCESS_RING_PART_BYTES if use_processes else DEFAULT_RING_PART_BYTES
        self.part_bytes = part_bytes  # a chunk's fill is split between workers in parts no smaller than this
        self.chunk_bytes = chunk_bytes
        self._chunks: list[_Chunk] = []
        self._shared: SharedChunks | None = None
        self._processes: FillProcesses | None = None
        try:
            if spans is not None:
                self._start_processes(spans, chunks, threads)
            if self._processes is None:
                for index in range(chunks):
                    self._chunks.append(self._new_chunk(index))
        except BaseException:
            self._free_chunks()
            raise
        finally:
            close_spans(spans or ())  # the processes hold their own
        if self.fill_note is not None:
            # Asked for processes, or they could not start: worth a warning. Sources that are not
            # file mappings under auto: only what auto chose.
            level = logging.INFO if fill is RingFill.AUTO and spans is None else logging.WARNING
            log.log(level, "%s: staging ring fills its chunks with threads: %s", self.device.label, self.fill_note)
        # Parts go to the workers in turn rather than to whichever is idle, so that what each
        # thread does (and, on the simulator, its clock) does not depend on OS scheduling.
        self._workers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"expertstream-ring-{i}") for i in range(threads)
        ]
        self._lock = threading.Lock()
        self._released_at: float | None = None  # the last caller's clock (and, on the simulator, what it knew)
        self._next_chunk = 0
        self._next_worker = 0
        # The expected copies: tickets by (source, offset, nbytes), the lowest ticket still
        # expected, the pieces not being filled yet, and the fills started (oldest first, at
        # most one per chunk), which hold the pieces right before those queued.
        self._tickets: dict[tuple[int, int, int], deque[int]] = {}
        self._next_expected = 0
        self._queue: deque[_Piece] = deque()
        self._ahead: deque[_Fill] = deque()
        self._stats = RingStats()
        self._stats_lock = threading.Lock()  # the fill threads add to it; never held while waiting
        self.unannounced_copies = 0  # copies that were not expected: they waited for a fill of their own
        self.skipped_copies = 0  # expected copies never asked for before a later one was
        self.closed = False

    def _new_chunk(self, index: int) -> _Chunk:
        """A pinned chunk; for reads from files, with room to start at an aligned address and round a piece out."""
        align = 1 if self._reader is None else self._reader.alignment
        slack = 0 if self._reader is None else 3 * align  # the address's, the piece's head's and its tail's
        buffer = self.device.alloc_pinned(self.chunk_bytes + slack)
        try:
            return _Chunk(index, buffer, self.device.event(), -buffer.address % align)
        except BaseException:
            buffer.close()
            raise

    def _start_processes(self, spans: Sequence[FileSpan], chunks: int, count: int) -> None:
        """Fill processes and their shared chunks; on failure, a note and threads instead."""
        try:
            self._shared = SharedChunks(self.device, chunks, self.chunk_bytes)
            self._processes = FillProcesses(count, spans, self._shared)
        except (OSError, BackendError) as exc:
            if self._shared is not None:
                self._shared.close()
                self._shared = None
            self.fill_note = f"fill processes could not start: {exc}"
            return
        self._chunks = [_Chunk(i, buffer, self.device.event()) for i, buffer in enumerate(self._shared.buffers)]

    @property
    def reads_files(self) -> bool:
        """Whether the chunks are read from files (mode disk's reader) rather than copied from the sources."""
        return self._reader is not None

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    @property
    def fill(self) -> RingFill:
        """Who fills the chunks now: helper processes (on the simulator, threads timed as them), or threads."""
        return RingFill.PROCESSES if self._caller_waits else RingFill.THREADS

    @property
    def _caller_waits(self) -> bool:
        """Whether the caller waits for a chunk's last DMA before it hands the chunk to a fill, as for processes."""
        return self._processes is not None or self._timed_as_processes

    @property
    def pinned_bytes(self) -> int:
        return sum(chunk.buffer.nbytes for chunk in self._chunks)

    @property
    def bytes_staged(self) -> int:
        """Bytes handed to DMAs from the chunks so far."""
        with self._stats_lock:
            return self._stats.bytes_staged

    @property
    def stats(self) -> RingStats:
        """A copy of the time accounts so far; subtract an earlier one for an interval."""
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    @property
    def threads(self) -> int:
        """Host threads filling the chunks."""
        return len(self._workers)

    def region(self, start: int, length: int, source: int = 0) -> RingRegion:
        """Bytes ``[start, start + length)`` of source number ``source``, copied through this ring."""
        return RingRegion(self.sources[source], start, length, self, source)

    def expect(self, sources: Sequence[HostSource]) -> None:
        """The copies to come, whole regions of this ring, in order; fills for them start now.

        Replaces an earlier list (its fills are dropped); an empty one ends it.
        """
        call = "StagingRing.expect"
        for region in sources:
            if not isinstance(region, RingRegion) or region.ring is not self:
                raise InvalidArgument(f"{region!r} is not a region of this staging ring", call=call)
        with self._locked():
            if self.closed:
                raise UseAfterClose("staging ring is closed", call=call, device=self.device.label)
            self._forget()
            regions = [r for r in sources if isinstance(r, RingRegion) and r.length > 0]
            for ticket, region in enumerate(regions):
                self._tickets.setdefault((region.source, region.start, region.length), deque()).append(ticket)
                self._queue.extend(
                    _pieces(ticket, self.sources[region.source], region.start, region.length, self.chunk_bytes)
                )
            self._top_up()

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
        with self._locked():
            if self.closed:
                raise UseAfterClose("staging ring is closed", call=call, device=self.device.label)
            if nbytes == 0:
                return
            try:
                ticket = self._claim((source, src_offset, nbytes))
                if ticket == _UNANNOUNCED:
                    # Its pieces go first; the fills made ahead are redone after them.
                    self._requeue_ahead()
                    self._queue.extendleft(reversed(_pieces(_UNANNOUNCED, host, src_offset, nbytes, self.chunk_bytes)))
                self._pipeline(stream, dst, dst_offset, ticket)
            except BaseException:
                self._forget()  # no fill may outlive a failed copy: its chunk's next use is unknown
                raise

    def copy_ranges(
        self, stream: Stream, dst: DeviceBuffer, ranges: Sequence[tuple[int, int, int]], source: int = 0
    ) -> None:
        """Enqueue copies of several ``(dst_offset, src_offset, nbytes)`` ranges of ``sources[source]``.

        None of them was announced (a decode step's experts, known only once its router ran), but
        they are filled side by side, one chunk each, up to the number of chunks, and DMAed in
        order; one ``copy`` per range would fill them one after the other.
        """
        call = "StagingRing.copy_ranges"
        if stream.device is not self.device:
            raise InvalidArgument(
                f"the ring's chunks are pinned for {self.device.label}", call=call, device=stream.device.label
            )
        host = self.sources[source]
        for dst_offset, src_offset, nbytes in ranges:
            check_range(call, dst, dst_offset, nbytes)
            check_range(call, host, src_offset, nbytes)
        with self._locked():
            if self.closed:
                raise UseAfterClose("staging ring is closed", call=call, device=self.device.label)
            pieces = [
                piece
                for dst_offset, src_offset, nbytes in ranges
                for piece in _pieces(_UNANNOUNCED, host, src_offset, nbytes, self.chunk_bytes, dst_offset)
            ]
            if not pieces:
                return
            self.unannounced_copies += sum(1 for _, _, nbytes in ranges if nbytes)
            try:
                self._requeue_ahead()
                self._queue.extendleft(reversed(pieces))
                self._pipeline(stream, dst, 0, _UNANNOUNCED)
            except BaseException:
                self._forget()
                raise

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the ring's lock, starting where the last holder stopped.

        The lock orders one caller's work (fills it waited for and dropped, DMAs it enqueued) before
        the next caller's; resuming at the last holder's timestamp tells the simulator so.
        """
        backend = self.device.backend
        with self._lock:
            if self._released_at is not None:
                backend.host.resume_at(self._released_at)
            try:
                yield
            finally:
                self._released_at = backend.host.timestamp()

    def _claim(self, key: tuple[int, int, int]) -> int:
        """The ticket of the first expected copy of ``key`` (dropping those expected before it), or _UNANNOUNCED."""
        tickets = self._tickets.get(key)
        while tickets and tickets[0] < self._next_expected:
            tickets.popleft()  # skipped earlier
        if not tickets:
            self.unannounced_copies += 1
            return _UNANNOUNCED
        ticket = tickets.popleft()
        self.skipped_copies += ticket - self._next_expected
        self._next_expected = ticket + 1
        while self._ahead and self._ahead[0].piece.ticket < ticket:
            self._settle(self._ahead.popleft())
        while self._queue and self._queue[0].ticket < ticket:
            self._queue.popleft()
        return ticket

    def _pipeline(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, ticket: int) -> None:
        """DMA the pieces of copy ``ticket``, which lead the queue, refilling each chunk as it frees."""
        self._top_up()
        while self._ahead and self._ahead[0].piece.ticket == ticket:
            fill = self._ahead[0]
            try:
                self._finish_fill(fill)
            except FillProcessError as exc:
                self._stop_processes(exc)  # its pieces and those after are filled again, by threads
                self._top_up()
                continue
            self._ahead.popleft()
            with self.device.backend.host.bare_calls():
                stream.copy_h2d(
                    dst, dst_offset + fill.piece.offset, fill.chunk.buffer, fill.chunk_offset, fill.piece.nbytes
                )
                stream.record(fill.chunk.free_event)
            with self._stats_lock:
                self._stats.bytes_staged += fill.piece.nbytes
            self._top_up()  # the next fill takes the chunk just handed to the DMA, once it is read

    def _top_up(self) -> None:
        """Start fills for the next pieces into the chunks no fill holds.

        The parts of the fills started and not yet handed to a DMA copy at once with those started
        now, up to one per thread: that is each part's share of the host memory bus. Counted here, in
        the caller's order of events, so that the simulator's share does not depend on how the OS
        runs threads; fills started together (a run's first, a decode step's ranges) share it alike.

        Fill processes cannot wait for a chunk's DMA themselves: the caller waits before it sends
        a fill. One chunk is left to the DMA handed over last, so that the caller waits for the
        one before it, which is done or nearly, and the DMAs queue back to back.
        """
        spare = 1 if self._caller_waits else 0
        starting = min(len(self._queue), len(self._chunks) - len(self._ahead) - spare)
        if starting <= 0:
            return
        pieces = [self._queue.popleft() for _ in range(starting)]
        spans = [self._spans(piece) for piece in pieces]
        in_flight = sum(len(fill.parts) for fill in self._ahead) + sum(len(parts) for parts in spans)
        sharing = min(len(self._workers), in_flight)
        for index, (piece, parts) in enumerate(zip(pieces, spans, strict=True)):
            try:
                self._ahead.append(self._start_fill(piece, parts, sharing))
            except FillProcessError as exc:
                self._queue.extendleft(reversed(pieces[index:]))
                self._stop_processes(exc)
                self._top_up()
                return

    def _requeue_ahead(self) -> None:
        """Wait for the fills started ahead and queue their pieces again, first."""
        pieces = [fill.piece for fill in self._ahead]
        self._drop_ahead()
        self._queue.extendleft(reversed(pieces))

    def _forget(self) -> None:
        """Drop every expected copy and wait for the fills started for them."""
        self._drop_ahead()
        self._queue.clear()
        self._tickets.clear()
        self._next_expected = 0

    def _drop_ahead(self) -> None:
        while self._ahead:
            self._settle(self._ahead.popleft())

    def _settle(self, fill: _Fill) -> None:
        """Wait for a fill whose bytes will not be used; its chunk may be refilled after this."""
        if self._processes is not None:
            for part in fill.parts:
                assert isinstance(part, _ProcessPart)
                with suppress(FillProcessError):  # a process that died writes nothing more
                    self._processes.wait(part.process, part.seq)
            return
        wait(fill.parts)  # type: ignore[arg-type]
        for part in fill.parts:
            assert isinstance(part, Future)
            if part.exception() is None:
                self.device.backend.host.resume_at(part.result())

    def _spans(self, piece: _Piece) -> list[tuple[int, int]]:
        """(offset, size) of the parts of a piece's fill: of its bytes, or of the aligned read that holds them."""
        if self._reader is None:
            return _parts(piece.nbytes, len(self._workers), self.part_bytes)
        extent = self._reader.extent(piece.src_offset, piece.nbytes)
        return _parts(extent.nbytes, len(self._workers), self.part_bytes, self._reader.alignment)

    def _start_fill(self, piece: _Piece, spans: list[tuple[int, int]], sharing: int) -> _Fill:
        chunk = self._chunks[self._next_chunk]
        self._next_chunk = (self._next_chunk + 1) % len(self._chunks)
        if self._caller_waits:
            self._wait_chunk(chunk)
        if self._processes is not None:
            return _Fill(piece, chunk, self._send_parts(chunk, piece, spans))
        if self._reader is not None:
            return self._start_reads(chunk, piece, spans, sharing)
        handoff = self.device.backend.host.timestamp()
        parts = []
        for offset, n in spans:
            worker = self._workers[self._next_worker]
            self._next_worker = (self._next_worker + 1) % len(self._workers)
            parts.append(
                worker.submit(
                    self._fill_part, chunk, piece.source, piece.src_offset + offset, offset, n, handoff, sharing
                )
            )
        return _Fill(piece, chunk, tuple(parts))

    def _start_reads(self, chunk: _Chunk, piece: _Piece, spans: list[tuple[int, int]], sharing: int) -> _Fill:
        """Hand the parts of the aligned read that holds a piece to the threads in turn."""
        assert self._reader is not None
        extent = self._reader.extent(piece.src_offset, piece.nbytes)
        source = self.sources.index(piece.source)
        handoff = self.device.backend.host.timestamp()
        parts = []
        for offset, n in spans:
            worker = self._workers[self._next_worker]
            self._next_worker = (self._next_worker + 1) % len(self._workers)
            # The bytes of this part the piece needs: those before its end (the rest may lie past the file's).
            wanted = min(n, extent.head + piece.nbytes - offset)
            read = _Read(source, extent.start + offset, chunk.base + offset, n, wanted)
            parts.append(worker.submit(self._read_part, chunk, read, handoff, sharing))
        return _Fill(piece, chunk, tuple(parts), chunk.base + extent.head)

    def _read_part(self, chunk: _Chunk, read: _Read, handoff: float, sharing: int) -> float:
        reader = self._reader
        assert reader is not None
        backend = self.device.backend
        backend.host.resume_at(handoff)
        start = backend.host.timestamp()
        chunk.free_event.synchronize()
        reading = backend.host.timestamp()
        cached = reader.read_into(
            backend.host,
            chunk.buffer,
            read.chunk_offset,
            read.nbytes,
            read.source,
            read.file_offset,
            read.wanted,
            sharing=sharing,
        )
        end = backend.host.timestamp()
        with self._stats_lock:
            self._stats.chunk_wait_s += reading - start
            self._stats.fill_s += end - reading
            self._stats.bytes_filled += read.nbytes
            self._stats.bytes_cached += read.nbytes if cached else 0
        return end

    def _wait_chunk(self, chunk: _Chunk) -> None:
        """The caller waits for the chunk's last DMA (fill processes cannot wait for it themselves)."""
        backend = self.device.backend
        start = backend.host.timestamp()
        chunk.free_event.synchronize()
        with self._stats_lock:
            self._stats.chunk_wait_s += backend.host.timestamp() - start

    def _send_parts(self, chunk: _Chunk, piece: _Piece, spans: list[tuple[int, int]]) -> tuple[_ProcessPart, ...]:
        """Hand a chunk's parts to the fill processes in turn."""
        assert self._processes is not None
        source = self.sources.index(piece.source)
        parts: list[_ProcessPart] = []
        for offset, n in spans:
            process = self._next_worker
            self._next_worker = (self._next_worker + 1) % self._processes.count
            try:
                seq = self._processes.send(process, source, piece.src_offset + offset, chunk.index, offset, n)
            except FillProcessError:
                self._settle(_Fill(piece, chunk, tuple(parts)))  # no part sent may write after this
                raise
            parts.append(_ProcessPart(process, seq, n))
        return tuple(parts)

    def _fill_part(
        self,
        chunk: _Chunk,
        source: HostBuffer,
        src_offset: int,
        chunk_offset: int,
        nbytes: int,
        handoff: float,
        sharing: int,
    ) -> float:
        backend = self.device.backend
        # A fill process sleeps until its next command: only one that was idle is woken for it
        # (the fixed cost per copy); one still copying takes it straight from its pipe.
        woken = not self._timed_as_processes or backend.host.timestamp() < handoff
        backend.host.resume_at(handoff)
        start = backend.host.timestamp()
        chunk.free_event.synchronize()
        copying = backend.host.timestamp()
        backend.host.copy(chunk.buffer, chunk_offset, source, src_offset, nbytes, sharing=sharing, fixed_cost=woken)
        end = backend.host.timestamp()
        with self._stats_lock:
            self._stats.chunk_wait_s += copying - start
            self._stats.fill_s += end - copying
            self._stats.bytes_filled += nbytes
        return end

    def _finish_fill(self, fill: _Fill) -> None:
        # Every part ends before any error is raised: a part still writing the chunk must not
        # outlive the fill it belongs to. Resume at every part's end, not only the latest: each
        # handoff carries what its thread did, and the DMA that follows reads what all of them wrote.
        if self._processes is not None:
            self._finish_process_fill(fill)
            return
        wait(fill.parts)  # type: ignore[arg-type]
        for part in fill.parts:
            assert isinstance(part, Future)
            self.device.backend.host.resume_at(part.result())

    def _finish_process_fill(self, fill: _Fill) -> None:
        assert self._processes is not None
        failure: FillProcessError | None = None
        for part in fill.parts:
            assert isinstance(part, _ProcessPart)
            try:
                seconds = self._processes.wait(part.process, part.seq)
            except FillProcessError as exc:
                failure = failure or exc
                continue
            with self._stats_lock:
                self._stats.fill_s += seconds
                self._stats.bytes_filled += part.nbytes
        if failure is not None:
            raise failure

    def _stop_processes(self, failure: FillProcessError) -> None:
        """Fill processes failed: drop their fills (queued again, first) and go on with threads."""
        self._requeue_ahead()  # waits for what the live processes were asked; none writes after this
        processes, self._processes = self._processes, None
        assert processes is not None
        processes.close()
        self.fill_note = str(failure)
        log.warning("%s: staging ring fills its chunks with threads from now on: %s", self.device.label, failure)

    def close(self) -> None:
        """Wait for the fills and the DMAs still using the chunks, then free them."""
        with self._locked():
            if self.closed:
                return
            self.closed = True
            try:
                self._forget()
                for worker in self._workers:
                    worker.shutdown(wait=True)
                if self._processes is not None:
                    self._processes.close()
            finally:
                self._free_chunks()

    def _free_chunks(self) -> None:
        with ExitStack() as stack:  # every chunk is released even if one step fails
            if self._shared is not None:
                stack.callback(self._shared.close)  # runs last: it unmaps what the buffers wrap
            for chunk in self._chunks:
                stack.callback(chunk.free_event.close)
                stack.callback(chunk.buffer.close)
                stack.callback(chunk.free_event.synchronize)  # runs first: a DMA may still read it
        self._chunks.clear()


def _pieces(
    ticket: int, source: HostBuffer, src_offset: int, nbytes: int, chunk_bytes: int, dst_offset: int = 0
) -> list[_Piece]:
    return [
        _Piece(ticket, source, src_offset + start, dst_offset + start, min(chunk_bytes, nbytes - start))
        for start in range(0, nbytes, chunk_bytes)
    ]


def _parts(nbytes: int, threads: int, part_bytes: int, align: int = 1) -> list[tuple[int, int]]:
    """(offset, size) of the pieces one chunk fill is split into, one per thread at most, each
    starting at a multiple of ``align``."""
    count = max(1, min(threads, nbytes // part_bytes))
    step = -(-nbytes // count)
    step = -(-step // align) * align
    return [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]


@dataclass(frozen=True)
class RingRegion(HostRegion):
    """A byte range of one of a StagingRing's sources; copies from it go through the ring's chunks."""

    ring: StagingRing
    source: int = 0  # index into ring.sources

    @property
    def blocks_host(self) -> bool:
        return True  # the caller waits for the chunk fills

    @property
    def staged(self) -> bool:
        return True  # the DMAs read pinned chunks: no wait binds to them as to a pageable copy

    @property
    def lookahead(self) -> StagingRing:
        return self.ring

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        self._check_range(offset, nbytes)
        self.ring.copy(stream, dst, dst_offset, self.start + offset, nbytes, self.source)

    def enqueue_h2d_ranges(self, stream: Stream, dst: DeviceBuffer, ranges: Sequence[tuple[int, int]]) -> None:
        for start, end in ranges:
            self._check_range(start, end - start)
        self.ring.copy_ranges(
            stream, dst, [(start, self.start + start, end - start) for start, end in ranges], self.source
        )
