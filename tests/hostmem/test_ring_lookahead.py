"""The staging ring told the copies to come: exact bytes in any order, chunks never overwritten
under a DMA, and on the simulator's clock no drain between copies."""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import expertstream
from expertstream.backends.base import Backend, DeviceBuffer, HostBuffer, Stream
from expertstream.backends.sim import Profile, SimBackend
from expertstream.bench.measure import Settings, measure
from expertstream.bench.placeholder import write_sparse_model
from expertstream.bench.report import ring_note
from expertstream.engine.runner import Batching, MoeRunner, sha256
from expertstream.errors import HazardError, InvalidArgument, UseAfterClose
from expertstream.hostmem import HostMemoryMode, HostWeights, RingOptions, RingRegion, StagingRing
from expertstream.model import MoeModel
from expertstream.scheduler import Bindings, Plan, Scheduler
from expertstream.scheduler.source import HostRegion, HostSource, expect_copies
from expertstream.timeline import OpKind

from .patterns import pattern

MIB = 1 << 20


def _copy_all(regions: list[RingRegion], stream: Stream, dst: DeviceBuffer) -> None:
    """Copy each region to its own place in ``dst``: at its offset in the source."""
    for region in regions:
        region.enqueue_h2d(stream, dst, region.start, 0, region.length)


@pytest.mark.parametrize(("chunk_bytes", "chunks", "threads"), [(4096, 2, 1), (10_000, 3, 4), (9 << 20, 2, 3)])
def test_expected_copies_are_exact(backend: Backend, chunk_bytes: int, chunks: int, threads: int) -> None:
    device = backend.device(0)
    data = pattern(5 * chunk_bytes + 12_345)
    with StagingRing(device.wrap_host(data), chunk_bytes=chunk_bytes, chunks=chunks, threads=threads) as ring:
        # Unaligned cuts, a copy smaller than a chunk, one spanning several, one of zero bytes.
        cuts = [0, 1, 777, 777, chunk_bytes + 5, 4 * chunk_bytes + 9, data.nbytes]
        regions = [ring.region(a, b - a) for a, b in itertools.pairwise(cuts)]
        ring.expect(regions)
        with device.alloc(data.nbytes) as dst, device.stream() as stream:
            _copy_all(regions, stream, dst)
            stream.synchronize()
            assert np.array_equal(dst.read(), data)
        assert (ring.unannounced_copies, ring.skipped_copies) == (0, 0)
        assert ring.bytes_staged == data.nbytes


def test_copies_out_of_the_expected_order_are_exact(backend: Backend) -> None:
    device = backend.device(0)
    chunk = 10_000
    data = pattern(12 * chunk + 321)
    with StagingRing(device.wrap_host(data), chunk_bytes=chunk, chunks=3, threads=2) as ring:
        cuts = [0, 2 * chunk + 3, 3 * chunk, 5 * chunk + 1, 7 * chunk, 9 * chunk + 7, data.nbytes]
        a, b, c, d, e, f = (ring.region(x, y - x) for x, y in itertools.pairwise(cuts))
        ring.expect([a, b, c, d, e, f])
        with device.alloc(data.nbytes) as dst, device.stream() as stream:
            b.enqueue_h2d(stream, dst, b.start, 0, b.length)  # a is skipped: its fill is wasted
            part = ring.region(c.start + 5, 100)  # not announced: the fills made ahead wait for it
            part.enqueue_h2d(stream, dst, part.start, 0, part.length)
            a.enqueue_h2d(stream, dst, a.start, 0, a.length)  # already skipped: not announced any more
            c.enqueue_h2d(stream, dst, c.start, 0, c.length)  # back in order
            e.enqueue_h2d(stream, dst, e.start, 0, e.length)  # d is skipped
            d.enqueue_h2d(stream, dst, d.start, 0, d.length)
            f.enqueue_h2d(stream, dst, f.start + 11, 11, f.length - 11)  # a part of f: not announced
            f.enqueue_h2d(stream, dst, f.start, 0, 11)
            stream.synchronize()
            assert np.array_equal(dst.read(), data)
        assert ring.skipped_copies == 2  # a and d
        assert ring.unannounced_copies == 5  # part, a, d, and both parts of f


