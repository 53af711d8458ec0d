"""Reads of a model's files that bypass the page cache: where mode disk's staging ring gets its bytes.

Each file is opened with O_DIRECT, so a read goes from the drive into the ring's pinned chunk with
no copy in the page cache, and the model's bytes take no RAM beyond the chunks. O_DIRECT wants the
file offset, the length and the buffer's address aligned (``alignment``): a read covers the wanted
range rounded out to it (``Extent``), and the wanted bytes are taken from inside. A filesystem that
refuses O_DIRECT (open fails with EINVAL) is read through the page cache instead, dropping what was
read with POSIX_FADV_DONTNEED; ``fallback_reason`` says so. Reads are thread-safe (``os.preadv``
releases the interpreter lock, so a few threads keep several reads in flight).

A range whose every page is already in the page cache (the file was read lately, and nothing under
a memory limit evicted it) is copied from there instead, at memory speed and without dropping it:
O_DIRECT would read it from the drive again. ``resident`` decides which ranges are; by default the
kernel says so (``mincore`` over a mapping of the range, which reads nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._closing import Closing
from ..backends.base import Host, HostBuffer
from ..errors import ExpertStreamError

# The alignment O_DIRECT wants where the filesystem names none larger: the page size, which covers
# the logical block size of every common drive (512 or 4096 bytes).
DEFAULT_ALIGNMENT = max(4096, mmap.PAGESIZE)
# A filesystem block size above this (network filesystems report 1 MiB) is not taken as an alignment.
_MAX_ALIGNMENT = 1 << 16

Opener = Callable[[str, int], int]  # os.open's shape: (path, flags) -> descriptor
# (descriptor, offset, bytes) -> whether every page of the range is in the page cache
Resident = Callable[[int, int, int], bool]


class DiskReadError(ExpertStreamError):
    """A read of a model file failed or came back short; the message names the file and the offset."""

    def __init__(self, path: Path, offset: int | None, why: str) -> None:
        self.path = path
        self.offset = offset
        where = f"{path}" if offset is None else f"{path} at offset {offset}"
        super().__init__(f"reading {where}: {why}")


# mincore's answer a page: resident where the lowest bit is set (the others are reserved)
_LOW_BIT = bytes(b & 1 for b in range(256))
_ABSENT = b"\x00"


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def resident_pages(fd: int, offset: int, nbytes: int) -> bytes | None:
    """One byte a page of bytes ``[offset, offset + nbytes)`` of the open file (its first page the one
    ``offset`` lies in): 1 where the page is in the page cache, else 0. ``mincore`` over a fresh
    read-only mapping of the range: mapping and asking read nothing.

    The kernel answers truly only to a process that owns the file, may write it, or runs as root:
    for anyone else it says every page is there. None there, and wherever the question cannot be
    asked."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    length = offset + nbytes - start
    if length <= 0:
        return b""
    if not _mincore_answers(fd):
        return None
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address is None or address == ctypes.c_void_p(-1).value:
        return None
    try:
        vector = ctypes.create_string_buffer(-(-length // page))
        if libc.mincore(address, length, vector) != 0:
            return None
        return vector.raw.translate(_LOW_BIT)
    finally:
        libc.munmap(address, length)


def _mincore_answers(fd: int) -> bool:
    """Whether mincore tells this process the truth about the file's pages: it owns the file, may
    write it, or is root (for any other caller Linux reports every page resident)."""
    euid = os.geteuid()
    if euid == 0 or os.fstat(fd).st_uid == euid:
        return True
    return os.access(f"/proc/self/fd/{fd}", os.W_OK)


def in_page_cache(fd: int, offset: int, nbytes: int) -> bool:
    """Whether every page of bytes ``[offset, offset + nbytes)`` of the open file is in the page cache
    (``resident_pages``); False where the kernel cannot say, so the range is read from the drive."""
    pages = resident_pages(fd, offset, nbytes)
    return pages is not None and _ABSENT not in pages


def drop_from_page_cache(fd: int, offset: int, nbytes: int, mapped: int | None = None) -> None:
    """Ask the kernel to drop bytes ``[offset, offset + nbytes)`` of the open file from the page cache.
    ``mapped``: the address where this process maps those bytes, unmapped from it first (the kernel
    keeps pages a process maps; the pages around them it maps are only faulted in again on use)."""
    if mapped is not None and nbytes > 0:
        page = mmap.PAGESIZE
        start = mapped - mapped % page
        end = -(-(mapped + nbytes) // page) * page
        with contextlib.suppress(OSError, AttributeError):
            _libc().madvise(start, end - start, mmap.MADV_DONTNEED)
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


@dataclass(frozen=True)
class Extent:
    """The aligned range a read covers for wanted bytes ``[offset, offset + nbytes)`` of a file."""

    start: int  # aligned file offset
    nbytes: int  # aligned length
    head: int  # the wanted bytes begin this far into it


@dataclass(frozen=True)
class _File:
    path: Path
    fd: int
    direct: bool  # False: read through the page cache, dropped after each read
    # the same file without O_DIRECT, through which ranges already in the page cache are read (fd
    # itself where no one asks which ranges are, or where fd is not O_DIRECT)
    cached_fd: int


class FileReader(Closing):
    """The files of a model's shards, open for reads that bypass the page cache where they can.

    ``opener`` opens a file as ``os.open`` does (tests pass one that refuses O_DIRECT). ``resident``
    says whether a range lies in the page cache already (``in_page_cache`` by default); None reads
    every range from the drive (the simulator's machine, whose page cache is not modelled).
    """

    def __init__(
        self, paths: Sequence[Path], *, opener: Opener = os.open, resident: Resident | None = in_page_cache
    ) -> None:
        self._files: list[_File] = []
        self.fallback_reason: str | None = None  # why a file is read through the page cache
        self._resident = resident
        self.closed = False
        try:
            for path in paths:
                self._files.append(self._open(Path(path), opener))
        except BaseException:
            self.close()
            raise
        self.alignment = max((_alignment_of(f.fd) for f in self._files), default=DEFAULT_ALIGNMENT)

    def _open(self, path: Path, opener: Opener) -> _File:
        flags = os.O_RDONLY | os.O_CLOEXEC
        try:
            direct = opener(str(path), flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise DiskReadError(path, None, f"cannot open it: {exc.strerror or exc}") from exc
            if self.fallback_reason is None:
                self.fallback_reason = f"the filesystem of {path} refuses O_DIRECT ({exc.strerror or exc})"
            buffered = _open_buffered(path, opener, flags)
            return _File(path, buffered, direct=False, cached_fd=buffered)
        if self._resident is None:  # no range is ever read from the page cache: one descriptor
            return _File(path, direct, direct=True, cached_fd=direct)
        try:
            buffered = _open_buffered(path, opener, flags)
        except BaseException:
            os.close(direct)
            raise
        file = _File(path, direct, direct=True, cached_fd=buffered)
        try:
            # Reads of cached ranges start no read-ahead: it would fill the page cache (and, under a
            # memory limit, evict what else is there) with bytes the next check then finds resident.
            os.posix_fadvise(buffered, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            _close(file)
            raise
        return file

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(f.path for f in self._files)

    @property
    def direct(self) -> bool:
        """Whether every file is read with O_DIRECT."""
        return all(f.direct for f in self._files)

    def extent(self, offset: int, nbytes: int) -> Extent:
        """The aligned read that holds bytes ``[offset, offset + nbytes)``."""
        start = offset - offset % self.alignment
        end = -(-(offset + nbytes) // self.alignment) * self.alignment
        return Extent(start, end - start, offset - start)

    def cached(self, source: int, offset: int, nbytes: int) -> bool:
        """Whether every page of bytes ``[offset, offset + nbytes)`` of file ``source`` is in the page
        cache, so that ``read(..., cached=True)`` copies them from there. False where the file ends
        before them: the drive's read then says where it ends."""
        if self._resident is None or nbytes <= 0:
            return False
        file = self._files[source]
        if offset + nbytes > os.fstat(file.cached_fd).st_size:
            return False
        return self._resident(file.cached_fd, offset, nbytes)

    def read(self, source: int, offset: int, into: memoryview, wanted: int, *, cached: bool = False) -> None:
        """Read file ``source`` from ``offset`` into ``into``; DiskReadError unless ``wanted`` bytes came.

        ``offset``, ``len(into)`` and the address of ``into`` are multiples of ``alignment``; the
        bytes past ``wanted`` may lie beyond the end of the file. ``cached`` (what ``cached`` said):
        the bytes are copied from the page cache and left there.
        """
        file = self._files[source]
        fd, direct = (file.cached_fd, False) if cached else (file.fd, file.direct)
        got = 0
        while got < wanted:
            try:
                count = os.preadv(fd, [into[got:]], offset + got)
            except OSError as exc:
                raise DiskReadError(
                    file.path, offset + got, f"the read of {len(into) - got} bytes failed: {exc.strerror or exc}"
                ) from exc
            got += count
            # An unaligned count from an O_DIRECT read, or none at all, is the end of the file.
            if got < wanted and (count == 0 or (direct and count % self.alignment)):
                size = os.fstat(fd).st_size
                raise DiskReadError(
                    file.path,
                    offset,
                    f"the file ends at byte {size}, before the {wanted} bytes wanted from here; it is shorter "
                    "than its tensors say (truncated or replaced since it was opened?)",
                )
        if not direct and not cached:
            os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)

    def read_into(
        self,
        host: Host,
        dst: HostBuffer,
        dst_offset: int,
        nbytes: int,
        source: int,
        offset: int,
        wanted: int,
        *,
        sharing: int = 1,
    ) -> bool:
        """``host.read_into`` of ``nbytes`` of file ``source`` from ``offset`` into ``dst`` (the
        alignments of ``read``), from the page cache where every page lies there; whether it did."""
        cached = self.cached(source, offset, wanted)  # the rest of an aligned read may lie past the file's end

        def read(into: memoryview) -> None:
            self.read(source, offset, into, wanted, cached=cached)

        host.read_into(dst, dst_offset, nbytes, read, sharing=sharing, cached=cached)
        return cached

    def close(self) -> None:
        files, self._files = self._files, []
        self.closed = True
        for file in files:
            _close(file)


def _open_buffered(path: Path, opener: Opener, flags: int) -> int:
    try:
        return opener(str(path), flags)
    except OSError as exc:
        raise DiskReadError(path, None, f"cannot open it: {exc.strerror or exc}") from exc


def _close(file: _File) -> None:
    """Close both of a file's descriptors, the second even where the first fails."""
    try:
        os.close(file.fd)
    finally:
        if file.cached_fd != file.fd:
            os.close(file.cached_fd)


def _alignment_of(fd: int) -> int:
    """The filesystem's block size where it is a power of two no larger than _MAX_ALIGNMENT; else the default."""
    block = os.fstatvfs(fd).f_bsize
    if block & (block - 1) == 0 and DEFAULT_ALIGNMENT <= block <= _MAX_ALIGNMENT:
        return block
    return DEFAULT_ALIGNMENT
