"""Host-to-device copy bandwidth and host-blocked time, by host memory kind and copy size.

Kinds: pageable numpy memory, pinned memory from the backend, numpy memory registered in
place, and a read-only file mapping registered read-only (how model weights can be served
straight from the page cache). Each row is the median of ``--repeats`` copies timed with
timing events around the copy; ``host_blocked_ms`` is the time the enqueue call held the
host; ``register_ms`` is how long registering the whole buffer took.

    python -m microbench.h2d_bandwidth --backend cuda [--json] [--sizes-mb 64 256 1024]
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass
from typing import Any

from expertstream.backends.base import Backend, DeviceBuffer, Event, HostBuffer, Stream
from expertstream.errors import BackendError

from ._common import MIB, Column, HostKind, blocked_ms, emit, environment, host_memory, median, open_backend
from ._common import parser as common_parser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    host_memory: str
    size_bytes: int
    size_mib: float
    gb_per_s: float | None
    device_ms: float | None
    host_blocked_ms: float | None
    register_ms: float | None
    note: str = ""


def time_copy(
    be: Backend, stream: Stream, events: tuple[Event, Event], dst: DeviceBuffer, src: HostBuffer, nbytes: int
) -> tuple[float, float]:
    """(device ms between the events around one copy, host ms spent enqueuing it)."""
    start, end = events
    stream.record(start)
    blocked = blocked_ms(be, lambda: stream.copy_h2d(dst, 0, src, 0, nbytes))
    stream.record(end)
    end.synchronize()
    return start.elapsed_ms(end), blocked


def measure_kind(
    be: Backend, args: argparse.Namespace, kind: HostKind, sizes: list[int], stream: Stream, dst: DeviceBuffer
) -> list[Row]:
    device = stream.device
    try:
        with (
            host_memory(be, device, kind, max(sizes)) as source,
            device.event(timing=True) as start,
            device.event(timing=True) as end,
        ):
            time_copy(be, stream, (start, end), dst, source.buffer, min(sizes))  # warm-up
            rows = []
            for size in sizes:
                trials = [time_copy(be, stream, (start, end), dst, source.buffer, size) for _ in range(args.repeats)]
                device_ms = median([t[0] for t in trials])
                rows.append(
                    Row(
                        kind.value,
                        size,
                        size / MIB,
                        size / device_ms / 1e6,
                        device_ms,
                        median([t[1] for t in trials]),
                        source.register_ms,
                    )
                )
            return rows
    except BackendError as exc:  # e.g. read-only registration refused: report the row, keep going
        log.warning("%s: %s", kind.value, exc)
        return [
            Row(kind.value, size, size / MIB, None, None, None, None, f"unavailable: {exc.detail}") for size in sizes
        ]


def run(be: Backend, args: argparse.Namespace) -> dict[str, Any]:
    device = be.device(args.device)
    sizes = [mb * MIB for mb in args.sizes_mb]
    kinds = [HostKind(k) for k in args.kinds]
    with device.stream() as stream, device.alloc(max(sizes)) as dst:
        rows = [row for kind in kinds for row in measure_kind(be, args, kind, sizes, stream, dst)]
    return {**environment(be, device), "repeats": args.repeats, "rows": [asdict(r) for r in rows]}


COLUMNS = (
    Column("host_memory", "host memory"),
    Column("size_mib", "MiB", "{:g}"),
    Column("gb_per_s", "GB/s", "{:.1f}"),
    Column("device_ms", "device ms", "{:.2f}"),
    Column("host_blocked_ms", "host blocked ms", "{:.2f}"),
    Column("register_ms", "register ms", "{:.1f}"),
    Column("note", ""),
)


def main(argv: list[str] | None = None) -> int:
    p = common_parser("h2d_bandwidth", "Host-to-device bandwidth and host-blocked time by host memory kind and size.")
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024], help="copy sizes in MiB")
    p.add_argument("--kinds", nargs="+", default=[k.value for k in HostKind], choices=[k.value for k in HostKind])
    p.add_argument("--repeats", type=int, default=5, help="copies per row; the median is reported")
    args = p.parse_args(argv)
    with open_backend(args) as be:
        result = run(be, args)
    emit(args, result, COLUMNS, "host-to-device copies")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
