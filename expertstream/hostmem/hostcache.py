"""Mode disk's RAM tier: the first layers' tensors read once into one pinned buffer and served from there,
and single experts that decode uses again.

With a host cache of SIZE bytes, mode disk reads the tensors of whole MoE layers (router and
experts), first layers first, as many as fit SIZE together, from the files into one pinned buffer
when it opens. Copies of those tensors are plain DMAs from that buffer (``HostRegion``); only the
other layers' tensors are read from the drive through the staging ring, at every use. The first
layers, because a prefill (and a decode step) copies them first: while they cross from RAM, the
ring is already reading the first layer it serves.

What SIZE has left after the whole layers goes to single experts of the other layers
(``ExpertTier``), for decode, which copies only the experts its token uses: an expert a decode
step asks for the ``ADMIT_AT_USE``-th time (or later, where it then fits) is read once from the
files into the tier and copied from there at every later use (``TieredRegion``). Once the tier is
full, such an expert takes the slot of the least used one it fits in, where that one has fewer uses,
after the copies already enqueued from the slot are done: the tier keeps the most used experts.
Whole-tensor copies (prefill) still come through the ring.

The reads go through the ring's ``FileReader`` and ``Host.read_into``: O_DIRECT where the
filesystem allows (the page cache is not filled; buffered reads are dropped from it), out of the
page cache where the bytes lie there already, and on the simulator charged at the profile's drive
rate. Each tensor is read rounded out to the reader's
alignment into an aligned place of the buffer and served from inside it, so the buffer holds a few
KiB per tensor more than the tensors.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .._closing import Closing
from ..backends.base import Device, DeviceBuffer, Event, HostBuffer, Stream
from ..model.loader import MoeLayer, MoeModel, TensorInfo
from ..scheduler.source import HostRegion, HostSource
from .diskread import Extent, FileReader
from .staging import RingRegion

# One read of the buffer's fill: large enough that the drive's latency per read is nothing beside
# its bytes, a multiple of every alignment the reader takes (at most 64 KiB).
CACHE_READ_BYTES = 64 << 20


def layer_bytes(layer: MoeLayer) -> int:
    """The bytes of a layer's tensors the host cache holds: its router's and its experts'."""
    return sum(t.nbytes for t in (layer.router, *layer.experts))


def cached_layers(model: MoeModel, size: int) -> tuple[MoeLayer, ...]:
    """The first MoE layers whose tensors fit ``size`` bytes together (a whole prefix: none after the
    first that does not fit)."""
    taken: list[MoeLayer] = []
    total = 0
    for layer in model.layers:
        total += layer_bytes(layer)
        if total > size:
            break
        taken.append(layer)
    return tuple(taken)


def read_host_cache(
    layers: Sequence[MoeLayer], device: Device, reader: FileReader
) -> tuple[HostBuffer | None, dict[str, HostSource]]:
    """One pinned buffer holding the tensors of ``layers`` read from the files, and a region of it per
    tensor by name (None and no regions for no layers)."""
    tensors = [t for layer in layers for t in (layer.router, *layer.experts)]
    if not tensors:
        return None, {}
    align = reader.alignment
    extents = [reader.extent(t.offset, t.nbytes) for t in tensors]
    buffer = device.alloc_pinned(align + sum(e.nbytes for e in extents))  # room to start at an aligned address
    try:
        regions: dict[str, HostSource] = {}
        place = -buffer.address % align
        for tensor, extent in zip(tensors, extents, strict=True):
            _read_extent(device, reader, buffer, place, tensor.shard, tensor.nbytes, extent)
            regions[tensor.name] = HostRegion(buffer, place + extent.head, tensor.nbytes)
            place += extent.nbytes
    except BaseException:
        buffer.close()
        raise
    return buffer, regions


def _read_extent(
    device: Device, reader: FileReader, buffer: HostBuffer, place: int, shard: int, nbytes: int, extent: Extent
) -> None:
    """Read the aligned extent that holds ``nbytes`` wanted bytes of file ``shard`` into ``buffer`` at
    ``place``, in aligned reads."""
    wanted_end = extent.head + nbytes  # the bytes after them may lie past the end of the file
    for start in range(0, extent.nbytes, CACHE_READ_BYTES):
        nbytes = min(CACHE_READ_BYTES, extent.nbytes - start)
        wanted = min(nbytes, wanted_end - start)
        reader.read_into(device.backend.host, buffer, place + start, nbytes, shard, extent.start + start, wanted)


def expert_slot_bytes(tensor: TensorInfo, reader: FileReader) -> int:
    """The most bytes of an ExpertTier one expert of ``tensor`` can take: its bytes rounded out to the
    reader's alignment at both ends."""
    return tensor.slice_nbytes + 2 * reader.alignment


# The use (counted per expert of a tensor over the decode steps) at which an expert enters the tier:
# the second, so an expert a single token used does not take the room of one decode keeps using.
ADMIT_AT_USE = 2


@dataclass
class _Slot:
    """Where one expert's bytes lie in an ExpertTier, and the event after the last copy from them."""

    key: tuple[str, int]  # (tensor name, expert)
    region: HostRegion  # the expert's bytes
    place: int  # the start of the aligned extent read there
    room: int  # the buffer bytes the slot spans: the extent first read into it
    done: Event


