"""Where a model's tensors live in host memory, which decides how fast they reach the device.

``HostWeights`` puts a model's tensors in host memory in one of five ways: the file mapping as
it is (pageable: slow, and copies block the host), the mapping registered in place (DMA
speed), one pinned copy of the tensors (DMA speed, a full copy in RAM), a staging ring of a
few pinned chunks fed from the mapping by host threads (``staging``), or such a ring whose
chunks are read straight from the files, bypassing the page cache where it does not hold them
already (``diskread``), the first
layers' perhaps kept in RAM (``hostcache``). Each tensor becomes a ``HostSource`` the scheduler
can copy from. A split model has one mapping per shard, each wrapped (and registered) on its
own; one ring reads them all. With a layer split over several devices, a staging ring is per
device (its chunks and events are that device's): each tensor goes through the ring of the
device it is copied to.
"""

from __future__ import annotations

import enum
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from .._closing import Closing
from .._deprecated import REMOVED_IN
from ..backends.base import Device, HostBuffer
from ..errors import DeviceError, InvalidArgument
from ..model.loader import MoeModel, TensorInfo
from ..scheduler.source import HostRegion, HostSource
from . import memlimit
from .diskread import FileReader, Opener, Resident, in_page_cache
from .hostcache import ExpertTier, cached_layers, expert_slot_bytes, layer_bytes, read_host_cache
from .memlimit import MemoryReader
from .staging import RingFill, RingRegion, RingStats, StagingRing

log = logging.getLogger(__name__)


class HostMemoryMode(enum.Enum):
    """How a model's tensors are placed in host memory (``--host-memory``).

    A placement decides which kind of host buffer (``backends.base.HostMemory``: pageable,
    pinned, registered) the tensors end up in, and whether a staging ring sits in front.
    """

    MMAP = "mmap"  # the file mapping itself: pageable
    REGISTERED = "registered"  # the mapping page-locked in place, read-only
    PINNED = "pinned"  # one pinned allocation holding a copy of the tensors
    RING = "ring"  # a staging ring of pinned chunks fed from the mapping
    DISK = "disk"  # a staging ring whose chunks are read from the files with O_DIRECT (no page cache)
    # The fixed rule a run takes when it names no mode: disk where the tensors do not fit the host
    # memory the process may fill (memlimit), else registered where the device supports it, else
    # ring. (The command line's ``--host-memory auto`` is another thing: the fastest mode by prediction.)
    PREFERRED = "preferred"

    @classmethod
    def _missing_(cls, value: object) -> HostMemoryMode | None:
        if value == "auto":  # this rule's name before 0.2: kept for one release
            warnings.warn(
                f"host memory mode 'auto' is now 'preferred'; the old name goes away in {REMOVED_IN}",
                DeprecationWarning,
                stacklevel=2,
            )
            return cls.PREFERRED
        return None


@dataclass(frozen=True)
class RingOptions:
    """How a staging ring is built, where one is: who fills it and its geometry.

    ``threads``: its workers, threads or fill processes (None: ``default_ring_threads`` of the
    device); ``fill``: which (``RingFill``); ``chunks``, ``chunk_bytes`` and ``part_bytes`` (the
    least bytes a worker copies of a chunk's fill): None takes what suits the workers
    (``StagingRing``).
    """

    fill: RingFill | str = RingFill.AUTO
    threads: int | None = None
    chunks: int | None = None
    chunk_bytes: int | None = None
    part_bytes: int | None = None


@dataclass(frozen=True)
class HostMemoryFallback:
    requested: HostMemoryMode
    used: HostMemoryMode
    reason: str


@dataclass
class HostWeightsStats:
    fallbacks: list[HostMemoryFallback] = field(default_factory=list)
    registered_bytes: int = 0  # host memory page-locked in place
    pinned_bytes: int = 0  # pinned memory allocated: the copy, or the ring's chunks and the host cache
    host_cache_bytes: int = 0  # mode disk: tensor bytes held in RAM (the host cache), read once at open
    host_cache_layers: int = 0  # the MoE layers those tensors belong to: the model's first
    host_cache_expert_bytes: int = 0  # mode disk: the rest of the host cache, for single experts decode uses again


# Inside a prefill on the H200 host, 12 threads each copied 3-5 GB/s from the mapping; 14 and 16
# threads were no faster together, each copying slower (docs/results/hostmem-h200.md).
DEFAULT_RING_THREADS = min(12, os.cpu_count() or 1)


