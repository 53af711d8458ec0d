"""Mode disk's RAM tier: the first layers' tensors read once into one pinned buffer and served from there.

With a host cache of SIZE bytes, mode disk reads the tensors of whole MoE layers (router and
experts), first layers first, as many as fit SIZE together, from the files into one pinned buffer
when it opens. Copies of those tensors are plain DMAs from that buffer (``HostRegion``); only the
other layers' tensors are read from the drive through the staging ring, at every use. The first
layers, because a prefill (and a decode step) copies them first: while they cross from RAM, the
ring is already reading the first layer it serves.

The reads go through the ring's ``FileReader`` and ``Host.read_into``: O_DIRECT where the
filesystem allows (the page cache is not filled; buffered reads are dropped from it), and on the
simulator charged at the profile's drive rate. Each tensor is read rounded out to the reader's
alignment into an aligned place of the buffer and served from inside it, so the buffer holds a few
KiB per tensor more than the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..backends.base import Device, HostBuffer
from ..model.loader import MoeLayer, MoeModel, TensorInfo
from ..scheduler.source import HostRegion, HostSource
from .diskread import Extent, FileReader

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
            _read_extent(device, reader, buffer, place, tensor, extent)
            regions[tensor.name] = HostRegion(buffer, place + extent.head, tensor.nbytes)
            place += extent.nbytes
    except BaseException:
        buffer.close()
        raise
    return buffer, regions


def _read_extent(
    device: Device, reader: FileReader, buffer: HostBuffer, place: int, tensor: TensorInfo, extent: Extent
) -> None:
    """Read the aligned extent that holds ``tensor`` into ``buffer`` at ``place``, in aligned reads."""
    wanted_end = extent.head + tensor.nbytes  # the bytes after it may lie past the end of the file
    for start in range(0, extent.nbytes, CACHE_READ_BYTES):
        nbytes = min(CACHE_READ_BYTES, extent.nbytes - start)
        wanted = min(nbytes, wanted_end - start)
        offset = extent.start + start

        def read(into: memoryview, offset: int = offset, wanted: int = wanted) -> None:
            reader.read(tensor.shard, offset, into, wanted)

        device.backend.host.read_into(buffer, place + start, nbytes, read)
