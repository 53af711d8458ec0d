"""The drive behind a model's file, as mode disk reads it: O_DIRECT reads, several in flight.

``measure_disk`` times large sequential reads of the file with 1, 4 and 16 reads in flight (one
thread each, ``os.preadv`` into aligned buffers through ``hostmem.FileReader``, as the staging ring's
threads read) and the latency of one small read, on the wall clock. ``fit_disk`` turns the timings
into the simulator profile's drive fields by inverting what the simulator does with them. Where the
filesystem refuses O_DIRECT the reads go through the page cache (and are dropped from it after
each), so a file held there reads at memory speed: ``DiskTiming`` says how much of it was.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..hostmem.diskread import FileReader, Opener, drop_from_page_cache, in_page_cache, resident_pages
from ..model.loader import MoeModel, TensorInfo

DEFAULT_DEPTHS = (1, 4, 16)
DEFAULT_READ_BYTES = 16 << 20
# Bytes read at each depth (fewer where the file is smaller: the reads wrap around it).
DEFAULT_DEPTH_BYTES = 1 << 30
LATENCY_READS = 32  # small reads, spread over the file; their median is the latency


@dataclass(frozen=True)
class DiskReadTiming:
    """``reads`` reads of ``read_bytes`` each, ``depth`` of them in flight at a time, took ``seconds``."""

    depth: int
    read_bytes: int
    reads: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.read_bytes * self.reads / self.seconds


@dataclass(frozen=True)
class DiskTiming:
    """What ``measure_disk`` found for one file."""

    path: str
    file_bytes: int
    direct: bool  # read with O_DIRECT; False: through the page cache (the filesystem refused it)
    fallback_reason: str | None
    cached_share: float | None  # of the file's pages in the page cache before the reads (None: unknown)
    latency_bytes: int
    latency_s: float  # the median of LATENCY_READS reads of latency_bytes, one at a time
    depths: list[DiskReadTiming] = field(default_factory=list)

    def cache_note(self) -> str | None:
        """A line saying where the page cache holds the file, or None where it does not matter or holds none."""
        if not self.cached_share:
            return None
        share = f"{self.cached_share:.0%} of {self.path} is in the page cache"
        if self.direct:
            return f"{share}; O_DIRECT reads bypass it, so the drive was measured"
        return f"{share} and the reads go through it (no O_DIRECT): the rates are partly memory's, not the drive's"


def measure_disk(
    path: str | os.PathLike[str],
    *,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    read_bytes: int = DEFAULT_READ_BYTES,
    depth_bytes: int = DEFAULT_DEPTH_BYTES,
    opener: Opener = os.open,
    clock: Callable[[], float] = time.perf_counter,
) -> DiskTiming:
    """Time reads of the file at ``path`` at each depth (reads in flight), then small reads one at a time."""
    if not depths or any(d < 1 for d in depths) or read_bytes < 1 or depth_bytes < 1:
        raise InvalidArgument(
            f"a drive measurement needs depths >= 1 and positive sizes; got depths {list(depths)}, "
            f"read_bytes {read_bytes}, depth_bytes {depth_bytes}",
            call="measure_disk",
        )
    file = Path(path)
    cached = page_cache_share(file)
    with FileReader([file], opener=opener, resident=None) as reader:  # the drive's own rate, cached or not
        size = file.stat().st_size
        align = reader.alignment
        if size < align:
            raise InvalidArgument(
                f"{file} holds {size} bytes, less than one aligned read ({align} bytes)", call="measure_disk"
            )
        # Reads lie wholly inside the file, at aligned offsets.
        read_bytes = max(align, min(read_bytes, size) // align * align)
        buffers = _aligned(max(depths) * read_bytes, align)
        timings = []
        cursor = 0  # where the next depth goes on reading: each reads bytes the one before did not
        for depth in depths:
            reads = max(depth, -(-depth_bytes // read_bytes) // depth * depth)
            offsets = [(cursor + i) % (size // read_bytes) * read_bytes for i in range(reads)]
            cursor += reads
            seconds = _timed_reads(reader, buffers, read_bytes, depth, offsets, clock)
            timings.append(DiskReadTiming(depth, read_bytes, reads, seconds))
        latency = _latency(reader, buffers, size, align, clock)
        return DiskTiming(str(file), size, reader.direct, reader.fallback_reason, cached, align, latency, timings)


def fit_disk(timing: DiskTiming) -> dict[str, Any]:
    """The profile's drive fields: the latency, and the rate per depth for which the simulator's reads
    (each ``disk_latency_s`` plus its bytes at 1 / depth of the rate) take what they took."""
    rates = []
    for t in timing.depths:
        per_read = t.seconds * t.depth / t.reads
        moving = per_read - timing.latency_s
        # A latency as long as the whole read (a cache in front of the drive) leaves the raw rate.
        rates.append([t.depth, t.read_bytes * t.depth / moving if moving > 0.1 * per_read else t.bytes_per_s])
    return {"disk_read_bps": rates, "disk_latency_s": timing.latency_s}


def page_cache_share(path: Path) -> float | None:
    """The share of the file's pages in the page cache (``diskread.resident_pages``); None where it
    cannot be told (not Linux, an empty file, the call refused)."""
    size = path.stat().st_size
    if size == 0 or not hasattr(os, "O_DIRECT"):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pages = resident_pages(fd, 0, size)
    finally:
        os.close(fd)
    return None if not pages else pages.count(1) / len(pages)


@contextmanager
def page_cache_as_found(model: MoeModel) -> Iterator[None]:
    """Drop again, after the body, the expert tensors the body brought into the page cache: those not
    wholly there before it. A baseline that uploads every expert through the file's mappings (the
    compute-only run) then leaves mode disk's rows to read what a run of their own would, not what it
    left behind (under a memory limit, the file's last few GB)."""
    with ExitStack() as stack:
        fds = []
        for path in model.paths:
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            stack.callback(os.close, fds[-1])
        absent = [t for t in model.expert_tensors if not in_page_cache(fds[t.shard], t.offset, t.nbytes)]
        yield
        for shard, start, end in _runs(absent):
            # One range a run of neighbouring tensors: the pages they share at their edges go too.
            mapped = model.mappings[shard][start:end].ctypes.data
            drop_from_page_cache(fds[shard], start, end - start, mapped=mapped)


def _runs(tensors: Sequence[TensorInfo]) -> list[tuple[int, int, int]]:
    """(shard, start, end) of the runs of ``tensors`` that follow each other in their files with less
    than a page between them (the alignment's padding)."""
    runs: list[tuple[int, int, int]] = []
    for t in sorted(tensors, key=lambda t: (t.shard, t.offset)):
        if runs and runs[-1][0] == t.shard and t.offset - runs[-1][2] < mmap.PAGESIZE:
            runs[-1] = (t.shard, runs[-1][1], t.end)
        else:
            runs.append((t.shard, t.offset, t.end))
    return runs


def _aligned(nbytes: int, align: int) -> memoryview:
    """``nbytes`` of writable memory at an aligned address, every page touched (no first-touch faults timed)."""
    raw = np.ones(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].data


def _timed_reads(
    reader: FileReader,
    buffers: memoryview,
    read_bytes: int,
    depth: int,
    offsets: Sequence[int],
    clock: Callable[[], float],
) -> float:
    """Seconds for ``depth`` threads to read ``offsets`` (thread i takes every depth-th from i), each
    into its own buffer: ``depth`` reads in flight until the last."""

    def thread(first: int) -> None:
        into = buffers[first * read_bytes : (first + 1) * read_bytes]
        for offset in offsets[first::depth]:
            reader.read(0, offset, into, read_bytes)

    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="expertstream-disk") as pool:
        start = clock()
        for done in [pool.submit(thread, i) for i in range(depth)]:
            done.result()
        return clock() - start


def _latency(reader: FileReader, buffers: memoryview, size: int, align: int, clock: Callable[[], float]) -> float:
    """The median time of one aligned read of ``align`` bytes, spread evenly over the file."""
    blocks = size // align
    into = buffers[:align]
    times = []
    for i in range(LATENCY_READS):
        offset = (i * blocks // LATENCY_READS) * align
        start = clock()
        reader.read(0, offset, into, align)
        times.append(clock() - start)
    return statistics.median(times)
