"""The staging ring: bounded pinned memory, chunked and pipelined copies that stay byte-exact."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, HostBuffer
from expertstream.errors import HazardError, InvalidArgument, UseAfterClose
from expertstream.hostmem import HostMemoryMode, HostWeights, RingOptions, StagingRing

from .patterns import pattern


def test_ring_uses_bounded_pinned_memory(backend: Backend, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = backend.device(0)
    sizes: list[int] = []
    buffers: list[HostBuffer] = []
    real = device.alloc_pinned

    def counting_alloc(n: int) -> HostBuffer:
        buf = real(n)
        sizes.append(n)
        buffers.append(buf)
        return buf

    monkeypatch.setattr(device, "alloc_pinned", counting_alloc)
    ring = RingOptions(chunk_bytes=32_768, chunks=3, threads=2, fill="threads")
    weights = HostWeights.open(tiny_path, device, HostMemoryMode.RING, ring=ring)
    assert sizes == [32_768] * 3 == [b.nbytes for b in buffers]
    assert weights.stats.pinned_bytes == 3 * 32_768
    total = sum(t.nbytes for t in weights.model.tensors.values())
    assert weights.stats.pinned_bytes < total / 10
    # Copy everything through it: no further pinned allocation.
    dst = device.alloc(total)
    with device.stream() as stream:
        offset = 0
        for name in weights:
            weights[name].enqueue_h2d(stream, dst, offset, 0, weights[name].nbytes)
            offset += weights[name].nbytes
        stream.synchronize()
    expected = np.concatenate([weights.model.raw(name) for name in weights])
    assert np.array_equal(dst.read(0, total), expected)
    dst.close()
    assert len(sizes) == 3
    weights.close()
    assert all(b.closed for b in buffers)


def test_ring_chunks_shrink_to_the_largest_tensor(backend: Backend, tiny_path: Path) -> None:
    with HostWeights.open(tiny_path, backend.device(0), "ring", ring=RingOptions(chunks=2, threads=1)) as weights:
        largest = max(t.nbytes for t in weights.model.tensors.values())
        assert weights.stats.pinned_bytes == 2 * largest


@pytest.mark.parametrize(
    ("chunk_bytes", "chunks", "threads"),
    # The last chunk size is split between threads (parts of at least 8 MiB).
    [(4096, 2, 1), (10_000, 3, 4), (1 << 20, 4, 3), (17 << 20, 2, 3)],
)
def test_ring_copies_exact_bytes_for_any_geometry(
    backend: Backend, chunk_bytes: int, chunks: int, threads: int
) -> None:
    device = backend.device(0)
    data = pattern(3 * chunk_bytes + 12_345)
    with StagingRing(device.wrap_host(data), chunk_bytes=chunk_bytes, chunks=chunks, threads=threads) as ring:
        dst = device.alloc(data.nbytes)
        with device.stream() as stream:
            # Several calls in a row reuse the chunks; offsets are deliberately unaligned.
            cuts = [0, 1, 777, chunk_bytes + 5, 2 * chunk_bytes + 9, data.nbytes]
            for start, end in itertools.pairwise(cuts):
                ring.region(0, data.nbytes).enqueue_h2d(stream, dst, start, start, end - start)
            stream.synchronize()
        assert np.array_equal(dst.read(), data)
        assert ring.bytes_staged == data.nbytes
        dst.close()


def test_zero_byte_copy_is_a_no_op(backend: Backend) -> None:
    device = backend.device(0)
    data = pattern(1000)
    with StagingRing(device.wrap_host(data), chunk_bytes=256, chunks=2, threads=1) as ring:
        dst = device.alloc(16)
        with device.stream() as stream:
            ring.copy(stream, dst, 16, 1000, 0)
            stream.synchronize()
        assert ring.bytes_staged == 0
        dst.close()


def test_concurrent_callers_are_serialized_and_exact(backend: Backend) -> None:
    device = backend.device(0)
    data = pattern(3 * (1 << 20) + 3)
    with StagingRing(device.wrap_host(data), chunk_bytes=200_000, chunks=3, threads=2) as ring:
        half = data.nbytes // 2
        dsts = [device.alloc(half), device.alloc(data.nbytes - half)]
        errors: list[BaseException] = []
        finished: list[float] = []
        start_time = backend.host.timestamp()

        def worker(index: int) -> None:
            backend.host.resume_at(start_time)
            try:
                with device.stream() as stream:
                    ring.copy(stream, dsts[index], 0, index * half, dsts[index].nbytes)
                    stream.synchronize()
            except BaseException as exc:  # reported below
                errors.append(exc)
            finished.append(backend.host.timestamp())

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for timestamp in finished:  # the joins, told to the backend
            backend.host.resume_at(timestamp)
        assert np.array_equal(np.concatenate([d.read() for d in dsts]), data)
        for d in dsts:
            d.close()


@pytest.mark.parametrize(
    ("kwargs", "bad"), [({"chunk_bytes": 0}, "chunk_bytes"), ({"chunks": 1}, "chunks"), ({"threads": 0}, "threads")]
)
def test_ring_geometry_is_checked(backend: Backend, kwargs: dict[str, int], bad: str) -> None:
    device = backend.device(0)
    args = {"chunk_bytes": 1024, "chunks": 2, "threads": 1, **kwargs}
    with pytest.raises(InvalidArgument, match="staging ring needs chunk_bytes >= 1, chunks >= 2"):
        StagingRing(device.wrap_host(pattern(10)), **args)


def test_a_ring_refuses_device_memory_as_its_source(backend: Backend) -> None:
    device = backend.device(0)
    host = device.wrap_host(pattern(1024))
    with device.alloc(1024) as on_device:
        for sources in (on_device, [host, on_device]):
            with pytest.raises(InvalidArgument) as err:
                StagingRing(sources, chunk_bytes=1024, chunks=2, threads=1)  # type: ignore[arg-type]
            assert (
                err.value.detail == "a staging ring copies from HostBuffers (host memory), not from a DeviceBuffer "
                "(device memory)"
            )
            assert err.value.call == "StagingRing"


def test_ring_refuses_out_of_range_and_closed_use(backend: Backend) -> None:
    device = backend.device(0)
    ring = StagingRing(device.wrap_host(pattern(4096)), chunk_bytes=1024, chunks=2, threads=1)
    dst = device.alloc(8192)
    with device.stream() as stream:
        with pytest.raises(InvalidArgument):
            ring.copy(stream, dst, 0, 4000, 200)
        ring.close()
        with pytest.raises(UseAfterClose, match="staging ring is closed"):
            ring.copy(stream, dst, 0, 0, 100)
    dst.close()


def test_a_refill_that_skips_its_wait_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's checker sees host copies into pinned chunks a DMA may still be reading."""
    with expertstream.backend("sim") as sim:
        device = sim.device(0)
        data = pattern(4 * 4096)
        with StagingRing(device.wrap_host(data), chunk_bytes=4096, chunks=2, threads=1) as ring:
            for chunk in ring._chunks:  # a refill that does not wait for the chunk's last DMA
                monkeypatch.setattr(chunk.free_event, "synchronize", lambda: None)
            dst, stream = device.alloc(data.size), device.stream()
            with pytest.raises(HazardError, match="write-after-read") as info:
                ring.copy(stream, dst, 0, 0, data.size)
            assert "host copy on host thread" in str(info.value) and "h2d copy on stream" in str(info.value)
            monkeypatch.undo()
            device.synchronize()
            ring.copy(stream, dst, 0, 0, data.size)  # with its waits: no hazard, every byte right
            stream.synchronize()
            assert np.array_equal(dst.read(), data)
            dst.close()
