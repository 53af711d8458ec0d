"""A table of one ncu report's kernels, from its raw page exported as CSV.

    ncu -i REPORT.ncu-rep --csv --page raw > REPORT.csv
    python3 -m microbench.ncu_table REPORT.csv [--summary]

Kernels of one name are gathered in a row: how many ran, the time of all of them, and per launch the
mean time, DRAM and memory throughput (% of peak), achieved occupancy, registers a thread, grid and
block, and the three stall reasons that cost each issued instruction most (the sections SpeedOfLight,
LaunchStats, Occupancy and WarpStateStats give these; "-" where the report lacks one). The last line
sums every kernel, for a one-line summary.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from typing import Any

from ._common import Column, print_table

STALL = "smsp__average_warps_issue_stalled_"
STALL_END = "_per_issue_active.ratio"


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own notes come unquoted
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        raise SystemExit(f"{path}: no kernels in this report (is it `ncu -i R --csv --page raw`?)")
    header, units = rows[0], rows[1]
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
    out = []
    for row in rows[2:]:
        record = dict(zip(header, row, strict=False))
        for name, unit in zip(header, units, strict=False):
            if name == "gpu__time_duration.sum" and unit in scale:
                value = number(record[name])
                record[name] = "" if value is None else str(value * scale[unit])
        out.append(record)
    return out


COLUMNS = (
    Column("kernel", "kernel"),
    Column("n", "n"),
    Column("sum_us", "sum us", "{:.1f}"),
    Column("us", "us", "{:.2f}"),
    Column("dram_pct", "dram%", "{:.1f}"),
    Column("memory_pct", "mem%", "{:.1f}"),
    Column("occupancy_pct", "occ%", "{:.1f}"),
    Column("registers", "regs", "{:.0f}"),
    Column("grid", "grid", "{:.0f}"),
    Column("block", "blk", "{:.0f}"),
    Column("stalls", "stalls"),
)
METRICS = {  # column: ncu's metric, a mean over the launches of a row
    "us": "gpu__time_duration.sum",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}


def _mean(records: list[dict[str, str]], key: str) -> float | None:
    values = [v for v in (number(r.get(key, "")) for r in records) if v is not None]
    return statistics.fmean(values) if values else None


def kernel_rows(records: list[dict[str, str]]) -> list[dict[str, Any]]:
    """A row per kernel name, the most time first."""
    by_name: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in records:
        by_name[r.get("Kernel Name", "?").split("(")[0]].append(r)
    rows = []
    for name, launches in by_name.items():
        row: dict[str, Any] = {"kernel": name[:44], "n": len(launches)}
        row.update({column: _mean(launches, metric) for column, metric in METRICS.items()})
        row["sum_us"] = None if row["us"] is None else row["us"] * len(launches)
        reasons = [k for k in launches[0] if k.startswith(STALL) and k.endswith(STALL_END)]
        stalls = sorted(((_mean(launches, k) or 0.0, k[len(STALL) : -len(STALL_END)]) for k in reasons), reverse=True)
        row["stalls"] = " ".join(f"{k} {v:.1f}" for v, k in stalls[:3])
        rows.append(row)
    return sorted(rows, key=lambda row: -(row["sum_us"] or 0.0))


def summary(rows: list[dict[str, Any]]) -> str:
    total = sum(row["sum_us"] or 0.0 for row in rows)
    return f"{sum(row['n'] for row in rows)} kernels, {total:.1f} us of kernel time"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--summary", action="store_true", help="print only the last line")
    args = p.parse_args(argv)
    rows = kernel_rows(read(args.csv))
    if not args.summary:
        print_table(rows, COLUMNS, sys.stdout)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
