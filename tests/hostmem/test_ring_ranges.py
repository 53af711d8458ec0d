"""Several ranges through the staging ring at once (a decode step's experts): exact bytes, the
announced copies around them undisturbed, and on the simulator's clock the fills side by side."""

from __future__ import annotations

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend
from expertstream.backends.sim import Profile
from expertstream.errors import InvalidArgument, UseAfterClose
from expertstream.hostmem import StagingRing
from expertstream.scheduler.plan import Input
from expertstream.scheduler.prefetch import PrefetchSlots, Unit
from expertstream.scheduler.source import HostRegion, copies_pageable, enqueue_ranges
from expertstream.scheduler.stats import DeviceStats

from .patterns import pattern

MIB = 1 << 20


@pytest.mark.parametrize(("chunk_bytes", "chunks", "threads"), [(4096, 2, 1), (10_000, 3, 4), (1 << 20, 8, 12)])
def test_ranges_arrive_exact_between_announced_copies(
    backend: Backend, chunk_bytes: int, chunks: int, threads: int
) -> None:
    device = backend.device(0)
    data = pattern(12 * chunk_bytes + 4320)
    quarter = data.nbytes // 4
    with StagingRing(device.wrap_host(data), chunk_bytes=chunk_bytes, chunks=chunks, threads=threads) as ring:
        whole = [ring.region(k * quarter, quarter) for k in range(4)]
        ranges = [(5, 5 + chunk_bytes + 3), (2 * chunk_bytes + 1, 2 * chunk_bytes + 999), (quarter - 7, quarter)]
        with device.alloc(quarter) as dst, device.alloc(data.nbytes) as out, device.stream() as stream:
            stream.memset(dst, 0, quarter, 0)
            ring.expect(whole)
            whole[0].enqueue_h2d(stream, out, 0, 0, quarter)
            # Not announced: the fills made ahead for whole[1:] are redone after these.
            whole[2].enqueue_h2d_ranges(stream, dst, ranges)
            for k in (1, 2, 3):
                whole[k].enqueue_h2d(stream, out, k * quarter, 0, quarter)
            stream.synchronize()
            got, copied = dst.read(0, quarter), out.read(0, data.nbytes)
        assert ring.unannounced_copies == len(ranges)
        assert ring.skipped_copies == 0
    assert np.array_equal(copied, data)
    expected = np.zeros(quarter, dtype=np.uint8)
    for start, end in ranges:
        expected[start:end] = data[2 * quarter + start : 2 * quarter + end]
    assert np.array_equal(got, expected)


def test_plain_host_memory_takes_the_ranges_one_by_one(backend: Backend) -> None:
    device = backend.device(0)
    data = pattern(50_000)
    with device.alloc(data.nbytes) as dst, device.stream() as stream:
        stream.memset(dst, 0, data.nbytes, 0)
        enqueue_ranges(HostRegion(device.wrap_host(data), 0, data.nbytes), stream, dst, [(10, 900), (40_000, 50_000)])
        stream.synchronize()
        got = dst.read(0, data.nbytes)
    assert np.array_equal(got[10:900], data[10:900])
    assert np.array_equal(got[40_000:], data[40_000:])
    assert not got[900:40_000].any()


def test_ranges_are_checked(backend: Backend) -> None:
    device = backend.device(0)
    data = pattern(10_000)
    ring = StagingRing(device.wrap_host(data), chunk_bytes=4096, chunks=2, threads=1)
    with device.alloc(100) as dst, device.stream() as stream:
        with pytest.raises(InvalidArgument):
            ring.copy_ranges(stream, dst, [(0, 0, 101)])  # longer than dst
        with pytest.raises(InvalidArgument):
            ring.copy_ranges(stream, dst, [(0, 9_950, 100)])  # past the source's end
        with pytest.raises(InvalidArgument):
            ring.region(0, 50).enqueue_h2d_ranges(stream, dst, [(40, 60)])  # past the region's end
        ring.close()
        with pytest.raises(UseAfterClose):
            ring.copy_ranges(stream, dst, [(0, 0, 10)])


def _seconds(at_once: bool) -> float:
    """Virtual seconds to copy 8 experts of 0.88 MB, 2 apart, through a ring of 12 threads."""
    expert = 884_736
    profile = Profile.from_dict({"base": "cuda-h200", "host_memcpy_bps": 6e9, "host_memcpy_total_bps": 40e9})
    with expertstream.backend("sim", profile=profile, data=False) as sim:
        device = sim.device(0)
        source = device.placeholder_host(16 * expert)
        ranges = [(2 * k * expert, (2 * k + 1) * expert) for k in range(8)]
        with (
            StagingRing(source, chunk_bytes=32 * MIB, chunks=8, threads=12) as ring,
            device.alloc(16 * expert) as dst,
            device.stream() as stream,
        ):
            region = ring.region(0, 16 * expert)
            start = sim.host.timestamp()
            if at_once:
                region.enqueue_h2d_ranges(stream, dst, ranges)
            else:
                for begin, end in ranges:
                    region.enqueue_h2d(stream, dst, begin, begin, end - begin)
            stream.synchronize()
            return sim.host.timestamp() - start


def test_the_ranges_fill_side_by_side() -> None:
    one_by_one, at_once = _seconds(at_once=False), _seconds(at_once=True)
    # Eight fills of 0.15 ms each on eight threads, against one after the other, each with its DMA.
    assert at_once < one_by_one / 3


def test_only_copies_from_pageable_memory_count_as_pageable(backend: Backend) -> None:
    # The copy worker's gate (ordering rule 5) is for copies a wait may bind to on ROCm: copies
    # from pageable memory. A staging ring blocks its caller too, but its DMAs read pinned chunks.
    device = backend.device(0)
    data = pattern(8192)
    pageable = HostRegion(device.wrap_host(data), 0, data.nbytes)
    with device.alloc_pinned(8192) as pinned_buffer:
        pinned = HostRegion(pinned_buffer, 0, 8192)
        with StagingRing(device.wrap_host(data), chunk_bytes=4096, chunks=2, threads=1) as ring:
            staged = ring.region(0, data.nbytes)
            assert (pageable.blocks_host, pinned.blocks_host, staged.blocks_host) == (True, False, True)
            assert (copies_pageable(pageable), copies_pageable(pinned), copies_pageable(staged)) == (True, False, False)


def test_a_staged_copy_goes_out_before_the_previous_splits_wait(backend: Backend) -> None:
    # No consumer ever waits for the first unit here; a gated copy would never go out.
    device = backend.device(0)
    data = pattern(8192)
    slots = PrefetchSlots(device)
    stats = DeviceStats(device.label)
    with StagingRing(device.wrap_host(data), chunk_bytes=4096, chunks=2, threads=1) as ring:
        first, second = (Unit(Input(f"w{k}", 4096, host=ring.region(4096 * k, 4096)), position=k) for k in range(2))
        slots.configure([4096, 4096])
        try:
            slots.fire(first, stats, True, None)
            slots.fire(second, stats, True, first)
            # Generous: the copy is staged in microseconds; a gate would hold it until the wait.
            assert second.recorded.wait(timeout=120)
            assert second.error is None and not first.waited.is_set()
        finally:
            first.waited.set()  # so that a gated copy (the failure) lets the worker drain
            slots.close()