def default_ring_threads(device: Device) -> int:
    """The staging ring's threads on ``device``: the number its backend names for the machine it
    stands for (a simulator profile's ``ring_threads``), so a prediction does not take this host's
    core count; else this host's default."""
    return device.backend.host.ring_threads or DEFAULT_RING_THREADS


_PINNED_ALIGN = 4096

_Resource = HostBuffer | StagingRing | FileReader | ExpertTier  # what HostWeights closes, last-made first


class HostWeights(Mapping[str, HostSource], Closing):
    """A model's tensors (routers and experts) by name, each a HostSource in host memory.

    ``mode`` is the mode actually used (PREFERRED and a refused REGISTERED resolve to another);
    ``stats`` records fallbacks with their reason and the page-locked bytes. Close it (or
    use it as a context manager) after the copies from it have finished.
    """

    def __init__(
        self,
        model: MoeModel,
        device: Device,
        mode: HostMemoryMode,
        regions: dict[str, HostSource],
        resources: list[_Resource],
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
        mode: HostMemoryMode | str = HostMemoryMode.PREFERRED,
        *,
        ring: RingOptions = RingOptions(),
        copied_to: Mapping[str, Device] | None = None,
        opener: Opener = os.open,
        memory: MemoryReader | None = None,
        host_cache: int | None = None,
        page_cache: bool | Resident = True,
    ) -> HostWeights:
        """Place the tensors of a model (or of the GGUF file at a path, opened and owned here).

        ``ring``: the staging ring's options, used where the mode is (or falls back to) a ring.
        ``copied_to`` names, for a layer split, the device a tensor is copied to where it is not
        ``device``; only a staging ring depends on it. ``opener`` opens the model's files for mode
        disk, as ``os.open`` does. ``memory`` tells the preferred rule how much host memory the
        process may fill (None: ``memlimit.read_memory_limit``). ``host_cache``: mode disk only, bytes
        of RAM for the tensors of the first whole layers, read once here and served from there
        (``hostcache``); the other layers' are read from the files at every use. ``page_cache``: mode
        disk reads the ranges the kernel holds in its page cache already from there, not from the
        drive, and where it holds every streamed byte at open, the ring copies from the mappings as
        mode ring does (False: every read from the drive; the simulator models no page cache; a
        function of the shape of ``diskread.in_page_cache`` stands in for the kernel, on any backend).
        """
        requested = _parse_mode(mode)
        _check_host_cache(requested, host_cache)
        owns_model = not isinstance(model_or_path, MoeModel)
        model = MoeModel.open(model_or_path) if not isinstance(model_or_path, MoeModel) else model_or_path
        try:
            targets = dict(copied_to or {})
            too_big = memlimit.model_too_big(model, memory) if requested is HostMemoryMode.PREFERRED else None
            used = HostMemoryMode.DISK if too_big else requested
            # Mode disk chosen for want of memory never copies from the mappings: their page faults
            # would fill the page cache under the very limit that chose it.
            placed = _place(
                model,
                device,
                used,
                ring,
                targets,
                opener,
                host_cache or 0,
                page_cache,
                may_copy_mappings=too_big is None,
            )
            weights = cls(model, device, *placed, owns_model=owns_model)
            if too_big is not None:
                _note_disk_chosen(weights, too_big)
            return weights
        except BaseException:
            if owns_model:
                model.close()
            raise

    def __getitem__(self, name: str) -> HostSource:
        return self._regions[name]

    @property
    def rings(self) -> tuple[StagingRing, ...]:
        """The staging rings the tensors are copied through (one per target device; none but in ring and
        disk, nor in disk where the host cache holds every tensor)."""
        return tuple(_rings_of(self._resources))

    def ring_stats(self) -> RingStats | None:
        """The rings' time accounts so far, summed (None without a ring)."""
        rings = self.rings
        return sum((ring.stats for ring in rings), RingStats()) if rings else None

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


def _check_host_cache(requested: HostMemoryMode, host_cache: int | None) -> None:
    if host_cache is None:
        return
    if requested is not HostMemoryMode.DISK:
        raise InvalidArgument(
            f"host_cache is a RAM tier of host memory mode disk, not of {requested.value}",
            call="HostWeights.open",
            hint="pass mode disk (--host-memory disk) with it, or leave host_cache (--host-cache) out: the other "
            "modes serve every tensor from RAM or the file mapping already",
        )
    if host_cache < 0:
        raise InvalidArgument(
            f"host_cache must be >= 0 bytes, got {host_cache}", call="HostWeights.open", hint="give a size such as 24G"
        )


