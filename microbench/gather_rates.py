"""How fast the device's own gather of routed experts reads page-locked host memory, by kernel shape,
beside the copy engines on the same rows (``python -m microbench.gather_rates --backend cuda``).

Decode copies the experts its router chose with ``Stream.gather_h2d``: blocks of gather.cu read the
rows over the link themselves, so no host round trip waits for the ids. Such reads need not go at the
copy engines' rate (docs/results/gpu-2026-12-07.md: one H100 host moved decode's experts at about 31 GB/s
where its copy engines reached 54.9). This times gather.cu compiled at several shapes (threads a block, 16-byte
loads each thread keeps in flight, bytes of a row one block copies) on a decode step's worth of rows,
each launch ``--used`` rows picked among ``--experts`` by ids on the device, and beside them:

- ``backend``: ``Stream.gather_h2d`` as decode runs it (the shape the package ships);
- ``dma rows``: the copy engines, one ``copy_h2d`` per row, the ids known to the host;
- ``dma block``: one ``copy_h2d`` of the same bytes in one run, the link's rate.

Every shape's last launch is checked byte for byte against the rows its ids name. Each rate is
the median of ``--rounds`` timings of ``--launches`` launches back to back between timing events.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from expertstream.backends._gpu import _GATHER_THREADS, GATHER_KERNEL, gather_source
from expertstream.backends.base import Backend, Device, DeviceBuffer, Kernel, Stream, Usage

from ._common import Column, emit, environment, open_backend, parser

# About one expert tensor of a 30B-class MoE at 4 bits (gate or up of Qwen3-30B-A3B at Q4_K: 0.88 MB).
ROW_BYTES = 2048 * 768 * 9 // 16
THREADS = (256, 512)
IN_FLIGHT = (4, 8, 16)
CHUNK_BYTES = (32768, 65536, 131072)


@dataclass(frozen=True)
class Row:
    path: str  # "gather", "backend", "dma rows" or "dma block"
    threads: int | None
    in_flight: int | None
    chunk_bytes: int | None
    gb_per_s: float
    spread_gb_per_s: float  # max - min over the rounds
    x_dma_block: float | None = None
    bytes_ok: bool | None = None


def _defined(name: str) -> int:
    """The value gather.cu gives ``#define name``."""
    found = re.findall(rf"^#define {name} (\d+)", gather_source(), flags=re.MULTILINE)
    if len(found) != 1:
        raise ValueError(f"gather.cu defines {name} {len(found)} times, not once: update this benchmark")
    return int(found[0])


# What decode runs today: the backend's block size, gather.cu's loads in flight and block's share of a row.
SHIPPED = (_GATHER_THREADS, _defined("GATHER_IN_FLIGHT"), _defined("GATHER_CHUNK_BYTES"))


def variant_source(in_flight: int, chunk_bytes: int) -> str:
    """gather.cu with its loads in flight and its block's share of a row set to these."""
    source = gather_source()
    for name, value in (("GATHER_IN_FLIGHT", in_flight), ("GATHER_CHUNK_BYTES", chunk_bytes)):
        source, found = re.subn(rf"^(#define {name} )\d+", rf"\g<1>{value}", source, flags=re.MULTILINE)
        if found != 1:
            raise ValueError(f"gather.cu defines {name} {found} times, not once: update this benchmark")
    return source


def _pick_ids(rng: np.random.Generator, launches: int, experts: int, used: int) -> np.ndarray:
    return np.stack([rng.choice(experts, used, replace=False) for _ in range(launches)]).astype(np.int32)


def _timed(
    device: Device, stream: Stream, enqueue: Callable[[], None], rounds: int, nbytes: int
) -> tuple[float, float]:
    """Median and spread (GB/s) of ``rounds`` timings of ``enqueue()`` moving ``nbytes``."""
    enqueue()  # warm-up
    rates = []
    for _ in range(rounds):
        with device.event(timing=True) as start, device.event(timing=True) as end:
            stream.record(start)
            enqueue()
            stream.record(end)
            end.synchronize()
            rates.append(nbytes / (start.elapsed_ms(end) * 1e-3) / 1e9)
    return statistics.median(rates), max(rates) - min(rates)