def test_a_new_list_replaces_the_last_and_an_empty_one_ends_it(backend: Backend) -> None:
    device = backend.device(0)
    data = pattern(50_000)
    with StagingRing(device.wrap_host(data), chunk_bytes=4096, chunks=2, threads=2) as ring:
        first, second = ring.region(0, 20_000), ring.region(20_000, 30_000)
        ring.expect([first, second])
        ring.expect([second, first])
        with device.alloc(data.nbytes) as dst, device.stream() as stream:
            _copy_all([second, first], stream, dst)
            ring.expect(())
            _copy_all([first], stream, dst)
            stream.synchronize()
            assert np.array_equal(dst.read(), data)
        assert (ring.unannounced_copies, ring.skipped_copies) == (1, 0)


def test_closing_waits_for_the_fills_made_ahead() -> None:
    with expertstream.backend("sim", profile="cuda-h200") as sim:
        device = sim.device(0)
        data = pattern(9 << 20)
        ring = StagingRing(device.wrap_host(data), chunk_bytes=4 << 20, chunks=2, threads=2, fill="threads")
        chunks = [chunk.buffer for chunk in ring._chunks]
        ring.expect([ring.region(0, data.nbytes)])  # two chunks' fills start now; none is asked for
        ring.close()
        assert all(chunk.closed for chunk in chunks)
        fills = [op for op in sim.timeline if op.kind is OpKind.HOST_COPY]
        assert len(fills) == 2  # one per chunk (a 4 MiB chunk is one part: parts are 8 MiB at least)
        assert sim.host.timestamp() >= max(op.end for op in fills), "chunks freed before their fills ended"


def test_only_the_rings_own_regions_can_be_expected(backend: Backend) -> None:
    device = backend.device(0)
    data = device.wrap_host(pattern(8192))
    with (
        StagingRing(data, chunk_bytes=1024, chunks=2, threads=1) as ring,
        StagingRing(data, chunk_bytes=1024, chunks=2, threads=1) as other,
    ):
        with pytest.raises(InvalidArgument, match="is not a region of this staging ring"):
            ring.expect([other.region(0, 100)])
        with pytest.raises(InvalidArgument, match="is not a region of this staging ring"):
            ring.expect([HostRegion(data, 0, 100)])
        ring.close()
        with pytest.raises(UseAfterClose, match="staging ring is closed"):
            ring.expect([ring.region(0, 100)])


def test_each_ring_is_told_its_own_copies_in_order(backend: Backend) -> None:
    device = backend.device(0)
    data = device.wrap_host(pattern(8192))
    told: dict[int, list[HostSource]] = {}

    class Recording(StagingRing):
        def expect(self, sources: Sequence[HostSource]) -> None:
            told[id(self)] = list(sources)

    with (
        Recording(data, chunk_bytes=1024, chunks=2, threads=1) as one,
        Recording(data, chunk_bytes=1024, chunks=2, threads=1) as two,
    ):
        a, b, c = one.region(0, 10), one.region(10, 10), two.region(0, 10)
        plain = HostRegion(data, 0, 10)
        lookaheads = expect_copies([b, plain, c, a])
        assert told == {id(one): [b, a], id(two): [c]}
        assert lookaheads == [one, two]


# -- chunk reuse, on the simulator's clock ----------------------------------------------------


@dataclass(frozen=True)
class _Use:
    chunk: int  # id() of the pinned chunk
    start: float
    end: float


