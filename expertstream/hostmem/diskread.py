"""Reads of a model's files that bypass the page cache: where mode disk's staging ring gets its bytes.

Each file is opened with O_DIRECT, so a read goes from the drive into the ring's pinned chunk with
no copy in the page cache, and the model's bytes take no RAM beyond the chunks. O_DIRECT wants the
file offset, the length and the buffer's address aligned (``alignment``): a read covers the wanted
range rounded out to it (``Extent``), and the wanted bytes are taken from inside. A filesystem that
refuses O_DIRECT (open fails with EINVAL) is read through the page cache instead, dropping what was
read with POSIX_FADV_DONTNEED; ``fallback_reason`` says so. Reads are thread-safe (``os.preadv``
releases the interpreter lock, so a few threads keep several reads in flight).
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._closing import Closing
from ..errors import ExpertStreamError

# The alignment O_DIRECT wants where the filesystem names none larger: the page size, which covers
# the logical block size of every common drive (512 or 4096 bytes).
DEFAULT_ALIGNMENT = max(4096, mmap.PAGESIZE)
# A filesystem block size above this (network filesystems report 1 MiB) is not taken as an alignment.
_MAX_ALIGNMENT = 1 << 16

Opener = Callable[[str, int], int]  # os.open's shape: (path, flags) -> descriptor


class DiskReadError(ExpertStreamError):
    """A read of a model file failed or came back short; the message names the file and the offset."""

    def __init__(self, path: Path, offset: int | None, why: str) -> None:
        self.path = path
        self.offset = offset
        where = f"{path}" if offset is None else f"{path} at offset {offset}"
        super().__init__(f"reading {where}: {why}")


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


class FileReader(Closing):
    """The files of a model's shards, open for reads that bypass the page cache where they can.

    ``opener`` opens a file as ``os.open`` does (tests pass one that refuses O_DIRECT).
    """

    def __init__(self, paths: Sequence[Path], *, opener: Opener = os.open) -> None:
        self._files: list[_File] = []
        self.fallback_reason: str | None = None  # why a file is read through the page cache
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
            return _File(path, opener(str(path), flags | os.O_DIRECT), direct=True)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise DiskReadError(path, None, f"cannot open it: {exc.strerror or exc}") from exc
            if self.fallback_reason is None:
                self.fallback_reason = f"the filesystem of {path} refuses O_DIRECT ({exc.strerror or exc})"
        try:
            return _File(path, opener(str(path), flags), direct=False)
        except OSError as exc:
            raise DiskReadError(path, None, f"cannot open it: {exc.strerror or exc}") from exc

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

    def read(self, source: int, offset: int, into: memoryview, wanted: int) -> None:
        """Read file ``source`` from ``offset`` into ``into``; DiskReadError unless ``wanted`` bytes came.

        ``offset``, ``len(into)`` and the address of ``into`` are multiples of ``alignment``; the
        bytes past ``wanted`` may lie beyond the end of the file.
        """
        file = self._files[source]
        got = 0
        while got < wanted:
            try:
                count = os.preadv(file.fd, [into[got:]], offset + got)
            except OSError as exc:
                raise DiskReadError(
                    file.path, offset + got, f"the read of {len(into) - got} bytes failed: {exc.strerror or exc}"
                ) from exc
            got += count
            # An unaligned count from an O_DIRECT read, or none at all, is the end of the file.
            if got < wanted and (count == 0 or (file.direct and count % self.alignment)):
                size = os.fstat(file.fd).st_size
                raise DiskReadError(
                    file.path,
                    offset,
                    f"the file ends at byte {size}, before the {wanted} bytes wanted from here; it is shorter "
                    "than its tensors say (truncated or replaced since it was opened?)",
                )
        if not file.direct:
            os.posix_fadvise(file.fd, offset, got, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for file in self._files:
            os.close(file.fd)
        self._files.clear()
        self.closed = True


def _alignment_of(fd: int) -> int:
    """The filesystem's block size where it is a power of two no larger than _MAX_ALIGNMENT; else the default."""
    block = os.fstatvfs(fd).f_bsize
    if block & (block - 1) == 0 and DEFAULT_ALIGNMENT <= block <= _MAX_ALIGNMENT:
        return block
    return DEFAULT_ALIGNMENT
