"""A staging ring's fills in helper processes, out of reach of the interpreter lock.

Threads fill a ring's chunks at memcpy speed but take the interpreter lock between copies; on
the H200 host a contended lock hand-off cost a thread 85-130 us, so a thread pool's rate of copies
tops out at a few thousand a second. The ring then needs large chunks (few hand-offs), whose
footprint falls out of the last-level cache before the DMA reads it. Processes have a lock each:
with them, small chunks that stay in the cache are staged at nearly the DMA's speed
(docs/results/hostmem-h200.md).

The processes map the sources' files themselves (the files the ring's sources map, found in
``/proc/self/maps`` and opened again only if they are the same inodes and hold the mapping's bytes)
and the chunks, which live in one shared memory file registered with the device. They never touch
the GPU.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._closing import Closing
from ..backends.base import Device, HostBuffer
from ..errors import BackendError
from ._fill_child import COMMAND, DONE

_CHILD = Path(__file__).with_name("_fill_child.py")
_DELETED = " (deleted)"  # what /proc/self/maps adds to the name of a mapped file since unlinked


class FillProcessError(BackendError):
    """A fill process could not start, or died or failed a copy; its fills are lost."""


@dataclass(frozen=True)
class FileSpan:
    """Where a host buffer's bytes live: an open descriptor of its file and the offset of byte 0."""

    fd: int
    offset: int


def file_spans(sources: Sequence[HostBuffer]) -> list[FileSpan] | str:
    """Open the file behind each source again; the reason if one is not a plain file mapping.

    Linux only: the mapping's file and offset come from ``/proc/self/maps``, and the file opened
    by name must be the same inode (a file replaced since it was mapped is refused).
    """
    if not sys.platform.startswith("linux"):
        return f"fill processes need Linux (this is {sys.platform})"
    try:
        with open("/proc/self/maps") as maps:
            regions = [_parse_map(line) for line in maps]
    except OSError as exc:
        return f"cannot read /proc/self/maps: {exc}"
    spans: list[FileSpan] = []
    try:
        for index, source in enumerate(sources):
            span = _open_span(source, [r for r in regions if r is not None])
            if isinstance(span, str):
                close_spans(spans)
                return f"source {index}: {span}"
            spans.append(span)
    except BaseException:
        close_spans(spans)
        raise
    return spans


def close_spans(spans: Sequence[FileSpan]) -> None:
    for span in spans:
        os.close(span.fd)


@dataclass(frozen=True)
class _Map:
    start: int
    end: int
    perms: str  # e.g. "r--s": readable, shared
    offset: int
    device: tuple[int, int]
    inode: int
    path: str


def _parse_map(line: str) -> _Map | None:
    fields = line.split(maxsplit=5)
    if len(fields) < 6 or not fields[5].startswith("/"):
        return None
    start, end = (int(x, 16) for x in fields[0].split("-"))
    major, minor = (int(x, 16) for x in fields[3].split(":"))
    return _Map(start, end, fields[1], int(fields[2], 16), (major, minor), int(fields[4]), fields[5].rstrip("\n"))


def _open_span(source: HostBuffer, regions: list[_Map]) -> FileSpan | str:
    if source.nbytes == 0:
        return "empty"
    begin, end = source.address, source.address + source.nbytes
    covering = sorted((r for r in regions if r.start < end and r.end > begin), key=lambda r: r.start)
    if not covering or covering[0].start > begin:
        return "not a file mapping"
    first = covering[0]
    at = begin
    for region in covering:
        same_file = (region.device, region.inode) == (first.device, first.inode)
        if region.start > at or not same_file or region.offset - first.offset != region.start - first.start:
            return "not one contiguous file mapping"
        at = region.end
    if at < end:
        return "not a file mapping to its end"
    if any("w" in r.perms and "p" in r.perms for r in covering):
        return "a private writable mapping: its pages may differ from the file's"
    if first.path.endswith(_DELETED):
        return f"{first.path.removesuffix(_DELETED)} was deleted or replaced since it was mapped"
    try:
        fd = os.open(first.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open {first.path}: {exc.strerror or exc}"
    st = os.fstat(fd)
    offset = first.offset + (begin - first.start)
    if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) != (*first.device, first.inode):
        os.close(fd)
        return f"{first.path} was deleted or replaced since it was mapped"
    if st.st_size < offset + source.nbytes:
        os.close(fd)
        return f"{first.path} is shorter than its mapping"
    return FileSpan(fd, offset)


