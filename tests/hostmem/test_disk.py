"""Mode disk: the staging ring's chunks read from the files (O_DIRECT, else buffered and dropped), byte-exact."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from expertstream.backends.base import Backend, Device
from expertstream.cli import main
from expertstream.engine.model import Model, Options
from expertstream.errors import HazardError, InvalidArgument
from expertstream.hostmem import (
    DiskReadError,
    FileReader,
    HostMemoryMode,
    HostWeights,
    RingOptions,
    RingStats,
    StagingRing,
    diskread,
    placement,
)

from .patterns import pattern

# Small chunks and parts: tensors of the tiny preset (221184 bytes) span several chunks, each
# read in several aligned parts by several threads.
SMALL_DISK_RING = RingOptions(chunks=3, chunk_bytes=50_000, threads=3, part_bytes=8192)
SMALL = ["--tokens", "32", "--ubatch", "16", "-r", "1", "--slots", "0,2"]


def _refusing_direct(opened: list[int]) -> diskread.Opener:
    """Opens as os.open does, but refuses O_DIRECT as tmpfs once did (EINVAL); records the flags asked for."""

    def opener(path: str, flags: int) -> int:
        opened.append(flags)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return os.open(path, flags)

    return opener


@pytest.fixture
def buffered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int, int]]]:
    """The O_DIRECT-refused path: reads through the page cache; yields the DONTNEED advice given."""
    advised: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    yield advised


def _direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


def _copy_all(weights: HostWeights, device: Device) -> dict[str, np.ndarray]:
    """Every tensor copied to the device through its region, read back."""
    out: dict[str, np.ndarray] = {}
    with device.stream() as stream:
        buffers = {name: device.alloc(weights[name].nbytes) for name in weights}
        for name, dst in buffers.items():
            weights[name].enqueue_h2d(stream, dst, 0, 0, weights[name].nbytes)
        stream.synchronize()
    for name, dst in buffers.items():
        out[name] = dst.read()
        dst.close()
    return out


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_every_tensor_arrives_as_the_file_holds_it(
    backend: Backend, tiny_path: Path, direct: bool, buffered: list[tuple[int, int, int]]
) -> None:
    if direct and not _direct_supported(tiny_path):
        pytest.skip(f"the filesystem of {tiny_path} refuses O_DIRECT")
    opener = os.open if direct else _refusing_direct([])
    device = backend.device(0)
    # Every read from the drive: the file this test's fixture wrote may lie in the page cache.
    with HostWeights.open(
        tiny_path, device, HostMemoryMode.DISK, ring=SMALL_DISK_RING, opener=opener, page_cache=False
    ) as weights:
        assert weights.mode is HostMemoryMode.DISK
        (ring,) = weights.rings
        assert ring.chunk_bytes == 50_000
        copied = _copy_all(weights, device)
        file_bytes = tiny_path.read_bytes()
        tensors = weights.model.tensors.values()
        # Offsets off the alignment, and (chunks of 50000 bytes) pieces of odd lengths at odd offsets.
        assert any(t.offset % 4096 for t in tensors) and any(t.nbytes > 50_000 for t in tensors)
        for name, info in weights.model.tensors.items():
            assert copied[name].tobytes() == file_bytes[info.offset : info.offset + info.nbytes], name
    # Buffered reads drop what they read from the page cache; O_DIRECT reads never put it there.
    assert bool(buffered) is not direct
    assert all(advice == os.POSIX_FADV_DONTNEED for _, _, advice in buffered)


def _file_ring(device: Device, path: Path, reader: FileReader, *, threads: int, chunk_bytes: int) -> StagingRing:
    """A ring of two chunks over the file at ``path``, its chunks read through ``reader`` in 4096-byte parts."""
    source = device.wrap_host(np.fromfile(path, dtype=np.uint8))
    return StagingRing(source, threads=threads, chunks=2, chunk_bytes=chunk_bytes, part_bytes=4096, reader=reader)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_odd_ranges_spanning_chunks_are_exact(backend: Backend, tmp_path: Path, direct: bool) -> None:
    data = pattern(5 * 4096 + 777)
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.tobytes())
    if direct and not _direct_supported(path):
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")
    device = backend.device(0)
    opener = os.open if direct else _refusing_direct([])
    # Ranges that start and end off the alignment, cross chunk (6000) and part (4096) boundaries,
    # and reach the file's last, partial block.
    cuts = [(1, 1), (3, 4093), (4095, 2), (4097, 6001), (777, 13_333), (9000, data.nbytes - 9000), (0, data.nbytes)]
    with (
        FileReader([path], opener=opener, resident=None) as reader,
        _file_ring(device, path, reader, threads=3, chunk_bytes=6000) as ring,
    ):
        assert reader.direct is direct
        with device.stream() as stream:
            buffers = []
            for start, nbytes in cuts:
                dst = device.alloc(nbytes)
                ring.region(0, data.nbytes).enqueue_h2d(stream, dst, 0, start, nbytes)
                buffers.append(dst)
            stream.synchronize()
        for (start, nbytes), dst in zip(cuts, buffers, strict=True):
            assert np.array_equal(dst.read(), data[start : start + nbytes]), (start, nbytes)
            dst.close()


def _ring_reads(
    backend: Backend, path: Path, resident: diskread.Resident | None, opener: diskread.Opener = os.open
) -> tuple[bytes, RingStats]:
    """The whole file through a small disk ring whose reader asks ``resident``: the bytes, the ring's stats."""
    device = backend.device(0)
    nbytes = path.stat().st_size
    with (
        FileReader([path], resident=resident, opener=opener) as reader,
        _file_ring(device, path, reader, threads=2, chunk_bytes=4096) as ring,  # one aligned read a chunk
        device.stream() as stream,
    ):
        dst = device.alloc(nbytes)
        ring.region(0, nbytes).enqueue_h2d(stream, dst, 0, 0, nbytes)
        stream.synchronize()
        got = dst.read().tobytes()
        dst.close()
        return got, ring.stats


