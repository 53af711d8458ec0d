"""Fill processes: a staging ring's chunks filled by helper processes reading the sources' files."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, Device, HostBuffer
from expertstream.errors import InvalidArgument
from expertstream.hostmem import HostMemoryMode, HostWeights, RingFill, RingOptions, StagingRing
from expertstream.hostmem.fillproc import FillProcesses, SharedChunks, close_spans, file_spans
from expertstream.hostmem.staging import (
    DEFAULT_RING_CHUNK_BYTES,
    DEFAULT_RING_CHUNKS,
    PROCESS_RING_CHUNK_BYTES,
    PROCESS_RING_CHUNKS,
)
from expertstream.timeline import OpKind

from .patterns import pattern

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="fill processes need Linux")

KIB = 1024
RING = {"threads": 3, "chunk_bytes": 64 * KIB, "chunks": 4, "fill": "processes"}


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """Two files of distinct bytes (the second with an odd size)."""
    paths = []
    for i, size in enumerate((640 * KIB, 333 * KIB + 7)):
        path = tmp_path / f"shard{i}.bin"
        path.write_bytes(pattern(size + i).tobytes()[:size])
        paths.append(path)
    return paths


@pytest.fixture
def sources(device: Device, files: list[Path]) -> Iterator[list[HostBuffer]]:
    buffers = [device.wrap_host(np.memmap(path, dtype=np.uint8, mode="r")) for path in files]
    yield buffers
    for buffer in buffers:
        buffer.close()


def _copy_all(ring: StagingRing, device: Device, spans: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """Copy each (source, start, length) through the ring, announced; the bytes that arrived."""
    regions = [ring.region(start, length, source) for source, start, length in spans]
    ring.expect(regions)
    out = []
    with device.stream() as stream:
        for region in regions:
            with device.alloc(region.length) as dst:
                region.enqueue_h2d(stream, dst, 0, 0, region.length)
                stream.synchronize()
                out.append(dst.read())
    return out


def _expected(sources: list[HostBuffer], spans: list[tuple[int, int, int]]) -> list[np.ndarray]:
    return [sources[s].array[start : start + length] for s, start, length in spans]


SPANS = [(0, 0, 640 * KIB), (1, 5, 333 * KIB), (0, 100 * KIB + 3, 200 * KIB), (1, 0, 1)]


def test_fill_processes_copy_every_byte(device: Device, sources: list[HostBuffer]) -> None:
    with StagingRing(sources, **RING) as ring:  # type: ignore[arg-type]
        assert ring.fill is RingFill.PROCESSES and ring.fill_note is None
        got = _copy_all(ring, device, SPANS)
        stats = ring.stats
    for a, b in zip(got, _expected(sources, SPANS), strict=True):
        assert np.array_equal(a, b)
    assert stats.bytes_filled == sum(length for _, _, length in SPANS)
    assert stats.fill_s > 0


def test_fill_processes_take_unannounced_copies_and_ranges(device: Device, sources: list[HostBuffer]) -> None:
    ranges = [(0, 64 * KIB), (200 * KIB, 230 * KIB), (600 * KIB, 640 * KIB)]
    with StagingRing(sources, **RING) as ring, device.stream() as stream:  # type: ignore[arg-type]
        with device.alloc(640 * KIB) as dst:
            stream.memset(dst, 0, 640 * KIB, 0)
            ring.region(0, 640 * KIB).enqueue_h2d_ranges(stream, dst, ranges)
            stream.synchronize()
            got = dst.read()
        with device.alloc(300 * KIB) as dst:
            ring.copy(stream, dst, 0, 17, 300 * KIB, source=1)  # never announced
            stream.synchronize()
            single = dst.read()
        assert ring.fill is RingFill.PROCESSES
    expected = np.zeros(640 * KIB, np.uint8)
    for start, end in ranges:
        expected[start:end] = sources[0].array[start:end]
    assert np.array_equal(got, expected)
    assert np.array_equal(single, sources[1].array[17 : 17 + 300 * KIB])


def test_a_dead_fill_process_hands_its_fills_to_threads(
    device: Device, sources: list[HostBuffer], caplog: pytest.LogCaptureFixture
) -> None:
    with StagingRing(sources, **RING) as ring:  # type: ignore[arg-type]
        assert ring._processes is not None
        ring._processes._children[1].process.kill()
        with caplog.at_level(logging.WARNING, logger="expertstream.hostmem"):
            got = _copy_all(ring, device, SPANS)
        assert ring.fill is RingFill.THREADS
        assert ring.fill_note is not None and "fill process failed" in ring.fill_note
    for a, b in zip(got, _expected(sources, SPANS), strict=True):
        assert np.array_equal(a, b)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "with threads from now on" in warnings[0].getMessage()


def test_sources_that_are_not_files_are_filled_by_threads_with_a_warning(
    device: Device, caplog: pytest.LogCaptureFixture
) -> None:
    data = pattern(300 * KIB)
    with caplog.at_level(logging.INFO, logger="expertstream.hostmem"):
        ring = StagingRing(device.wrap_host(data), **RING)  # type: ignore[arg-type]
    with ring:
        assert ring.fill is RingFill.THREADS
        assert ring.fill_note is not None and "not a file mapping" in ring.fill_note
        got = _copy_all(ring, device, [(0, 0, 300 * KIB)])
    assert np.array_equal(got[0], data)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "fills its chunks with threads" in warnings[0].getMessage()


def test_a_file_replaced_since_it_was_mapped_is_not_read(
    device: Device, sources: list[HostBuffer], files: list[Path]
) -> None:
    replacement = files[0].with_suffix(".new")
    replacement.write_bytes(b"\0" * files[0].stat().st_size)
    os.replace(replacement, files[0])  # the mapping still shows the old inode's bytes
    with StagingRing(sources, **RING) as ring:  # type: ignore[arg-type]
        assert ring.fill is RingFill.THREADS
        assert ring.fill_note is not None and "was deleted or replaced since it was mapped" in ring.fill_note
        got = _copy_all(ring, device, SPANS[:1])
    assert np.array_equal(got[0], sources[0].array)  # the mapping's bytes, not the new file's


def test_auto_fills_with_processes_on_a_gpu_and_as_its_profile_says_on_the_simulator(
    backend: Backend, sources: list[HostBuffer]
) -> None:
    with StagingRing(sources, threads=2, fill=RingFill.AUTO) as ring:
        if backend.host.virtual_time:  # timed threads, handed chunks as the profile's machine fills them
            assert ring.fill.value == (backend.host.ring_fill or "threads") and ring._processes is None
        else:
            assert ring.fill is RingFill.PROCESSES and ring._processes is not None
        assert ring.fill_note is None


def test_close_lets_the_fill_processes_exit(device: Device, sources: list[HostBuffer]) -> None:
    ring = StagingRing(sources, **RING)  # type: ignore[arg-type]
    assert ring._processes is not None
    children = [child.process for child in ring._processes._children]
    _copy_all(ring, device, SPANS[:2])
    ring.close()
    assert [child.returncode for child in children] == [0, 0, 0]


def test_host_weights_ring_filled_by_processes_matches_the_file(device: Device, tiny_path: Path) -> None:
    with HostWeights.open(
        tiny_path, device, HostMemoryMode.RING, ring=RingOptions(fill="processes", threads=2, chunk_bytes=64 * KIB)
    ) as weights:
        (ring,) = weights.rings
        assert ring.fill is RingFill.PROCESSES and ring.chunks == 16
        names = list(weights)
        got = _copy_all(ring, device, [(0, weights[n].start, weights[n].nbytes) for n in names])
        for name, arrived in zip(names, got, strict=True):
            assert np.array_equal(arrived, weights.model.raw(name)), name


def test_no_fill_is_sent_before_its_chunk_s_last_dma_ends(files: list[Path]) -> None:
    # A process cannot wait for a device event: the ring must, before it sends the fill. The
    # simulator's events complete only once the querying thread's clock has passed them.
    with expertstream.backend("sim", profile="cuda-h200") as sim:
        _check_sends(sim.device(0), files)


def _check_sends(device: Device, files: list[Path]) -> None:
    sources = [device.wrap_host(np.memmap(path, dtype=np.uint8, mode="r")) for path in files]
    with StagingRing(sources, **RING) as ring:  # type: ignore[arg-type]
        assert ring._processes is not None
        real_send = ring._processes.send
        chunk_was_free: list[bool] = []

        def send(child: int, source: int, src_offset: int, chunk: int, chunk_offset: int, nbytes: int) -> int:
            chunk_was_free.append(ring._chunks[chunk].free_event.query())
            return real_send(child, source, src_offset, chunk, chunk_offset, nbytes)

        ring._processes.send = send  # type: ignore[method-assign]
        got = _copy_all(ring, device, SPANS)
    for a, b in zip(got, _expected(sources, SPANS), strict=True):
        assert np.array_equal(a, b)
    assert len(chunk_was_free) > ring.chunks  # chunks were refilled
    assert all(chunk_was_free)
    for source in sources:
        source.close()


def test_an_unknown_fill_is_named(device: Device, sources: list[HostBuffer]) -> None:
    with pytest.raises(InvalidArgument, match=r"unknown staging ring fill 'forks'.*processes"):
        StagingRing(sources, threads=2, fill="forks")


def test_a_private_writable_mapping_is_not_read_from_its_file(device: Device, files: list[Path]) -> None:
    # Copy-on-write pages hold what was written, not the file's bytes: only the mapping has them.
    private = np.memmap(files[0], dtype=np.uint8, mode="c")
    private[12345] ^= 0xFF
    source = device.wrap_host(private)
    with StagingRing(source, **RING) as ring:  # type: ignore[arg-type]
        assert ring.fill is RingFill.THREADS
        assert ring.fill_note is not None and "private writable mapping" in ring.fill_note
        (got,) = _copy_all(ring, device, [(0, 0, private.size)])
    assert np.array_equal(got, np.asarray(private))
    source.close()


def test_every_copy_s_time_is_kept_when_one_read_brings_several_answers(device: Device, files: list[Path]) -> None:
    # Waiting for the third copy first reads the answers to all three; the first two keep their times.
    spans = file_spans([device.wrap_host(np.memmap(files[0], dtype=np.uint8, mode="r"))])
    assert not isinstance(spans, str)
    try:
        with SharedChunks(device, 3, 64 * KIB) as chunks, FillProcesses(1, spans, chunks) as processes:
            seqs = [processes.send(0, 0, i * 64 * KIB, i, 0, 64 * KIB) for i in range(3)]
            times = [processes.wait(0, seqs[2]), processes.wait(0, seqs[0]), processes.wait(0, seqs[1])]
            got = [chunks.buffers[i].array.copy() for i in range(3)]
    finally:
        close_spans(spans)
    assert all(t > 0 for t in times)
    for i, chunk in enumerate(got):
        assert np.array_equal(chunk, pattern(640 * KIB)[i * 64 * KIB : (i + 1) * 64 * KIB])


@pytest.mark.parametrize("fill", ["processes", "threads"])
def test_the_simulator_s_fill_processes_pay_the_fixed_cost_only_when_woken(files: list[Path], fill: str) -> None:
    """A fill process sleeps on its pipe: the profile's fixed cost per copy is paid by one that was
    idle when handed the copy, not by one still busy with the copy before. Threads pay it for every
    copy (their lock hand-offs), as before."""
    latency = 5e-3  # far above what the copies themselves take
    profile = {"base": "cuda-h200", "ring_fill": fill, "host_copy_latency_s": latency}
    with expertstream.backend("sim", profile=profile) as sim:
        device = sim.device(0)
        sources = [device.wrap_host(np.memmap(path, dtype=np.uint8, mode="r")) for path in files]
        with StagingRing(sources, threads=3, chunk_bytes=32 * KIB, chunks=8, part_bytes=32 * KIB) as ring:
            got = _copy_all(ring, device, [(0, 0, 640 * KIB)])  # 20 chunks, one part each
        assert np.array_equal(got[0], sources[0].array)
        copies = [op for op in sim.timeline if op.kind is OpKind.HOST_COPY]
        for source in sources:
            source.close()
    woken = sum(op.end - op.start >= latency for op in copies)
    assert len(copies) == 20
    if fill == "threads":
        assert woken == 20
    else:  # the first copy of each process wakes it; the pipeline then keeps the rest busy
        assert 3 <= woken < 20


def test_the_simulator_charges_a_ring_s_dmas_as_calls_back_to_back(files: list[Path]) -> None:
    """A ring hands each chunk to its DMA and records its event with nothing of the job between the
    calls: they cost the profile's call_s, not the job's time per call (enqueue_s)."""
    profile = {"base": "cuda-h200", "enqueue_s": 1e-3, "call_s": 1e-6, "ring_fill": "threads"}
    with expertstream.backend("sim", profile=profile) as sim:
        device = sim.device(0)
        source = device.wrap_host(np.memmap(files[0], dtype=np.uint8, mode="r"))
        with StagingRing(source, threads=3, chunk_bytes=32 * KIB, chunks=8, part_bytes=32 * KIB) as ring:
            start = sim.host_time()
            _copy_all(ring, device, [(0, 0, 640 * KIB)])  # 20 chunks: 40 calls of the ring's
            took = sim.host_time() - start
        source.close()
    assert took < 20e-3  # a few calls of the job's (the copy, its wait, the read back), not 40


@pytest.mark.parametrize("caller_waits", [True, False], ids=["as-processes", "threads"])
def test_the_simulator_times_threads_as_its_profile_s_fill_processes(files: list[Path], caller_waits: bool) -> None:
    """A profile whose machine fills its ring with processes: under auto, the simulator's ring hands
    timed threads each chunk only after its last DMA, as the ring hands chunks to processes, in the
    processes' geometry; bytes exact."""
    # DMAs slow enough to be running still when the caller hands their chunk on.
    profile = {"base": "cuda-h200", "h2d_pinned_bps": 1e8, "ring_fill": "processes" if caller_waits else "threads"}
    with expertstream.backend("sim", profile=profile) as sim:
        device = sim.device(0)
        sources = [device.wrap_host(np.memmap(path, dtype=np.uint8, mode="r")) for path in files]
        with StagingRing(sources, threads=3, chunk_bytes=64 * KIB, chunks=4) as ring:
            assert ring.fill is (RingFill.PROCESSES if caller_waits else RingFill.THREADS)
            assert ring._processes is None  # threads, timed
            real_fill = ring._fill_part
            chunk_was_free: list[bool] = []

            def fill_part(chunk: Any, *args: Any) -> float:
                sim.host.resume_at(args[4])  # the handoff: the worker starts when the caller handed it the chunk
                chunk_was_free.append(chunk.free_event.query())
                return real_fill(chunk, *args)

            ring._fill_part = fill_part  # type: ignore[method-assign]
            got = _copy_all(ring, device, SPANS)
        for a, b in zip(got, _expected(sources, SPANS), strict=True):
            assert np.array_equal(a, b)
        assert len(chunk_was_free) > ring.chunks  # chunks were refilled
        assert all(chunk_was_free) is caller_waits  # threads wait for the chunk themselves
        with StagingRing(sources, threads=3) as ring:
            assert (ring.chunks, ring.chunk_bytes) == (
                (PROCESS_RING_CHUNKS, PROCESS_RING_CHUNK_BYTES)
                if caller_waits
                else (DEFAULT_RING_CHUNKS, DEFAULT_RING_CHUNK_BYTES)
            )
        for source in sources:
            source.close()
