"""How fast the drive behind a file reads as mode disk reads it: O_DIRECT, several reads in flight.

Per depth (reads in flight, one thread each), GB/s of large sequential reads into aligned buffers
(``--read-mib`` each, ``--gib`` per depth, wrapping around a smaller file); then the latency of one
small read. The same measurement as `expertstream tune`'s drive fields, on the wall clock of this
machine (no GPU needed). Where the file is in the page cache it says so: O_DIRECT reads bypass it,
but where the filesystem refuses O_DIRECT the reads go through it and show memory's speed.

    python -m microbench.disk_read --file model.gguf [--depths 1 4 16] [--read-mib 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from expertstream.bench.disk import DEFAULT_DEPTHS, DEFAULT_READ_BYTES, DiskTiming, fit_disk, measure_disk

from ._common import MIB, Column, print_table

COLUMNS = (
    Column("depth", "in flight"),
    Column("read_mib", "read MiB", "{:g}"),
    Column("reads", "reads"),
    Column("gb_per_s", "GB/s", "{:.2f}"),
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m microbench.disk_read", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, required=True, help="the file to read (a GGUF model)")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEFAULT_DEPTHS), help="reads in flight to time")
    p.add_argument("--read-mib", type=float, default=DEFAULT_READ_BYTES / MIB, help="bytes per read, MiB")
    p.add_argument("--gib", type=float, default=1.0, help="bytes read at each depth, GiB")
    p.add_argument("--json", action="store_true", help="print JSON on stdout (the table goes to stderr)")
    return p.parse_args(argv)


def result(timing: DiskTiming) -> dict[str, Any]:
    rows = [
        {"depth": t.depth, "read_mib": t.read_bytes / MIB, "reads": t.reads, "gb_per_s": t.bytes_per_s / 1e9}
        for t in timing.depths
    ]
    return {**asdict(timing), "rows": rows, "profile_fields": fit_disk(timing), "cache_note": timing.cache_note()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    timing = measure_disk(
        args.file, depths=args.depths, read_bytes=int(args.read_mib * MIB), depth_bytes=int(args.gib * (1 << 30))
    )
    out = result(timing)
    table = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps(out, indent=2))
    how = "O_DIRECT" if timing.direct else f"buffered, dropped after each read ({timing.fallback_reason})"
    print(f"{timing.path}: {timing.file_bytes / 1e9:.2f} GB read {how}", file=table)
    print_table(out["rows"], COLUMNS, table)
    print(f"one {timing.latency_bytes} byte read: {timing.latency_s * 1e6:.0f} us (median)", file=table)
    if timing.cache_note() is not None:
        print(timing.cache_note(), file=table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