_Placement = tuple[HostMemoryMode, dict[str, HostSource], list[_Resource], HostWeightsStats]


def _place(
    model: MoeModel,
    device: Device,
    requested: HostMemoryMode,
    ring: RingOptions,
    targets: dict[str, Device],
    opener: Opener,
    host_cache: int,
    page_cache: bool | Resident,
    *,
    may_copy_mappings: bool,
) -> _Placement:
    """One mapping (and registration) per shard; a ring (one per target device) reads every shard's mapping,
    or, in mode disk, every shard's file (the tensors the host cache holds aside: none reads them)."""
    stats = HostWeightsStats()
    tensors = list(model.tensors.values())
    if requested is HostMemoryMode.PINNED:
        pinned, regions = _pinned_copy(model, device, tensors)
        stats.pinned_bytes = pinned.nbytes
        return requested, regions, [pinned], stats
    mappings = _wrap_mappings(model, device)
    resources: list[_Resource] = list(mappings)
    refused: str | None = None  # why registration was refused, if it was
    reader: FileReader | None = None
    try:
        if requested is HostMemoryMode.MMAP:
            return requested, _regions(mappings, tensors), list(mappings), stats
        if requested in (HostMemoryMode.REGISTERED, HostMemoryMode.PREFERRED):
            reason = _register_all(mappings)
            if reason is None:
                stats.registered_bytes = sum(m.nbytes for m in mappings)
                return HostMemoryMode.REGISTERED, _regions(mappings, tensors), list(mappings), stats
            refused = reason
            # Fresh, unregistered mappings for the ring: some shards may have been registered.
            _close_all(mappings)
            mappings = _wrap_mappings(model, device)
            resources = list(mappings)
        by_name: dict[str, HostSource] = {}
        tier: ExpertTier | None = None
        if requested is HostMemoryMode.DISK:
            # Closed after the rings that read through it (resources close in reverse).
            reader = FileReader(model.paths, opener=opener, resident=_resident(page_cache, device))
            resources.append(reader)
            by_name.update(_host_cache(model, device, reader, host_cache, stats, resources))
            tier = _expert_tier(model, device, reader, host_cache - stats.host_cache_bytes, stats, resources, by_name)
        by_device: dict[Device, list[TensorInfo]] = {}
        for t in tensors:
            if t.name not in by_name:
                by_device.setdefault(targets.get(t.name, device), []).append(t)
        ring_reader = reader
        streamed = [t for mine in by_device.values() for t in mine]
        if may_copy_mappings and reader is not None and reader.direct and _in_page_cache(reader, streamed):
            ring_reader = None  # the ring copies from the mappings, as mode ring does
            _note_page_cache(stats, device)
        largest = max((t.nbytes for t in tensors), default=1)
        for target, mine in by_device.items():
            sources = mappings if target is device else _wrap_mappings(model, target)
            if target is not device:
                resources.extend(sources)
            staging = StagingRing(
                sources,
                threads=default_ring_threads(device) if ring.threads is None else ring.threads,
                chunk_bytes=ring.chunk_bytes,
                chunks=ring.chunks,
                part_bytes=ring.part_bytes,
                fill=ring.fill,
                max_copy_bytes=largest,
                reader=ring_reader,
            )
            # Closed in reverse: a ring (which waits for its DMAs) before the mappings it reads.
            resources.append(staging)
            stats.pinned_bytes += staging.pinned_bytes
            by_name.update({t.name: staging.region(t.offset, t.nbytes, t.shard) for t in mine})
        if tier is not None:
            _behind_tier(tier, model, by_name)
        if refused is not None:
            _note_fallback(stats, requested, refused, tensors, staging)
        if reader is not None and reader.fallback_reason is not None:
            _note_buffered_reads(stats, reader.fallback_reason, tensors, device, _rings_of(resources))
    except BaseException:
        _close_all(resources)
        raise
    # In the tensors' order, whichever tier holds each.
    ordered = {t.name: by_name[t.name] for t in tensors}
    return HostMemoryMode.DISK if reader is not None else HostMemoryMode.RING, ordered, resources, stats