class ExpertTier(Closing):
    """Single experts' bytes of expert tensors, read from the files into one pinned buffer as decode
    uses them again (see the module's docstring). Thread-safe.

    Full, it keeps the most used: an expert at ADMIT_AT_USE or more uses takes the slot of the least
    used one it fits in, where that one has fewer uses, after the copies from that slot are done.
    """

    def __init__(self, device: Device, reader: FileReader, capacity: int) -> None:
        self.device = device
        self._reader = reader
        self._buffer = device.alloc_pinned(capacity)
        self._place = -self._buffer.address % reader.alignment  # the next free slot, at an aligned address
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._uses: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        """The pinned bytes the tier holds (its capacity)."""
        return self._buffer.nbytes

    @property
    def experts(self) -> int:
        """How many experts it holds."""
        with self._lock:
            return len(self._slots)

    def region(self, tensor: TensorInfo, ring: RingRegion) -> TieredRegion:
        """``tensor``'s source: its ring region, with this tier in front of it for single experts."""
        return TieredRegion(ring.buffer, ring.start, ring.length, ring.ring, ring.source, tier=self, tensor=tensor)

    def copy(self, stream: Stream, dst: DeviceBuffer, tensor: TensorInfo, expert: int, start: int, end: int) -> bool:
        """Enqueue a copy of bytes ``[start, end)`` of ``tensor``, all of them in ``expert``, from the tier into
        the same offsets of ``dst``, if it holds that expert (False: it does not, nothing enqueued)."""
        with self._lock:
            slot = self._slots.get((tensor.name, expert))
            if slot is None:
                return False
            slot.region.enqueue_h2d(stream, dst, start, start - expert * tensor.slice_nbytes, end - start)
            stream.record(slot.done)  # an eviction waits for it before refilling the slot
            return True

    def used(self, tensor: TensorInfo, experts: Sequence[int]) -> None:
        """Count a decode step's use of ``experts`` of ``tensor``; read those at ADMIT_AT_USE or more uses
        into the tier where a free place or a less used expert's slot takes them."""
        with self._lock:
            for expert in experts:
                key = (tensor.name, expert)
                self._uses[key] += 1
                if key in self._slots or self._uses[key] < ADMIT_AT_USE:
                    continue
                nbytes = tensor.slice_nbytes
                extent = self._reader.extent(tensor.offset + expert * nbytes, nbytes)
                slot = self._free_slot(key, extent.nbytes)
                if slot is None:
                    continue
                _read_extent(self.device, self._reader, self._buffer, slot.place, tensor.shard, nbytes, extent)
                slot.region = HostRegion(self._buffer, slot.place + extent.head, nbytes)
                self._slots[key] = slot

    def _free_slot(self, key: tuple[str, int], need: int) -> _Slot | None:
        """A slot of at least ``need`` bytes for ``key``: a free place, else the least used held expert's
        with fewer uses than ``key`` (its copies waited for, it leaves the tier), else None. Holds the lock."""
        if self._place + need <= self._buffer.nbytes:
            slot = _Slot(key, HostRegion(self._buffer, self._place, 0), self._place, need, self.device.event())
            self._place += need
            return slot
        fits = [s for s in self._slots.values() if s.room >= need]
        if not fits:
            return None
        victim = min(fits, key=lambda s: self._uses[s.key])  # the first held among equals: deterministic
        if self._uses[victim.key] >= self._uses[key]:
            return None
        victim.done.synchronize()
        del self._slots[victim.key]
        self.evictions += 1
        victim.key = key
        return victim

    def close(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            slot.done.close()
        self._buffer.close()  # idempotent


@dataclass(frozen=True, kw_only=True)
class TieredRegion(RingRegion):
    """An expert tensor in mode disk behind an ExpertTier: a region of its staging ring (whole copies, and
    the ring's lookahead, as any), whose ranges for a decode step come from the tier for each expert it
    holds and through the ring for the rest."""

    tier: ExpertTier
    tensor: TensorInfo

    def enqueue_h2d_ranges(self, stream: Stream, dst: DeviceBuffer, ranges: Sequence[tuple[int, int]]) -> None:
        """Each range cut at expert boundaries: a piece of an expert the tier holds is a DMA from it, the
        others go to the ring together. Then the experts asked for whole count as used."""
        size = self.tensor.slice_nbytes
        rest: list[tuple[int, int]] = []
        whole: list[int] = []
        for start, end in ranges:
            self._check_range(start, end - start)
            at = start
            while at < end:
                expert = at // size
                stop = min(end, (expert + 1) * size)
                if at == expert * size and stop == (expert + 1) * size:
                    whole.append(expert)
                if not self.tier.copy(stream, dst, self.tensor, expert, at, stop):
                    if rest and rest[-1][1] == at:
                        rest[-1] = (rest[-1][0], stop)
                    else:
                        rest.append((at, stop))
                at = stop
        if rest:
            super().enqueue_h2d_ranges(stream, dst, rest)
        self.tier.used(self.tensor, whole)