def _launch_shape(
    stream: Stream,
    kernel: Kernel,
    shape: tuple[int, int, int],
    dst: DeviceBuffer,
    mapped: int,
    region: int,
    ids: DeviceBuffer,
    launch: int,
    used: int,
) -> None:
    threads, _, chunk = shape
    args = (
        dst,
        np.uint64(mapped),
        ids.view(launch * used * 4, used * 4),
        np.int32(0),
        np.uint64(region),
        np.uint64(ROW_BYTES),
        np.uint64(0),  # no overrun
        np.uint64(0),  # no report
        np.int32(0),
        np.uint64(0),  # nothing skipped
        np.int32(0),
    )
    stream.launch(kernel, (-(-ROW_BYTES // chunk), used, 1), (threads, 1, 1), args)


def measure(backend: Backend, device: Device, args: argparse.Namespace) -> list[Row]:
    """The rows: the copy engines' two, the backend's gather, then each compiled shape (GPU backends
    only: the simulator runs its own twin of the shipped one)."""
    shapes = list(itertools.product(args.threads, args.in_flight, args.chunk_bytes))
    if backend.name not in ("cuda", "hip"):
        shapes = []
    launches, used, experts = args.launches, args.used, args.experts
    region = experts * ROW_BYTES
    step_bytes = launches * used * ROW_BYTES
    rng = np.random.default_rng(7)
    picked = _pick_ids(rng, launches, experts, used)
    rows: list[Row] = []
    with (
        device.alloc_pinned(region) as host,
        device.alloc(region, Usage.COMPUTE) as dst,  # each row lands at its own offset, as in decode's scratch
        device.upload(picked.reshape(-1)) as ids,
        device.stream() as stream,
    ):
        try:
            host_bytes = host.numpy(write=True)
            host_bytes[:] = rng.integers(0, 256, region, dtype=np.uint8)
            stream.memset(dst, 0, region, 0)  # rows no launch names stay read as zeros by the checks
            last = [slice(int(e) * ROW_BYTES, (int(e) + 1) * ROW_BYTES) for e in picked[-1]]

            def check() -> bool:
                stream.synchronize()
                got = dst.read().view(np.uint8)
                ok = all(np.array_equal(got[rows], host_bytes[rows]) for rows in last)
                stream.memset(dst, 0, dst.alloc_size, 0)
                return ok

            def dma_block() -> None:
                for _ in range(launches):
                    stream.copy_h2d(dst, 0, host, 0, used * ROW_BYTES)

            block_rate, block_spread = _timed(device, stream, dma_block, args.rounds, step_bytes)
            rows.append(Row("dma block", None, None, None, block_rate, block_spread, 1.0))

            def dma_rows() -> None:
                for launch in range(launches):
                    for expert in picked[launch]:
                        stream.copy_h2d(dst, int(expert) * ROW_BYTES, host, int(expert) * ROW_BYTES, ROW_BYTES)

            rate, spread = _timed(device, stream, dma_rows, args.rounds, step_bytes)
            rows.append(Row("dma rows", None, None, None, rate, spread, rate / block_rate, check()))

            def shipped() -> None:
                for launch in range(launches):
                    stream.gather_h2d(dst, 0, host, 0, region, ids.view(launch * used * 4, used * 4), used, ROW_BYTES)

            rate, spread = _timed(device, stream, shipped, args.rounds, step_bytes)
            rows.append(Row("backend", *SHIPPED, rate, spread, rate / block_rate, check()))

            mapped = device.host_device_address(host) if shapes else 0  # type: ignore[attr-defined]
            for shape in shapes:
                threads, in_flight, chunk = shape
                kernel = device.compile(variant_source(in_flight, chunk), GATHER_KERNEL, chained=True)

                def gather(kernel: Kernel = kernel, shape: tuple[int, int, int] = shape) -> None:
                    for launch in range(launches):
                        _launch_shape(stream, kernel, shape, dst, mapped, region, ids, launch, used)

                rate, spread = _timed(device, stream, gather, args.rounds, step_bytes)
                rows.append(Row("gather", threads, in_flight, chunk, rate, spread, rate / block_rate, check()))
                print(
                    f"  {threads} threads, {in_flight} in flight, {chunk} B a block: {rate:.1f} GB/s", file=sys.stderr
                )
        finally:
            stream.synchronize()  # what is still queued (the last check's clearing memset) before the buffers close
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser("gather_rates", __doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=128, help="rows the host region holds")
    p.add_argument("--used", type=int, default=8, help="rows each launch copies (a token's experts)")
    p.add_argument("--launches", type=int, default=48, help="launches a round (a step's layers)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    p.add_argument("--in-flight", type=int, nargs="+", default=list(IN_FLIGHT))
    p.add_argument("--chunk-bytes", type=int, nargs="+", default=list(CHUNK_BYTES))
    args = p.parse_args(argv)
    if not 0 < args.used <= args.experts:
        p.error(f"--used {args.used} must be 1..--experts ({args.experts})")
    with open_backend(args, data=True) as backend:
        device = backend.device(args.device)
        rows = measure(backend, device, args)
        result: dict[str, Any] = {
            **environment(backend, device),
            "row_bytes": ROW_BYTES,
            "used": args.used,
            "launches": args.launches,
            "rows": [asdict(r) for r in rows],
        }
    columns = (
        Column("path", "path"),
        Column("threads", "threads"),
        Column("in_flight", "in flight"),
        Column("chunk_bytes", "B a block"),
        Column("gb_per_s", "GB/s", "{:.1f}"),
        Column("spread_gb_per_s", "spread", "{:.1f}"),
        Column("x_dma_block", "x dma block", "{:.2f}"),
        Column("bytes_ok", "bytes ok"),
    )
    emit(args, result, columns, f"gather of {args.used} rows of {ROW_BYTES} B, {args.launches} launches a round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
