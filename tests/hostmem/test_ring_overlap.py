"""On the simulator's timeline: chunk fills overlap the DMAs of the chunks before them."""

from __future__ import annotations

import itertools

import numpy as np

import expertstream
from expertstream.backends.sim import SimBackend
from expertstream.hostmem import StagingRing
from expertstream.timeline import OpKind, TimelineOp

MIB = 1 << 20


def _overlaps(a: TimelineOp, b: TimelineOp) -> bool:
    return a.start < b.end and b.start < a.end


def _ring_ops(chunks: int, threads: int, nbytes: int) -> tuple[list[TimelineOp], list[TimelineOp]]:
    with expertstream.backend("sim", profile="cuda-h200") as sim:
        assert isinstance(sim, SimBackend)
        device = sim.device(0)
        data = np.arange(nbytes, dtype=np.uint8)
        with StagingRing(
            device.wrap_host(data), chunk_bytes=MIB, chunks=chunks, threads=threads, fill="threads"
        ) as ring:
            dst = device.alloc(nbytes)
            with device.stream() as stream:
                ring.copy(stream, dst, 0, 0, nbytes)
                stream.synchronize()
            assert np.array_equal(dst.read(), data)
            dst.close()
        ops = [op for op in sim.timeline if op.nbytes]
    # Threads append to the timeline in whatever order the OS runs them: order fills by their
    # virtual start, which the ring's in-turn hand-out of parts to threads makes deterministic.
    fills = sorted((op for op in ops if op.kind is OpKind.HOST_COPY), key=lambda op: (op.start, str(op.thread)))
    dmas = [op for op in ops if op.kind is OpKind.H2D and op.nbytes <= MIB]
    return fills, dmas


def test_fill_of_the_next_chunk_overlaps_each_dma() -> None:
    fills, dmas = _ring_ops(chunks=3, threads=1, nbytes=8 * MIB)
    assert len(fills) == len(dmas) == 8
    for k, dma in enumerate(dmas[:-1]):
        assert _overlaps(fills[k + 1], dma), f"the fill of chunk {k + 1} waited for the DMA of chunk {k}"


def test_a_chunk_is_refilled_only_after_its_dma() -> None:
    chunks = 2
    fills, dmas = _ring_ops(chunks=chunks, threads=1, nbytes=6 * MIB)
    for k in range(chunks, len(fills)):
        assert fills[k].start >= dmas[k - chunks].end, f"chunk {k % chunks} refilled before its DMA ended"


def test_threads_fill_one_chunk_in_parallel() -> None:
    fills, _ = _ring_ops(chunks=2, threads=4, nbytes=8 * MIB)
    # A 1 MiB chunk is below the split threshold, so every fill is one part; the parts of
    # consecutive chunks run on different threads at the same time.
    assert any(_overlaps(a, b) and a.thread != b.thread for a, b in itertools.pairwise(fills))