def _resident(page_cache: bool | Resident, device: Device) -> Resident | None:
    """Who says which ranges lie in the page cache: the kernel on a real backend (the simulated
    machine's page cache is not modelled: its drive serves every read), a stand-in, or no one."""
    if callable(page_cache):
        return page_cache
    return in_page_cache if page_cache and not device.backend.host.virtual_time else None


def _in_page_cache(reader: FileReader, tensors: Sequence[TensorInfo]) -> bool:
    """Whether every byte of ``tensors`` lies in the page cache now (never where the reader asks no one,
    nor where a file ends before its tensors do: the drive's reads then say so)."""
    return bool(tensors) and all(reader.cached(t.shard, t.offset, t.nbytes) for t in tensors)


# Why mode disk's ring copies from the files' mappings rather than reading the drive.
PAGE_CACHE_REASON = (
    "every byte of the tensors it streams lay in the page cache when it opened (the files were read lately, "
    "with room to keep them): its staging ring copies them from the files' mappings, as mode ring does"
)


def _note_page_cache(stats: HostWeightsStats, device: Device) -> None:
    stats.fallbacks.append(HostMemoryFallback(HostMemoryMode.DISK, HostMemoryMode.DISK, PAGE_CACHE_REASON))
    log.info("%s: host memory mode disk: %s", device.label, PAGE_CACHE_REASON)


def _rings_of(resources: Sequence[_Resource]) -> list[StagingRing]:
    return [r for r in resources if isinstance(r, StagingRing)]


def _host_cache(
    model: MoeModel, device: Device, reader: FileReader, size: int, stats: HostWeightsStats, resources: list[_Resource]
) -> dict[str, HostSource]:
    """Mode disk's RAM tier: the first layers that fit ``size`` read into one pinned buffer (kept in
    ``resources``), a region of it per tensor; said in the log, at WARNING where no layer fits."""
    if not size:
        return {}
    layers = cached_layers(model, size)
    if not layers:
        log.info(
            "%s: a host cache of %d bytes holds no whole layer (the first MoE layer's tensors take %d bytes): "
            "every layer is read from the files, but for single experts decode uses again",
            device.label,
            size,
            layer_bytes(model.layers[0]),
        )
        return {}
    buffer, regions = read_host_cache(layers, device, reader)
    assert buffer is not None
    resources.append(buffer)
    stats.pinned_bytes += buffer.nbytes
    stats.host_cache_bytes = sum(layer_bytes(layer) for layer in layers)
    stats.host_cache_layers = len(layers)
    log.info(
        "%s: host cache holds the tensors of the first %d of %d MoE layers (%d bytes, read once from the files); "
        "the others are read from the files as they are used",
        device.label,
        len(layers),
        len(model.layers),
        stats.host_cache_bytes,
    )
    return regions


def _expert_tier(
    model: MoeModel,
    device: Device,
    reader: FileReader,
    size: int,
    stats: HostWeightsStats,
    resources: list[_Resource],
    cached: dict[str, HostSource],
) -> ExpertTier | None:
    """Mode disk's decode tier in the ``size`` bytes the whole layers left of the host cache (kept in
    ``resources``), or None; said in the log, at WARNING where the host cache holds neither a layer
    nor one expert."""
    streamed = [t for t in model.expert_tensors if t.name not in cached]
    if not streamed or size <= 0:
        return None
    smallest = min(expert_slot_bytes(t, reader) for t in streamed)
    if size < smallest:
        if not cached:
            log.warning(
                "%s: a host cache of %d bytes holds neither a whole layer (the first MoE layer's tensors take "
                "%d bytes) nor one expert (%d bytes): every expert is read from the files at every use",
                device.label,
                size,
                layer_bytes(model.layers[0]),
                smallest,
            )
        return None
    tier = ExpertTier(device, reader, size)
    resources.append(tier)
    stats.pinned_bytes += tier.nbytes
    stats.host_cache_expert_bytes = tier.nbytes
    log.info(
        "%s: host cache: %d bytes for single experts of the layers it does not hold, each read from the files "
        "at its second use in decode and kept",
        device.label,
        size,
    )
    return tier


def _behind_tier(tier: ExpertTier, model: MoeModel, by_name: dict[str, HostSource]) -> None:
    """Put ``tier`` in front of every expert tensor the device's ring reads (not those the whole layers
    hold, nor those another device's ring reads)."""
    for t in model.expert_tensors:
        region = by_name[t.name]
        if isinstance(region, RingRegion) and region.ring.device is tier.device:
            by_name[t.name] = tier.region(t, region)


