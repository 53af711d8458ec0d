"""Host memory for a model's tensors: the placement policy and the staging ring it may use."""

from __future__ import annotations

from ..scheduler.source import HostRegion, HostSource
from .diskread import DiskReadError, FileReader
from .memlimit import HostMemoryLimit, MemoryReader, read_memory_limit
from .placement import (
    DEFAULT_RING_THREADS,
    HostMemoryFallback,
    HostMemoryMode,
    HostWeights,
    HostWeightsStats,
    RingOptions,
    default_ring_threads,
)
from .staging import (
    DEFAULT_RING_CHUNK_BYTES,
    DEFAULT_RING_CHUNKS,
    DEFAULT_RING_PART_BYTES,
    PROCESS_RING_CHUNK_BYTES,
    PROCESS_RING_CHUNKS,
    PROCESS_RING_PART_BYTES,
    RingFill,
    RingRegion,
    RingStats,
    StagingRing,
)

__all__ = [
    "DEFAULT_RING_CHUNKS",
    "DEFAULT_RING_CHUNK_BYTES",
    "DEFAULT_RING_PART_BYTES",
    "DEFAULT_RING_THREADS",
    "PROCESS_RING_CHUNKS",
    "PROCESS_RING_CHUNK_BYTES",
    "PROCESS_RING_PART_BYTES",
    "DiskReadError",
    "FileReader",
    "HostMemoryFallback",
    "HostMemoryLimit",
    "HostMemoryMode",
    "HostRegion",
    "HostSource",
    "HostWeights",
    "HostWeightsStats",
    "MemoryReader",
    "RingFill",
    "RingOptions",
    "RingRegion",
    "RingStats",
    "StagingRing",
    "default_ring_threads",
    "read_memory_limit",
]