class _ChunkUses:
    """Every host write into the ring's chunks and every DMA from them, with its virtual interval."""

    def __init__(self, sim: SimBackend, ring: StagingRing) -> None:
        self.sim = sim
        self.chunks = {id(chunk.buffer) for chunk in ring._chunks}
        self.writes: list[_Use] = []
        self._dma_sources: list[int] = []
        real_host_copy = ring.device.backend.host.copy

        def host_copy(
            dst: HostBuffer,
            dst_offset: int,
            src: HostBuffer,
            src_offset: int,
            nbytes: int,
            *,
            sharing: int = 1,
            fixed_cost: bool = True,
        ) -> None:
            start = sim.host.timestamp()
            real_host_copy(dst, dst_offset, src, src_offset, nbytes, sharing=sharing, fixed_cost=fixed_cost)
            self.writes.append(_Use(id(dst), start, sim.host.timestamp()))

        ring.device.backend.host.copy = host_copy  # type: ignore[method-assign]

    def watch(self, stream: Stream) -> None:
        real_copy_h2d = stream.copy_h2d

        def copy_h2d(dst: DeviceBuffer, dst_offset: int, src: HostBuffer, src_offset: int, nbytes: int) -> None:
            self._dma_sources.append(id(src))
            real_copy_h2d(dst, dst_offset, src, src_offset, nbytes)

        stream.copy_h2d = copy_h2d  # type: ignore[method-assign]

    def reads(self) -> list[_Use]:
        dmas = [op for op in self.sim.timeline if op.kind is OpKind.H2D]
        assert len(dmas) == len(self._dma_sources)  # only the ring copies to the device here
        return [_Use(chunk, op.start, op.end) for chunk, op in zip(self._dma_sources, dmas, strict=True)]


def _overlapping(writes: list[_Use], reads: list[_Use]) -> list[tuple[_Use, _Use]]:
    return [(w, r) for w in writes for r in reads if w.chunk == r.chunk and w.start < r.end and r.start < w.end]


def _watched_copies(order: list[int], in_ranges: int | None = None) -> tuple[list[_Use], list[_Use], bool]:
    """Copy 6 tensors of 2.5 chunks through 3 chunks, in ``order``, all 6 announced in order;
    tensor ``in_ranges`` as three ranges in one call, as a decode step copies its experts.

    Returns the chunk writes, the DMAs, and whether the device got the right bytes.
    """
    with expertstream.backend("sim", profile="cuda-h200") as sim:
        assert isinstance(sim, SimBackend)
        device = sim.device(0)
        data = pattern(6 * 5 * MIB // 2)
        # Threads, each waiting for its chunk's DMA: what the checks below watch (fill processes: test_fill_processes).
        with StagingRing(device.wrap_host(data), chunk_bytes=MIB, chunks=3, threads=2, fill="threads") as ring:
            uses = _ChunkUses(sim, ring)
            tensors = [ring.region(k * 5 * MIB // 2, 5 * MIB // 2) for k in range(6)]
            ring.expect(tensors)
            with device.alloc(data.nbytes) as dst, device.stream() as stream:
                uses.watch(stream)
                for k in order:
                    tensor = tensors[k]
                    if k == in_ranges:
                        cuts = [0, MIB // 3, 2 * MIB + 7, tensor.length]
                        ring.copy_ranges(
                            stream,
                            dst,
                            [(tensor.start + a, tensor.start + a, b - a) for a, b in itertools.pairwise(cuts)],
                        )
                    else:
                        _copy_all([tensor], stream, dst)
                stream.synchronize()
                exact = np.array_equal(dst.read(), data)
        return uses.writes, uses.reads(), exact


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [1, 0, 2, 4, 3, 5], [5, 4, 3, 2, 1, 0]])
def test_no_chunk_is_written_while_a_dma_reads_it(order: list[int]) -> None:
    writes, reads, exact = _watched_copies(order)
    assert exact
    assert len(reads) == 6 * 3  # 2.5 chunks each: three pieces
    assert not _overlapping(writes, reads)


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [3, 2, 1, 0, 4, 5]])
def test_ranges_between_announced_copies_never_overwrite_a_chunk_under_a_dma(order: list[int]) -> None:
    writes, reads, exact = _watched_copies(order, in_ranges=2)
    assert exact
    assert not _overlapping(writes, reads)