def _wrap_mappings(model: MoeModel, device: Device) -> list[HostBuffer]:
    mappings: list[HostBuffer] = []
    try:
        for array in model.mappings:
            mappings.append(device.wrap_host(array))
    except BaseException:
        _close_all(mappings)
        raise
    return mappings


def _close_all(buffers: Sequence[_Resource]) -> None:
    with ExitStack() as stack:
        for buffer in buffers:
            stack.callback(buffer.close)


def _regions(mappings: list[HostBuffer], tensors: list[TensorInfo]) -> dict[str, HostSource]:
    return {t.name: HostRegion(mappings[t.shard], t.offset, t.nbytes) for t in tensors}


def _register_all(mappings: list[HostBuffer]) -> str | None:
    """Register every shard's mapping read-only in place; the reason if the platform refuses one."""
    for mapping in mappings:
        reason = _register(mapping)
        if reason is not None:
            return reason if len(mappings) == 1 else f"{reason} (shard {mappings.index(mapping) + 1})"
    return None


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
    stats: HostWeightsStats, requested: HostMemoryMode, reason: str, tensors: list[TensorInfo], ring: StagingRing
) -> None:
    stats.fallbacks.append(HostMemoryFallback(requested, HostMemoryMode.RING, reason))
    total = sum(t.nbytes for t in tensors)
    # An explicit request the platform refused is worth a warning; PREFERRED only chose.
    level = logging.WARNING if requested is HostMemoryMode.REGISTERED else logging.INFO
    workers = "fill processes" if ring.fill is RingFill.PROCESSES else "threads"
    log.log(
        level,
        "registered host memory is unavailable on %s (%s): %s; streaming %d bytes of tensors through a "
        "staging ring of %d x %d pinned bytes filled by %d %s instead",
        ring.device.label,
        ring.device.name,
        reason,
        total,
        ring.chunks,
        ring.chunk_bytes,
        ring.threads,
        workers,
    )


def _note_disk_chosen(weights: HostWeights, reason: str) -> None:
    """The preferred rule chose mode disk: recorded first among the fallbacks and said once, at WARNING
    (a run much slower than one from memory, which more memory would give)."""
    weights.stats.fallbacks.insert(0, HostMemoryFallback(HostMemoryMode.PREFERRED, HostMemoryMode.DISK, reason))
    ring = weights.rings[0]
    log.warning(
        "%s: %s; reading them from the files as they are used (host memory mode disk: O_DIRECT, past the page cache) "
        "into a staging ring of %d x %d pinned bytes by %d threads",
        ring.device.label,
        reason,
        ring.chunks,
        ring.chunk_bytes,
        ring.threads,
    )


def _note_buffered_reads(
    stats: HostWeightsStats, reason: str, tensors: list[TensorInfo], device: Device, rings: list[StagingRing]
) -> None:
    stats.fallbacks.append(HostMemoryFallback(HostMemoryMode.DISK, HostMemoryMode.DISK, f"buffered reads: {reason}"))
    into = [f"a staging ring of {r.chunks} x {r.chunk_bytes} pinned bytes by {r.threads} threads" for r in rings[:1]]
    if stats.host_cache_bytes:
        into.insert(0, f"a host cache of {stats.host_cache_bytes} bytes")
    log.warning(
        "%s: %s; reading %d bytes of tensors through the page cache instead (each read dropped from it "
        "afterwards) into %s",
        device.label,
        reason,
        sum(t.nbytes for t in tensors),
        " and ".join(into),
    )


def _pinned_copy(
    model: MoeModel, device: Device, tensors: list[TensorInfo]
) -> tuple[HostBuffer, dict[str, HostSource]]:
    """One pinned allocation holding every tensor of every shard, each at a page-aligned offset."""
    offsets: dict[str, int] = {}
    total = 0
    for t in tensors:
        offsets[t.name] = total
        total += -(-t.nbytes // _PINNED_ALIGN) * _PINNED_ALIGN
    pinned = device.alloc_pinned(total)
    try:
        mappings = _wrap_mappings(model, device)
        try:
            for t in tensors:
                device.backend.host.copy(pinned, offsets[t.name], mappings[t.shard], t.offset, t.nbytes)
        finally:
            _close_all(mappings)
    except BaseException:
        pinned.close()
        raise
    return pinned, {t.name: HostRegion(pinned, offsets[t.name], t.nbytes) for t in tensors}
