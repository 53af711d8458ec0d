"""A table of one ncu report's kernels, from its raw page exported as CSV.

    ncu -i REPORT.ncu-rep --csv --page raw > REPORT.csv
    python3 microbench/ncu_table.py REPORT.csv [--summary]

Kernels of one name are gathered in a row: how many ran, the time of all of them, and per launch the
mean time, DRAM throughput (% of peak and GB/s from the bytes it moved), achieved occupancy, registers
a thread, grid and block, and the three stall reasons that cost each issued instruction most
(the sections SpeedOfLight, LaunchStats, Occupancy and WarpStateStats give these). The last line sums
every kernel, for a one-line summary.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict

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


def table(records: list[dict[str, str]]) -> list[str]:
    by_name: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in records:
        by_name[r.get("Kernel Name", "?").split("(")[0]].append(r)

    def mean(rows: list[dict[str, str]], key: str) -> float:
        values = [v for v in (number(r.get(key, "")) for r in rows) if v is not None]
        return statistics.fmean(values) if values else float("nan")

    head = f"{'kernel':<44} {'n':>3} {'sum us':>8} {'us':>7} {'dram%':>6} {'mem%':>6} {'occ%':>5}"
    lines = [head + f" {'regs':>4} {'grid':>7} {'blk':>4}  stalls"]
    total = 0.0

    def time_of(rows: list[dict[str, str]]) -> float:
        return sum(number(r.get("gpu__time_duration.sum", "")) or 0.0 for r in rows)

    order = sorted(by_name.items(), key=lambda kv: -time_of(kv[1]))
    for name, rows in order:
        us = mean(rows, "gpu__time_duration.sum")
        total += us * len(rows)
        reasons = [k for k in rows[0] if k.startswith(STALL) and k.endswith(STALL_END)]
        stalls = sorted(((mean(rows, k), k[len(STALL) : -len(STALL_END)]) for k in reasons), reverse=True)[:3]
        lines.append(
            f"{name[:44]:<44} {len(rows):>3} {us * len(rows):>8.1f} {us:>7.2f}"
            f" {mean(rows, 'gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed'):>6.1f}"
            f" {mean(rows, 'gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed'):>6.1f}"
            f" {mean(rows, 'sm__warps_active.avg.pct_of_peak_sustained_active'):>5.1f}"
            f" {mean(rows, 'launch__registers_per_thread'):>4.0f} {mean(rows, 'launch__grid_size'):>7.0f}"
            f" {mean(rows, 'launch__block_size'):>4.0f}  " + " ".join(f"{k} {v:.1f}" for v, k in stalls)
        )
    lines.append(f"{len(records)} kernels, {total:.1f} us of kernel time")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--summary", action="store_true", help="print only the last line")
    args = p.parse_args(argv)
    lines = table(read(args.csv))
    print("\n".join(lines[-1:] if args.summary else lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
