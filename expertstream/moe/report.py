"""Rows of a prefill run (one per slot setting), their table, their JSON and the hash check."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO


@dataclass(frozen=True)
class Row:
    """What one slot setting did. Times come from backend.host_timestamp (virtual on the simulator)."""

    slots: int
    host_memory: str  # the mode used, after any fallback
    tokens: int
    ubatch: int
    ttft_s: float  # wall time of the whole prefill plan
    prefill_tokens_per_s: float
    h2d_bytes: int  # expert bytes copied during prefill (lookahead and stock)
    h2d_gbps: float
    h2d_pct_of_peak: float  # of the pinned H2D peak measured in the same run
    transfer_only_s: float  # h2d_bytes at the measured peak
    compute_only_s: float  # the same plan with every expert tensor device-resident
    overlap_efficiency: float  # max(transfer_only_s, compute_only_s) / ttft_s
    stall_ms: float  # slots > 0: the compute stream's waits on slot-ready events; 0: ttft - compute-only
    fires: int
    fallbacks: dict[str, int]
    prefill_sha256: str
    decode_steps: int = 0
    decode_tokens_per_s: float | None = None
    decode_bytes: int = 0  # expert bytes the decode steps copied (used experts only)
    decode_sha256: str | None = None
    output_sha256: str = ""  # prefill and decode outputs together; empty when the backend holds no data
    nonfinite: int = 0  # NaN or infinite output values: a wrong byte read somewhere
    layers_streamed: int = 0  # MoE layers whose experts stream from host memory (partial offload)
    layers_resident: int = 0  # MoE layers whose experts were uploaded once and stay on the device
    streamed_bytes_per_ubatch: int = 0  # expert bytes the streamed layers copy for each prefill ubatch

    @property
    def label(self) -> str:
        return f"slots={self.slots}/{self.host_memory}"


def mismatched(rows: Sequence[Row]) -> list[str]:
    """Labels of the rows whose output hash differs from the first row's (empty when all agree)."""
    if not rows:
        return []
    reference = rows[0].output_sha256
    differing = [r for r in rows if r.output_sha256 != reference]
    return [rows[0].label, *(r.label for r in differing)] if differing else []


def as_json(header: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    return {**header, "rows": [asdict(r) for r in rows]}


_COLUMNS = (
    ("slots", 5, lambda r: str(r.slots)),
    ("host", 10, lambda r: r.host_memory),
    ("ttft s", 9, lambda r: f"{r.ttft_s:.4f}"),
    ("prefill t/s", 11, lambda r: f"{r.prefill_tokens_per_s:.0f}"),
    ("H2D GB/s", 8, lambda r: f"{r.h2d_gbps:.1f}"),
    ("% peak", 6, lambda r: f"{r.h2d_pct_of_peak:.0f}"),
    ("overlap", 7, lambda r: f"{r.overlap_efficiency:.2f}"),
    ("stall ms", 9, lambda r: f"{r.stall_ms:.1f}"),
    ("decode t/s", 10, lambda r: "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.1f}"),
    ("output sha256", 16, lambda r: r.output_sha256[:16] or "(no data)"),
)


def format_table(rows: Sequence[Row]) -> str:
    header = "  ".join(f"{name:>{width}}" for name, width, _ in _COLUMNS)
    lines = [header]
    for row in rows:
        lines.append("  ".join(f"{cell(row):>{width}}" for _, width, cell in _COLUMNS))
    return "\n".join(lines)


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = self._stream.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (width - filled)
        self._stream.write(f"\r[{bar}] {self.done}/{self.total} {what[:40]:<40}")
        self._stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._stream.write("\r" + " " * 80 + "\r")
            self._stream.flush()