def test_ranges_in_the_page_cache_are_read_from_there_and_left_there(
    backend: Backend, tmp_path: Path, buffered: list[tuple[int, int, int]]
) -> None:
    data = pattern(8 * 4096 + 100)
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.tobytes())
    asked: list[tuple[int, int]] = []

    def second_half(fd: int, offset: int, nbytes: int) -> bool:
        asked.append((offset, nbytes))
        return offset >= 4 * 4096

    direct_fds: set[int] = set()
    read_from: dict[int, bool] = {}  # offset: whether through an O_DIRECT descriptor
    real_open, real_preadv = os.open, os.preadv

    def opening(name: str, flags: int) -> int:
        fd = real_open(name, flags)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def reading(fd: int, buffers: list[memoryview], offset: int, *args: int) -> int:
        read_from[offset] = fd in direct_fds
        return real_preadv(fd, buffers, offset, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "preadv", reading)
        got, stats = _ring_reads(backend, path, second_half, opening)
    assert got == data.tobytes()
    if direct_fds:  # the filesystem took O_DIRECT: the first half through it, the second half not
        assert read_from == {i * 4096: i < 4 for i in range(9)}
    # Each read asked about (4096 bytes, the last one clipped at the end of the file); those in the
    # second half came out of the page cache, the rest from the drive.
    assert sorted(asked) == [(i * 4096, 4096) for i in range(8)] + [(8 * 4096, 100)]
    assert stats.bytes_filled == 9 * 4096 and stats.bytes_cached == 5 * 4096
    # Nothing read out of the page cache is dropped from it (where the filesystem refuses O_DIRECT,
    # the drive's reads are).
    assert all(offset < 4 * 4096 for offset, _, _ in buffered)
    never, drive = _ring_reads(backend, path, None)
    assert never == got and drive.bytes_cached == 0
    if backend.host.virtual_time:  # the simulator charges a memcpy for them, not the drive's rate
        assert stats.fill_s < drive.fill_s