def test_the_check_sees_a_chunk_refilled_before_its_dma_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the wait for the chunk's free event, fills start as soon as they are handed out.
    original = StagingRing._fill_part

    def no_wait(self, chunk, *args):  # type: ignore[no-untyped-def]
        return original(self, type(chunk)(chunk.index, chunk.buffer, self.device.event()), *args)

    monkeypatch.setattr(StagingRing, "_fill_part", no_wait)
    try:
        writes, reads, _ = _watched_copies([0, 1, 2, 3, 4, 5])
    except HazardError:
        return  # a hazard checker that tracks host writes to pinned memory saw it first
    assert _overlapping(writes, reads)


# -- no drain between copies, on the simulator's clock -------------------------------------------


def _pass_seconds(lookahead: bool) -> tuple[float, float]:
    """Virtual seconds to copy 8 tensors of 2.5 chunks through 3 chunks, and the fill threads' idle time."""
    with expertstream.backend("sim", profile="cuda-h200", data=False) as sim:
        assert isinstance(sim, SimBackend)
        device = sim.device(0)
        source = device.placeholder_host(8 * 5 * MIB // 2)
        with StagingRing(source, chunk_bytes=MIB, chunks=3, threads=1) as ring:
            tensors = [ring.region(k * 5 * MIB // 2, 5 * MIB // 2) for k in range(8)]
            if lookahead:
                ring.expect(tensors)
            with device.alloc(5 * MIB // 2) as dst, device.stream() as stream:
                start = sim.host.timestamp()
                for tensor in tensors:
                    tensor.enqueue_h2d(stream, dst, 0, 0, tensor.length)
                stream.synchronize()
                seconds = sim.host.timestamp() - start
        fills = sorted((op.start, op.end) for op in sim.timeline if op.kind is OpKind.HOST_COPY)
        idle = sum(max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(fills))
        return seconds, idle


def test_told_the_order_the_fill_threads_never_wait_between_copies() -> None:
    with_order, idle = _pass_seconds(lookahead=True)
    without, idle_without = _pass_seconds(lookahead=False)
    # One thread fills at 8.1 GB/s, slower than the link: each copy's fills follow the last's.
    assert idle == 0.0
    assert idle_without > 0.0
    assert with_order < without


@pytest.mark.parametrize(("chunk_mib", "chunks"), [(32, 8), (64, 4), (16, 16), (96, 2)])
def test_the_fill_threads_share_the_host_memory_bus_whatever_the_geometry(chunk_mib: int, chunks: int) -> None:
    # 12 threads of 6 GB/s each on a 24 GB/s bus stream at the bus's rate, below the 55 GB/s link,
    # however many parts each chunk's fill has (4 of 8 MiB for 32 MiB chunks, 1 for 16 MiB ones).
    profile = Profile.from_dict({"base": "cuda-h200", "host_memcpy_bps": 6e9, "host_memcpy_total_bps": 24e9})
    nbytes = 1 << 30
    with expertstream.backend("sim", profile=profile, data=False) as sim:
        device = sim.device(0)
        source = device.placeholder_host(nbytes)
        with (
            StagingRing(source, chunk_bytes=chunk_mib * MIB, chunks=chunks, threads=12) as ring,
            device.alloc(nbytes) as dst,
            device.stream() as stream,
        ):
            region = ring.region(0, nbytes)
            start = sim.host.timestamp()
            ring.expect([region])
            region.enqueue_h2d(stream, dst, 0, 0, nbytes)
            stream.synchronize()
            seconds = sim.host.timestamp() - start
    assert nbytes / seconds == pytest.approx(24e9, rel=0.08)


# -- through the scheduler -----------------------------------------------------------------------


def test_prefill_through_the_ring_is_announced_and_exact(backend: Backend, tiny_path: Path) -> None:
    device = backend.device(0)
    batching = Batching(tokens=32, ubatch=16, decode_steps=2)
    ring = RingOptions(chunk_bytes=60_000, chunks=3, threads=2)
    outputs = {}
    with MoeModel.open(tiny_path) as model, MoeRunner(device, model, batching) as runner:
        with HostWeights.open(model, device, "pinned") as pinned, Scheduler(slots=3) as scheduler:
            scheduler.run(runner.prefill_plan(pinned))
            expected = sha256(runner.prefill_output())
        with HostWeights.open(model, device, HostMemoryMode.RING, ring=ring) as weights:
            ring = next(iter(weights.values()))
            assert isinstance(ring, RingRegion)
            for slots in (0, 3):
                with Scheduler(slots=slots) as scheduler:
                    before = ring.ring.unannounced_copies
                    scheduler.run(runner.prefill_plan(weights))
                    assert ring.ring.unannounced_copies == before, "every prefill copy was expected"
                    assert ring.ring.skipped_copies == 0
                    outputs[slots] = sha256(runner.prefill_output())
                    # A decode step copies only the experts its ids use, and was not announced.
                    scheduler.run(runner.decode_plan(weights, 0))
                    assert ring.ring.unannounced_copies > before
    assert outputs == {0: expected, 3: expected}


@pytest.mark.parametrize("slots", [2, 3])
def test_prefetched_and_stock_copies_of_one_ring_keep_the_announced_order(tiny_path: Path, slots: int) -> None:
    # Gate, up and SwiGLU as one split: with 2 slots one of its two tensors takes the stock copy on the
    # launching thread while the copy worker makes the other split's copies. The worker must not ask the
    # ring for a later tensor before the launching thread has asked for its stock one.
    with expertstream.backend("sim") as sim:
        device = sim.device(0)
        batching = Batching(tokens=32, ubatch=16)
        with MoeModel.open(tiny_path) as model, MoeRunner(device, model, batching, fuse_gate_up=True) as runner:
            assert runner.fuses_gate_up()
            with HostWeights.open(model, device, "pinned") as pinned, Scheduler(slots=0) as scheduler:
                scheduler.run(runner.prefill_plan(pinned))
                expected = sha256(runner.prefill_output())
            ring = RingOptions(chunk_bytes=60_000, chunks=3, threads=2)
            with HostWeights.open(model, device, HostMemoryMode.RING, ring=ring) as weights:
                ring = weights.rings[0]
                with Scheduler(slots=slots) as scheduler:
                    scheduler.run(runner.prefill_plan(weights))
                    stock = scheduler.last_stats.total("stock_copies")
                assert sha256(runner.prefill_output()) == expected
                assert (ring.skipped_copies, ring.unannounced_copies) == (0, 0)
    assert (stock > 0) == (slots == 2)  # with 3 slots both tensors are prefetched


def test_a_failing_split_leaves_no_copy_waiting_for_a_launch(tiny_path: Path) -> None:
    # The copy worker waits for the launch of the split before it; a run that fails earlier must not hang.
    with expertstream.backend("sim") as sim:
        device = sim.device(0)
        with MoeModel.open(tiny_path) as model, MoeRunner(device, model, Batching(32, 16), fuse_gate_up=True) as runner:
            ring = RingOptions(chunk_bytes=60_000, chunks=3, threads=2)
            with (
                HostWeights.open(model, device, HostMemoryMode.RING, ring=ring) as weights,
                Scheduler(slots=2) as sched,
            ):
                plan = runner.prefill_plan(weights)

                def broken(stream: Stream, bindings: Bindings) -> None:
                    raise RuntimeError("a kernel failed to launch")

                splits = list(plan.splits)
                at = next(i for i, split in enumerate(splits) if split.name.startswith("gate_up") and i > 2)
                splits[at] = dataclasses.replace(splits[at], compute=broken)
                with pytest.raises(RuntimeError, match="failed to launch"):
                    sched.run(Plan.of(splits))
                sched.run(plan)  # and the scheduler and ring go on


# The H200 host's 12 fill threads together copied about 35 GB/s from a mapping into pinned
# memory while DMAs read the chunks: slower than the link, as there.
H200_HOST = Profile.from_dict({"base": "cuda-h200", "host_memcpy_bps": 35e9 / 12})


@pytest.fixture(scope="module")
def qwen3_four_layers() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ring-lookahead-") as folder:
        yield write_sparse_model("qwen3-30b-a3b", "Q4_0", Path(folder) / "qwen3.gguf", layers=4)


def _prefill_seconds(path: Path, slots: tuple[int, ...]) -> dict[int, float]:
    with expertstream.backend("sim", profile=H200_HOST, data=False) as sim, MoeModel.open(path) as model:
        settings = Settings(Batching(4096, 2048), slots, (HostMemoryMode.RING,), ring=RingOptions(threads=12))
        return {row.slots: row.ttft_s for row in measure(sim, sim.device(0), model, settings).rows}


@pytest.mark.parametrize("fill", ["threads", "processes"])
def test_ring_rows_say_where_the_fill_workers_spent_their_time(qwen3_four_layers: Path, fill: str) -> None:
    profile = dataclasses.replace(H200_HOST, ring_fill=fill)
    with expertstream.backend("sim", profile=profile, data=False) as sim, MoeModel.open(qwen3_four_layers) as model:
        modes = (HostMemoryMode.RING, HostMemoryMode.REGISTERED)
        settings = Settings(Batching(4096, 2048), (0, 3), modes, ring=RingOptions(threads=12))
        rows = measure(sim, sim.device(0), model, settings).rows
    ring_rows = [row for row in rows if row.host_memory == "ring"]
    assert len(ring_rows) == 2
    for row in ring_rows:
        assert row.ring_threads == 12 and row.ring_fill == fill
        assert row.ring_copy_pct is not None and row.ring_chunk_wait_pct is not None
        if fill == "threads":  # the same threads copy and wait
            assert row.ring_copy_pct + row.ring_chunk_wait_pct <= 100.0 + 1e-9
        else:  # the processes copy; the ring's caller waits for chunks before it sends their fills
            assert row.ring_copy_pct <= 100.0 + 1e-9 and row.ring_chunk_wait_pct <= 100.0 + 1e-9
        # Copying slower than the link, the threads are what bounds these prefills.
        assert row.ring_copy_pct > 80.0
        # Each copies at the lower of the profile's one-thread rate and a 12th of the host memory bus.
        bus = H200_HOST.host_memcpy_total_bps or float("inf")
        assert row.ring_thread_gbps == pytest.approx(min(H200_HOST.host_memcpy_bps, bus / 12) / 1e9, rel=0.01)
    for row in rows:
        if row.host_memory != "ring":
            assert (row.ring_threads, row.ring_copy_pct, row.ring_thread_gbps) == (None, None, None)


@pytest.mark.parametrize("fill", ["threads", "processes"])
def test_a_ring_its_dmas_hold_back_says_so_whoever_fills_it(qwen3_four_layers: Path, fill: str) -> None:
    """A link slower than the host's copies: threads wait for their chunks' DMAs, and so does the
    caller that hands chunks to fill processes; either wait is counted over whoever waits."""
    profile = dataclasses.replace(H200_HOST, ring_fill=fill, h2d_pinned_bps=5e9, host_memcpy_bps=20e9)
    with expertstream.backend("sim", profile=profile, data=False) as sim, MoeModel.open(qwen3_four_layers) as model:
        settings = Settings(Batching(2048, 2048), (0,), (HostMemoryMode.RING,), ring=RingOptions(threads=4))
        rows = measure(sim, sim.device(0), model, settings).rows
    (row,) = rows
    assert row.ring_chunk_wait_pct is not None and 50.0 <= row.ring_chunk_wait_pct <= 100.0 + 1e-9
    note = ring_note(rows)
    assert note is not None and "the copies to the device hold it back" in note
    assert ("its caller waiting for chunk DMAs" in note) is (fill == "processes")


def test_lookahead_prefill_through_the_ring_is_never_slower(
    qwen3_four_layers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    told = _prefill_seconds(qwen3_four_layers, (0, 3))
    assert told[3] <= told[0]
    monkeypatch.setattr(StagingRing, "expect", lambda self, sources: None)
    untold = _prefill_seconds(qwen3_four_layers, (0, 3))
    assert told[0] <= untold[0]
    assert told[3] < untold[3]
