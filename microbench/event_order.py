"""When is a stream waiting on an event released, and how long does the host sit in enqueue calls?

Stream A copies copy1, records e1, copies copy2; stream B waits for e1. B's wait is issued
either before copy2 is enqueued or after. The event binds to copy1 either way, so B should be
released once copy1 is done; but where enqueuing copy2 blocks the host (pageable memory on
CUDA), a wait issued after it is only issued once copy2 has finished. That is the ordering
rule of the scheduler: issue the consumer's wait before firing the next lookahead copy.

``released_ms`` is a timing event recorded on B after its wait, measured from a timing event
recorded on A at the start (device time; virtual on the simulator); ``released_wall_ms`` is
when the host saw it; ``host_blocked_ms`` is the host time spent inside the enqueue calls.

    python -m microbench.event_order --backend cuda [--json] [--copy1-mb 64 --copy2-mb 1024]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from expertstream.backends.base import Backend, Device, DeviceBuffer, HostBuffer, Stream
from expertstream.bench.probes import event_order_once

from ._common import MIB, Column, HostKind, emit, environment, host_memory, median, open_backend
from ._common import parser as common_parser

KINDS = (HostKind.PINNED, HostKind.PAGEABLE, HostKind.REGISTERED)
WAITS = ("before", "after")


@dataclass(frozen=True)
class Row:
    host_memory: str
    wait: str  # "before" or "after" copy2 is enqueued
    released_ms: float
    released_wall_ms: float
    host_blocked_ms: float


@dataclass(frozen=True)
class Setup:
    backend: Backend
    device: Device
    stream_a: Stream
    stream_b: Stream
    dst: DeviceBuffer
    copy1: int
    copy2: int


def run_once(setup: Setup, host: HostBuffer, wait: str) -> tuple[float, float, float]:
    """One trial: (released_ms by events, released_ms seen by the host, host-blocked ms)."""
    streams, sizes = (setup.stream_a, setup.stream_b), (setup.copy1, setup.copy2)
    trial = event_order_once(setup.backend, setup.device, streams, setup.dst, host, sizes, wait)
    released, seen, blocked = (seconds * 1e3 for seconds in trial)
    return released, seen, blocked


def measure(setup: Setup, kind: HostKind, repeats: int) -> list[Row]:
    rows = []
    with host_memory(setup.backend, setup.device, kind, setup.copy1 + setup.copy2) as source:
        run_once(setup, source.buffer, "before")  # warm-up: first use of this memory
        for wait in WAITS:
            trials = [run_once(setup, source.buffer, wait) for _ in range(repeats)]
            released, wall, blocked = (median(column) for column in zip(*trials, strict=True))
            rows.append(Row(kind.value, wait, released, wall, blocked))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = common_parser("event_order", "When a stream waiting on an event is released, by host memory kind.")
    p.add_argument("--copy1-mb", type=int, default=64, help="MiB copied before e1")
    p.add_argument("--copy2-mb", type=int, default=1024, help="MiB copied after e1")
    p.add_argument("--repeats", type=int, default=3, help="trials per row; the median is reported")
    args = p.parse_args(argv)
    with open_backend(args) as be:
        result = run(be, args)
    emit(args, result, COLUMNS, "event order: when is stream B released")
    return 0


def run(be: Backend, args: argparse.Namespace) -> dict[str, Any]:
    device = be.device(args.device)
    copy1, copy2 = args.copy1_mb * MIB, args.copy2_mb * MIB
    with device.stream() as a, device.stream() as b, device.alloc(copy1 + copy2) as dst:
        setup = Setup(be, device, a, b, dst, copy1, copy2)
        rows = [row for kind in KINDS for row in measure(setup, kind, args.repeats)]
    return {
        **environment(be, device),
        "copy1_bytes": copy1,
        "copy2_bytes": copy2,
        "repeats": args.repeats,
        "rows": [asdict(r) for r in rows],
    }


COLUMNS = (
    Column("host_memory", "host memory"),
    Column("wait", "B waits"),
    Column("released_ms", "released ms", "{:.2f}"),
    Column("released_wall_ms", "host saw ms", "{:.2f}"),
    Column("host_blocked_ms", "host blocked ms", "{:.2f}"),
)

if __name__ == "__main__":
    raise SystemExit(main())