def test_a_file_wholly_in_the_page_cache_at_open_is_copied_as_mode_ring_copies_it(
    backend: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    device = backend.device(0)
    with (
        caplog.at_level(logging.INFO, logger="expertstream.hostmem.placement"),
        HostWeights.open(
            tiny_path, device, HostMemoryMode.DISK, ring=SMALL_DISK_RING, page_cache=lambda fd, offset, nbytes: True
        ) as weights,
    ):
        assert weights.mode is HostMemoryMode.DISK
        (ring,) = weights.rings
        assert not ring.reads_files
        assert [f.reason for f in weights.stats.fallbacks] == [placement.PAGE_CACHE_REASON]
        copied = _copy_all(weights, device)
    file_bytes = tiny_path.read_bytes()
    for name, info in weights.model.tensors.items():
        assert copied[name].tobytes() == file_bytes[info.offset : info.offset + info.nbytes], name
    assert sum(placement.PAGE_CACHE_REASON in r.getMessage() for r in caplog.records) == 1
    # One tensor the page cache lacks (the second asked about): every chunk is read from the files, as before.
    asked: list[int] = []

    def all_but_the_second(fd: int, offset: int, nbytes: int) -> bool:
        asked.append(offset)
        return len(asked) != 2

    with HostWeights.open(
        tiny_path, device, HostMemoryMode.DISK, ring=SMALL_DISK_RING, page_cache=all_but_the_second
    ) as weights:
        assert weights.rings[0].reads_files and not weights.stats.fallbacks


def test_the_kernel_is_not_asked_where_its_answer_would_be_every_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "theirs.bin"
    path.write_bytes(bytes(2 * 4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        owner = os.fstat(fd).st_uid
        # Another user's file this process may not write: Linux would say every page is resident.
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1 if owner + 1 != 0 else owner + 2)
        monkeypatch.setattr(os, "access", lambda path, mode: False)
        assert diskread.resident_pages(fd, 0, 4096) is None
        assert not diskread.in_page_cache(fd, 0, 4096)
        monkeypatch.setattr(os, "access", lambda path, mode: mode == os.W_OK)  # writable: asked
        assert diskread.resident_pages(fd, 0, 4096) is not None
    finally:
        os.close(fd)


def test_a_range_past_the_end_of_the_file_is_never_taken_from_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(3 * 4096))
    with FileReader([path], resident=lambda fd, offset, nbytes: True) as reader:
        assert reader.cached(0, 4096, 2 * 4096)
        assert not reader.cached(0, 4096, 2 * 4096 + 1)  # the drive's read says where the file ends
        assert not reader.cached(0, 0, 0)


def test_the_kernel_says_a_tmpfs_file_is_in_the_page_cache(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    path = shm / f"expertstream-{os.getpid()}-{tmp_path.name}"
    try:
        path.write_bytes(bytes(5 * 4096))  # tmpfs pages live in the page cache
        fd = os.open(path, os.O_RDONLY)
        try:
            assert diskread.in_page_cache(fd, 0, 5 * 4096)
            assert diskread.in_page_cache(fd, 4097, 3)
        finally:
            os.close(fd)
    finally:
        path.unlink()
    read_end, write_end = os.pipe()  # nothing to map: no answer, so from the drive
    try:
        assert not diskread.in_page_cache(read_end, 0, 4096)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_refused_o_direct_falls_back_once_with_a_warning(
    backend: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    opened: list[int] = []
    with (
        caplog.at_level(logging.WARNING, logger="expertstream.hostmem"),
        HostWeights.open(
            tiny_path,
            backend.device(0),
            HostMemoryMode.DISK,
            ring=SMALL_DISK_RING,
            opener=_refusing_direct(opened),
            page_cache=False,
        ) as weights,
    ):
        assert weights.mode is HostMemoryMode.DISK
        (fallback,) = weights.stats.fallbacks
        assert (fallback.requested, fallback.used) == (HostMemoryMode.DISK, HostMemoryMode.DISK)
        assert "refuses O_DIRECT" in fallback.reason and str(tiny_path) in fallback.reason
    assert [bool(flags & os.O_DIRECT) for flags in opened] == [True, False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "page cache" in warnings[0].getMessage()


def test_a_file_shorter_than_its_tensors_stops_the_copy_naming_file_and_offset(
    backend: Backend, tiny_path: Path, tmp_path: Path
) -> None:
    path = tmp_path / "short.gguf"
    shutil.copyfile(tiny_path, path)
    device = backend.device(0)
    # Read from the drive: a file wholly in the page cache at open would be copied from its mapping,
    # where a file cut short afterwards faults as it does in mode ring.
    with HostWeights.open(path, device, HostMemoryMode.DISK, ring=SMALL_DISK_RING, page_cache=False) as weights:
        last = max(weights.model.tensors.values(), key=lambda t: t.offset)
        keep = last.offset + 1000  # the last tensor loses all but its first 1000 bytes
        os.truncate(path, keep)
        dst = device.alloc(last.nbytes)
        with device.stream() as stream:
            with pytest.raises(DiskReadError) as raised:
                weights[last.name].enqueue_h2d(stream, dst, 0, 0, last.nbytes)
            error = raised.value
            assert error.path == path and error.offset is not None
            assert last.offset - 4096 < error.offset < last.offset + last.nbytes
            message = str(error)
            assert "\n" not in message and str(path) in message and f"offset {error.offset}" in message
            assert f"ends at byte {keep}" in message
            # The ring stays usable for what the file still holds.
            first = min(weights.model.tensors.values(), key=lambda t: t.offset)
            weights[first.name].enqueue_h2d(stream, dst, 0, 0, first.nbytes)
            stream.synchronize()
        assert dst.read(0, first.nbytes).tobytes() == path.read_bytes()[first.offset : first.end]
        dst.close()


def test_a_read_that_fails_names_file_and_offset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(3 * 4096))

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with FileReader([path]) as reader:
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(DiskReadError, match=rf"{path} at offset 4096: .*{os.strerror(errno.EIO)}"):
            reader.read(0, 4096, memoryview(bytearray(4096)), 4096)


def test_a_prefill_through_disk_gives_the_hash_of_pinned_and_ring(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["prefill", str(tiny_path), "--backend", backend.name, *SMALL, "--host-memory", "pinned,ring,disk", "--json"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    rows = json.loads(out)["rows"]
    assert sorted({r["host_memory"] for r in rows}) == ["disk", "pinned", "ring"] and len(rows) == 6
    assert len({r["output_sha256"] for r in rows}) == 1
    assert len({r["prefill_sha256"] for r in rows}) == 1


def test_disk_rows_prefill_layer_major_unless_told_otherwise(
    backend: Backend, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mode disk reads each layer's experts from the file: with no --prefill-order its rows go
    layer-major (once a prompt, not once a ubatch), other modes ubatch-major; the bytes agree."""
    rows = []
    for modes, order in (("disk", None), ("pinned", None), ("disk", "ubatch")):
        argv = ["prefill", str(tiny_path), "--backend", backend.name, *SMALL, "--host-memory", modes, "--json"]
        assert main(argv + (["--prefill-order", order] if order else [])) == 0
        rows.append(json.loads(capsys.readouterr().out)["rows"])
    assert [{r["prefill_order"] for r in group} for group in rows] == [{"layer"}, {"ubatch"}, {"ubatch"}]
    assert len({r["prefill_sha256"] for group in rows for r in group}) == 1


def test_a_short_file_stops_prefill_with_one_line_and_no_rows(
    backend: Backend,
    tiny_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "short.gguf"
    shutil.copyfile(tiny_path, path)
    with HostWeights.open(tiny_path, backend.device(0), HostMemoryMode.MMAP) as weights:
        last = max(weights.model.tensors.values(), key=lambda t: t.offset)
    real_init = FileReader.__init__

    def truncating(self: FileReader, paths: list[Path], **kwargs: diskread.Opener) -> None:
        real_init(self, paths, **kwargs)
        # After the header was read and the file opened: the last tensor loses all but 1000 bytes.
        os.truncate(path, last.offset + 1000)

    monkeypatch.setattr(FileReader, "__init__", truncating)
    code = main(["prefill", str(path), "--backend", backend.name, *SMALL, "--host-memory", "disk", "--json"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("expertstream: error: reading ") and str(path) in line and "offset" in line


def test_the_engine_takes_host_memory_disk(backend: Backend, tiny_path: Path) -> None:
    with Model.open(tiny_path, backend=backend, options=Options(host_memory="disk")) as model:
        assert model.weights.mode is HostMemoryMode.DISK


def test_disk_reads_are_made_by_threads_where_processes_were_asked(
    backend: Backend, tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = RingOptions(fill="processes", threads=2, chunks=2, chunk_bytes=64 * 1024)
    with (
        caplog.at_level(logging.WARNING, logger="expertstream.hostmem"),
        HostWeights.open(tiny_path, backend.device(0), HostMemoryMode.DISK, ring=options, page_cache=False) as weights,
    ):
        (ring,) = weights.rings
        assert ring.fill.value == "threads" and ring.fill_note == "reads from the files are made by threads"
    assert any("made by threads" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_read_into_read_only_host_memory_is_refused(backend: Backend) -> None:
    device = backend.device(0)
    source = device.wrap_host(np.frombuffer(bytes(4096), dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="read-only"):
        backend.host.read_into(source, 0, 4096, lambda into: None)


def test_a_read_into_a_chunk_a_copy_still_reads_is_a_hazard(backend: Backend) -> None:
    if not backend.host.virtual_time:
        pytest.skip("only the simulator checks host accesses against device work")
    device = backend.device(0)
    with device.alloc_pinned(4096) as chunk, device.alloc(4096) as dst, device.stream() as stream:
        stream.copy_h2d(dst, 0, chunk, 0, 4096)
        with pytest.raises(HazardError):
            backend.host.read_into(chunk, 0, 4096, lambda into: None)
        stream.synchronize()

        def write_x(into: memoryview) -> None:
            into[0:1] = b"x"

        backend.host.read_into(chunk, 0, 4096, write_x)
        assert chunk.numpy(0, 1).tobytes() == b"x"