class SharedChunks(Closing):
    """``count`` chunks of ``chunk_bytes`` in one shared memory file, each registered with ``device``."""

    def __init__(self, device: Device, count: int, chunk_bytes: int) -> None:
        self.stride = -(-chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.nbytes = count * self.stride
        self.fd = os.memfd_create("expertstream-ring", os.MFD_CLOEXEC)
        self.buffers: list[HostBuffer] = []
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes)
            whole = np.frombuffer(self._map, dtype=np.uint8)
            for i in range(count):
                buffer = device.wrap_host(whole[i * self.stride : i * self.stride + chunk_bytes])
                self.buffers.append(buffer)
                buffer.register(read_only=False)
        except BaseException:
            self.close()
            raise
        self.closed = False

    def offset(self, chunk: int) -> int:
        return chunk * self.stride

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()  # unregisters
        self.buffers.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.closed = True  # the mapping goes with the last view of it


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    command_fd: int
    done_fd: int
    sent: int = 0
    done: int = 0
    pending: bytes = b""  # a partial answer read from the pipe
    # Seconds of the copies answered but not yet waited for: one read may bring several answers.
    took: dict[int, float] = field(default_factory=dict)


class FillProcesses(Closing):
    """``count`` processes copying file ranges into shared chunks, one command at a time each, in order."""

    def __init__(self, count: int, spans: Sequence[FileSpan], chunks: SharedChunks) -> None:
        self.spans = tuple(spans)
        self.chunks = chunks
        self._children: list[_Child] = []
        self.closed = False
        try:
            for _ in range(count):
                self._children.append(self._spawn())
        except OSError as exc:
            self.close()
            raise FillProcessError(f"cannot start a fill process: {exc}", call="StagingRing") from exc

    @property
    def count(self) -> int:
        return len(self._children)

    def _spawn(self) -> _Child:
        command_read, command_write = os.pipe()
        done_read, done_write = os.pipe()
        fds = (self.chunks.fd, command_read, done_write, *(s.fd for s in self.spans))
        try:
            args = [str(self.chunks.fd), str(self.chunks.nbytes), str(command_read), str(done_write)]
            process = subprocess.Popen(
                # Isolated, without site: the script needs the standard library only, and starts faster.
                [sys.executable, "-I", "-S", str(_CHILD), *args, *(str(s.fd) for s in self.spans)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (command_read, command_write, done_read, done_write):
                os.close(fd)
            raise
        os.close(command_read)
        os.close(done_write)
        return _Child(process, command_write, done_read)

    def send(self, child: int, source: int, src_offset: int, chunk: int, chunk_offset: int, nbytes: int) -> int:
        """Ask process ``child`` for a copy; its sequence number there, for ``wait``."""
        worker = self._children[child]
        worker.sent += 1
        start = self.spans[source].offset + src_offset
        command = COMMAND.pack(worker.sent, source, start, self.chunks.offset(chunk) + chunk_offset, nbytes)
        try:
            os.write(worker.command_fd, command)
        except OSError as exc:
            raise self._lost(worker, f"it no longer takes commands ({exc.strerror or exc})") from exc
        return worker.sent

    def wait(self, child: int, seq: int) -> float:
        """Block until process ``child`` has done copy ``seq``; the seconds that copy took (0 when
        asked again: a fill settled after a wait for it failed)."""
        worker = self._children[child]
        while worker.done < seq:
            data = worker.pending + os.read(worker.done_fd, DONE.size * 64)
            if len(data) == len(worker.pending):
                raise self._lost(worker, "it exited")
            whole = len(data) - len(data) % DONE.size
            for done, took in DONE.iter_unpack(data[:whole]):
                if took < 0:
                    raise self._lost(worker, f"copy {done} was out of range of its file or chunk")
                worker.done = done
                worker.took[done] = took
            worker.pending = data[whole:]
        return worker.took.pop(seq, 0.0)

    def _lost(self, worker: _Child, why: str) -> FillProcessError:
        code = worker.process.poll()
        status = f"exit status {code}" if code is not None else "still running"
        return FillProcessError(f"a staging ring's fill process failed: {why} ({status})", call="StagingRing")

    def close(self) -> None:
        """Let the processes finish their copies and exit."""
        for worker in self._children:
            os.close(worker.command_fd)  # the process exits when its pipe closes
        for worker in self._children:
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            os.close(worker.done_fd)
        self._children.clear()
        self.closed = True
