"""What a prefill run prints: its rows on stdout as each group of them finishes, in one format.

A run of many settings takes minutes to hours; printing each group of rows when it is done lets
a reader of a pipe see them at once, and lets Ctrl-C keep the rows already measured.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ..bench.measure import Measurement
from ..bench.report import (
    Column,
    Row,
    as_json,
    csv_fields,
    csv_lines,
    disk_note,
    jsonl_line,
    markdown_header,
    markdown_line,
    mismatched,
    ring_note,
    table_columns,
    table_header,
    table_line,
)
from .tools import write_out

# How long a hard stop's last words wait for the main thread to finish printing the same thing.
_FINISH_WAIT_S = 0.5


def notice(message: str) -> None:
    """One line on stderr from the prefill command."""
    print(f"expertstream prefill: {message}", file=sys.stderr)


@dataclass
class Report:
    """The header shared by every row of a prefill command and one Measurement per batching."""

    header: dict[str, Any]
    results: list[Measurement] = field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        return [row for result in self.results for row in result.rows]

    def document(self, interrupted: bool = False) -> dict[str, Any]:
        """The JSON document; ``interrupted``: Ctrl-C stopped the run, and the rows are those done."""
        first = self.results[0].baselines
        baselines = {
            # The pinned rate the transfer floor divides by: the median of the probe's copies, their range beside it.
            "h2d_peak_gbps": first.h2d_peak.gbps,
            "h2d_peak_range_gbps": [first.h2d_peak.low_gbps, first.h2d_peak.high_gbps],
            "h2d_peak_copies": first.h2d_peak.copies,
            "compute_only_s": first.compute_only_s,  # of the first batching; every row has its own
            "compute_only_all_layers": first.compute_only_all_layers,
            "compute_only_sha256": first.compute_only_sha256,
            "matrix_paths": self.results[0].matrix_paths,  # mul_mat_id's path per expert type
            "kernel_families": self.results[0].kernel_families,  # and its kernels: the path, or "direct"
            "gate_up_fused": self.results[0].gate_up_fused,
        }
        return as_json({**self.header, **baselines, **({"interrupted": True} if interrupted else {})}, self.rows)

    def check(self) -> int:
        """0 when every row's output agrees (with the others of its prompt and decode steps, and the
        compute-only run), else 1.

        The expert blocks alone compute each token by itself, whatever the ubatch; the whole model's
        attention sums over the ubatch's keys in tiles, so its rows agree within one ubatch size
        (as llama.cpp's outputs do).
        """
        alike: dict[tuple[int, int, int, str], list[Row]] = {}
        for row in self.rows:
            ubatch = row.ubatch if row.work == "whole" else 0
            alike.setdefault((row.tokens, row.decode_steps, ubatch, row.work), []).append(row)
        for rows in alike.values():
            differing = mismatched(rows)
            if differing:
                notice(f"outputs differ between rows: {', '.join(differing)}")
                return 1
        broken = [f"{r.label} ({r.nonfinite})" for r in self.rows if r.nonfinite]
        if broken:
            notice(f"non-finite outputs in rows: {', '.join(broken)}")
            return 1
        for result in self.results:
            reference = result.baselines.compute_only_sha256
            if reference is not None and result.rows and result.rows[0].prefill_sha256 != reference:
                notice("streamed outputs differ from the device-resident (compute-only) run")
                return 1
        return 0


class RowPrinter:
    """Prints a report's rows as each group of them finishes.

    text and md: the table's header with the first rows, then rows as they come (text opens with
    the backend, model and kernels, and ends with each batching's baselines and the ring's
    summary); csv and jsonl: a line per row as it comes; json: one document at the end, or at an
    interrupt with the rows done, marked ``"interrupted": true``; None: nothing (the caller prints).
    """

    def __init__(self, output_format: str | None) -> None:
        self.output_format = output_format
        self.report: Report | None = None
        self._columns: tuple[Column, ...] | None = None
        self._csv_fields: list[str] | None = None
        self._finishing = threading.Lock()
        self._finished = False

    def begin(self, header: dict[str, Any]) -> Report:
        self.report = Report(header)
        return self.report

    def add(self, result: Measurement) -> None:
        """Keep ``result`` in the report and print its rows."""
        assert self.report is not None, "begin first"
        self.report.results.append(result)
        lines = self._lines(result)
        if lines:
            write_out("\n".join(lines))

    def finish(self, interrupted: bool = False) -> None:
        """Print what comes once, after the rows (at most once, from whichever thread comes first)."""
        if not self._finishing.acquire(timeout=_FINISH_WAIT_S):
            return
        try:
            if self._finished or self.report is None or not self.report.results:
                return
            self._finished = True
            if self.output_format == "json":
                write_out(json.dumps(self.report.document(interrupted), indent=2))
            elif self.output_format == "text":
                write_out("\n".join(_closing_lines(self.report)))
        finally:
            self._finishing.release()

    def _lines(self, result: Measurement) -> list[str]:
        assert self.report is not None
        rows, fmt = result.rows, self.output_format
        if fmt == "jsonl":
            return [jsonl_line(self.report.header, row) for row in rows]
        if fmt == "csv":
            first = self._csv_fields is None
            if self._csv_fields is None:
                self._csv_fields = csv_fields(rows)
            return [csv_lines(rows, self._csv_fields, header=first)]
        if fmt not in ("text", "md"):
            return []
        lines: list[str] = []
        if self._columns is None:
            self._columns = table_columns(rows)
            if fmt == "text":
                lines += _opening_lines(self.report.header, result)
            lines.append(table_header(self._columns) if fmt == "text" else markdown_header(self._columns))
        line = table_line if fmt == "text" else markdown_line
        return lines + [line(row, self._columns) for row in rows]


def _opening_lines(header: dict[str, Any], first: Measurement) -> list[str]:
    model = header["model"]
    where = header["device"] + (f" (profile {header['profile']})" if header["profile"] else "")
    families = ", ".join(f"{name} {family}" for name, family in first.kernel_families.items())
    return [
        f"backend {header['backend']}: {where}{', timing only' if header['timing_only'] else ''}",
        f"model: {model['arch']}, {model['n_layer']} layers, {model['n_expert']} experts, top-{model['top_k']}, "
        f"{model['expert_type']}, {model['expert_bytes'] / 1e9:.3f} GB of experts",
        f"expert kernels: {families}{'; gate, up and SwiGLU fused' if first.gate_up_fused else ''}",
    ]


def _closing_lines(report: Report) -> list[str]:
    lines = []
    for result in report.results:
        base, row = result.baselines, result.rows[0]
        offload = "" if row.n_cpu_moe is None else f", -ncmoe {row.n_cpu_moe}"
        lines.append(
            f"{row.tokens} tokens in ubatches of {row.ubatch}{offload}; pinned H2D peak "
            f"{base.h2d_peak.gbps:.1f} GB/s (median of {base.h2d_peak.copies} copies, {base.h2d_peak.low_gbps:.1f}-"
            f"{base.h2d_peak.high_gbps:.1f}); compute only {base.compute_only_s:.4f} s"
            f"{'' if base.compute_only_all_layers else ' (layer 0 weights for all layers)'}"
        )
    notes = (ring_note(report.rows), disk_note(report.rows))
    return lines + [note for note in notes if note]


__all__ = ["Report", "RowPrinter", "notice"]
