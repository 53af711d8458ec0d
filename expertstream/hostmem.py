"""Host-resident tensor data as the scheduler sees it: a region it can enqueue a copy from.

A region of a plain HostBuffer copies with one ``stream.copy_h2d``; other sources (a pinned
staging ring fed from a file mapping) implement the same two members.

``HostWeights`` puts a model's tensors in host memory in one of four ways, which decide the
transfer speed: the file mapping as it is (pageable: slow, and copies block the host), the
mapping registered in place (DMA speed), one pinned copy of the tensors (DMA speed, a full
copy in RAM), or a staging ring of a few pinned chunks fed from the mapping by host threads.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from .backends.base import Device, DeviceBuffer, Event, HostBuffer, Stream, check_range
from .errors import DeviceError, InvalidArgument, UseAfterClose
from .model.loader import MoeModel, TensorInfo
from .scheduler.source import HostRegion, HostSource

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Staging ring: pinned chunks fed from pageable memory by host threads
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    buffer: HostBuffer  # one pinned chunk
    free_event: Event  # recorded after the last DMA that read this chunk


@dataclass(frozen=True)
class _Piece:
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class _Fill:
    piece: _Piece
    slot: _Slot
    parts: tuple[Future[float], ...]  # each returns the filling thread's clock when done


class StagingRing:
    """Copies from pageable host memory at DMA speed through a few pinned chunks.

    ``copy`` splits a range into chunk-sized pieces. A pool of host threads memcpys piece
    k+1 (and later ones, up to the number of chunks) into its chunk while the device DMAs
    piece k from its own chunk. A chunk is refilled only after the event recorded behind
    its previous DMA has completed, so the host never overwrites bytes a copy still reads.
    Pinned memory stays at ``chunks * chunk_bytes`` whatever the size of the source.

    ``copy`` blocks the calling thread until the last piece is enqueued; call it from a
    copy worker. One caller at a time: concurrent callers are serialized by a lock.
    """

    def __init__(self, source: HostBuffer, *, chunk_bytes: int, chunks: int, threads: int) -> None:
        if chunk_bytes < 1 or chunks < 2 or threads < 1:
            raise InvalidArgument(
                f"a staging ring needs chunk_bytes >= 1, chunks >= 2 and threads >= 1; got "
                f"{chunk_bytes}, {chunks}, {threads}",
                call="StagingRing",
            )
        self.source = source
        self.device = source.device
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

    def region(self, start: int, length: int) -> RingRegion:
        return RingRegion(self.source, start, length, self)

    def copy(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, src_offset: int, nbytes: int) -> None:
        """Enqueue a copy of ``source[src_offset : src_offset + nbytes]`` into ``dst`` on ``stream``."""
        call = "StagingRing.copy"
        if stream.device is not self.device:
            raise InvalidArgument(
                f"the ring's chunks are pinned for {self.device.label}", call=call, device=stream.device.label
            )
        check_range(call, dst, dst_offset, nbytes)
        check_range(call, self.source, src_offset, nbytes)
        with self._lock:
            if self.closed:
                raise UseAfterClose("staging ring is closed", call=call, device=self.device.label)
            self._pipeline(stream, dst, _pieces(src_offset, dst_offset, nbytes, self.chunk_bytes))

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
            parts.append(worker.submit(self._fill_part, slot, piece.src_offset + offset, offset, n, handoff))
        return _Fill(piece, slot, tuple(parts))

    def _fill_part(self, slot: _Slot, src_offset: int, chunk_offset: int, nbytes: int, handoff: float) -> float:
        backend = self.device.backend
        backend.host_resume_at(handoff)
        slot.free_event.synchronize()
        self.device.host_copy(slot.buffer, chunk_offset, self.source, src_offset, nbytes)
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

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A fill is not split into parts smaller than this: on the H200 host, 64 MiB chunks split
# into 4 MiB parts over 16 threads streamed slower (23 GB/s) than 5.3 MiB parts over 12
# (27.5 GB/s), and 16 MiB chunks in 1.3 MiB parts fell to 12 GB/s.
_MIN_PART_BYTES = 4 << 20


def _pieces(src_offset: int, dst_offset: int, nbytes: int, chunk_bytes: int) -> deque[_Piece]:
    return deque(
        _Piece(src_offset + start, dst_offset + start, min(chunk_bytes, nbytes - start))
        for start in range(0, nbytes, chunk_bytes)
    )


def _parts(nbytes: int, threads: int) -> list[tuple[int, int]]:
    """(offset, size) of the pieces one chunk fill is split into, one per thread at most."""
    count = max(1, min(threads, nbytes // _MIN_PART_BYTES))
    step = -(-nbytes // count)
    return [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]


@dataclass(frozen=True)
class RingRegion(HostRegion):
    """A byte range of a StagingRing's source; copies from it go through the ring's chunks."""

    ring: StagingRing

    @property
    def blocks_host(self) -> bool:
        return True  # the caller waits for the chunk fills

    def enqueue_h2d(self, stream: Stream, dst: DeviceBuffer, dst_offset: int, offset: int, nbytes: int) -> None:
        self._check_range(offset, nbytes)
        self.ring.copy(stream, dst, dst_offset, self.start + offset, nbytes)


# --------------------------------------------------------------------------------------
# A model's tensors in host memory
# --------------------------------------------------------------------------------------


class HostMemoryMode(enum.Enum):
    MMAP = "mmap"  # the file mapping itself: pageable
    REGISTERED = "registered"  # the mapping page-locked in place, read-only
    PINNED = "pinned"  # one pinned allocation holding a copy of the tensors
    RING = "ring"  # a staging ring of pinned chunks fed from the mapping
    AUTO = "auto"  # registered where the device supports it, else ring


@dataclass(frozen=True)
class HostMemoryFallback:
    requested: HostMemoryMode
    used: HostMemoryMode
    reason: str


@dataclass
class HostWeightsStats:
    fallbacks: list[HostMemoryFallback] = field(default_factory=list)
    registered_bytes: int = 0  # host memory page-locked in place
    pinned_bytes: int = 0  # pinned memory allocated: the copy, or the ring's chunks


DEFAULT_RING_CHUNK_BYTES = 64 << 20
DEFAULT_RING_CHUNKS = 4
# One thread memcpys from a file mapping at a fraction of PCIe speed (6 GB/s through the ring
# on the H200 host); 12 threads gave 27-32 GB/s there, 8 gave 23-24 and 16 no more than 12.
DEFAULT_RING_THREADS = min(12, os.cpu_count() or 1)
_PINNED_ALIGN = 4096


class HostWeights(Mapping[str, HostSource]):
    """A model's tensors (routers and experts) by name, each a HostSource in host memory.

    ``mode`` is the mode actually used (AUTO and a refused REGISTERED resolve to another);
    ``stats`` records fallbacks with their reason and the page-locked bytes. Close it (or
    use it as a context manager) after the copies from it have finished.
    """

    def __init__(
        self,
        model: MoeModel,
        device: Device,
        mode: HostMemoryMode,
        regions: dict[str, HostSource],
        resources: list[HostBuffer | StagingRing],
        stats: HostWeightsStats,
        owns_model: bool,
    ) -> None:
        self.model = model
        self.device = device
        self.mode = mode
        self.stats = stats
        self._regions = regions
        self._resources = resources
        self._owns_model = owns_model
        self.closed = False

    @classmethod
    def open(
        cls,
        model_or_path: MoeModel | str | Path,
        device: Device,
        mode: HostMemoryMode | str = HostMemoryMode.AUTO,
        *,
        ring_chunk_bytes: int = DEFAULT_RING_CHUNK_BYTES,
        ring_chunks: int = DEFAULT_RING_CHUNKS,
        ring_threads: int = DEFAULT_RING_THREADS,
    ) -> HostWeights:
        """Place the tensors of a model (or of the GGUF file at a path, opened and owned here)."""
        requested = _parse_mode(mode)
        owns_model = not isinstance(model_or_path, MoeModel)
        model = MoeModel.open(model_or_path) if not isinstance(model_or_path, MoeModel) else model_or_path
        try:
            ring = _RingOptions(ring_chunk_bytes, ring_chunks, ring_threads)
            return cls(model, device, *_place(model, device, requested, ring), owns_model=owns_model)
        except BaseException:
            if owns_model:
                model.close()
            raise

    def __getitem__(self, name: str) -> HostSource:
        return self._regions[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def close(self) -> None:
        """Unregister or free the host memory (pending copies must be finished first)."""
        if self.closed:
            return
        self.closed = True
        with ExitStack() as stack:
            if self._owns_model:
                stack.callback(self.model.close)
            for resource in self._resources:
                stack.callback(resource.close)  # closed last-made first

    def __enter__(self) -> HostWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostWeights({self.mode.value}, {len(self)} tensors on {self.device.label})"


def _parse_mode(mode: HostMemoryMode | str) -> HostMemoryMode:
    try:
        return HostMemoryMode(mode)
    except ValueError:
        raise InvalidArgument(
            f"unknown host memory mode {mode!r}",
            call="HostWeights.open",
            hint=f"choose one of {', '.join(m.value for m in HostMemoryMode)}",
        ) from None


@dataclass(frozen=True)
class _RingOptions:
    chunk_bytes: int
    chunks: int
    threads: int


_Placement = tuple[HostMemoryMode, dict[str, HostSource], list[HostBuffer | StagingRing], HostWeightsStats]


def _place(model: MoeModel, device: Device, requested: HostMemoryMode, ring: _RingOptions) -> _Placement:
    stats = HostWeightsStats()
    tensors = list(model.tensors.values())
    if requested is HostMemoryMode.MMAP:
        mapping = device.wrap_host(model.mapping)
        return requested, _regions(mapping, tensors), [mapping], stats
    if requested is HostMemoryMode.PINNED:
        pinned, regions = _pinned_copy(model, device, tensors)
        stats.pinned_bytes = pinned.nbytes
        return requested, regions, [pinned], stats
    if requested in (HostMemoryMode.REGISTERED, HostMemoryMode.AUTO):
        mapping = device.wrap_host(model.mapping)
        reason = _register(mapping)
        if reason is None:
            stats.registered_bytes = mapping.nbytes
            return HostMemoryMode.REGISTERED, _regions(mapping, tensors), [mapping], stats
        mapping.close()
        _note_fallback(stats, requested, reason, device, tensors, ring)
    staging = _ring(model, device, tensors, ring)
    stats.pinned_bytes = staging.pinned_bytes
    ring_regions: dict[str, HostSource] = {t.name: staging.region(t.offset, t.nbytes) for t in tensors}
    # Closed in reverse: the ring (which waits for its DMAs) before the mapping it reads.
    return HostMemoryMode.RING, ring_regions, [staging.source, staging], stats


def _regions(buffer: HostBuffer, tensors: list[TensorInfo]) -> dict[str, HostSource]:
    return {t.name: HostRegion(buffer, t.offset, t.nbytes) for t in tensors}


def _register(mapping: HostBuffer) -> str | None:
    """Register the mapping read-only in place; the reason if the platform refuses."""
    caps = mapping.device.capabilities
    if not caps.host_register:
        return "host registration is not supported"
    if not caps.host_register_read_only:
        return "read-only host registration is not supported"
    try:
        mapping.register(read_only=True)
    except DeviceError as exc:
        return f"{exc.detail} [{exc.code}]" if exc.code else exc.detail
    return None


def _note_fallback(
    stats: HostWeightsStats,
    requested: HostMemoryMode,
    reason: str,
    device: Device,
    tensors: list[TensorInfo],
    ring: _RingOptions,
) -> None:
    stats.fallbacks.append(HostMemoryFallback(requested, HostMemoryMode.RING, reason))
    total = sum(t.nbytes for t in tensors)
    # An explicit request the platform refused is worth a warning; AUTO only chose.
    level = logging.WARNING if requested is HostMemoryMode.REGISTERED else logging.INFO
    log.log(
        level,
        "registered host memory is unavailable on %s (%s): %s; streaming %d bytes of tensors through a "
        "staging ring of %d x %d pinned bytes instead",
        device.label,
        device.name,
        reason,
        total,
        ring.chunks,
        _chunk_bytes(tensors, ring),
    )


def _chunk_bytes(tensors: list[TensorInfo], ring: _RingOptions) -> int:
    # No copy is larger than the largest tensor, so a bigger chunk would be wasted.
    return max(1, min(ring.chunk_bytes, max((t.nbytes for t in tensors), default=1)))


def _ring(model: MoeModel, device: Device, tensors: list[TensorInfo], ring: _RingOptions) -> StagingRing:
    mapping = device.wrap_host(model.mapping)
    try:
        return StagingRing(mapping, chunk_bytes=_chunk_bytes(tensors, ring), chunks=ring.chunks, threads=ring.threads)
    except BaseException:
        mapping.close()
        raise


def _pinned_copy(
    model: MoeModel, device: Device, tensors: list[TensorInfo]
) -> tuple[HostBuffer, dict[str, HostSource]]:
    """One pinned allocation holding every tensor, each at a page-aligned offset."""
    offsets: dict[str, int] = {}
    total = 0
    for t in tensors:
        offsets[t.name] = total
        total += -(-t.nbytes // _PINNED_ALIGN) * _PINNED_ALIGN
    pinned = device.alloc_pinned(total)
    try:
        with device.wrap_host(model.mapping) as mapping:
            for t in tensors:
                device.host_copy(pinned, offsets[t.name], mapping, t.offset, t.nbytes)
    except BaseException:
        pinned.close()
        raise
    return pinned, {t.name: HostRegion(pinned, offsets[t.name], t.nbytes) for t in tensors}
