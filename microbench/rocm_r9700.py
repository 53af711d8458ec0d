"""The simulator's rocm-r9700 profile next to the reported measurements on the Radeon AI PRO R9700.

Two comparisons, each simulated cell beside the reported figure and the relative error
(simulated - reported) / reported; where the PR #28414 report gives a range, against its middle:

- event order: ``microbench.event_order`` on the profile (copy1 64 MiB, copy2 1 GiB) against the
  reported HIP microbench (B released at 1.3 ms, or 22 ms for a pageable wait issued after copy2);
- prefill tokens/s: ``expertstream.bench.measure`` (what `expertstream prefill` runs) in timing-only
  mode on the ``qwen3.8-flash-next`` preset (Q4_0), ubatch 4096, slots 0/2/3/4, pinned and mmap,
  at the reported prompt lengths, against the reported tables; and decode tokens/s against the
  reported 24.9-25.6.

Which figures the profile was fitted to (and so agree by construction) is in
microbench/rocm_r9700_fit.py; every other cell is a prediction.

    python -m microbench.rocm_r9700 [--tokens 27000,64000,150000,190000] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import expertstream
from expertstream.bench.measure import Settings, measure
from expertstream.bench.placeholder import write_sparse_model
from expertstream.bench.report import Row, format_table
from expertstream.engine.runner import Batching
from expertstream.hostmem import HostMemoryMode
from expertstream.model import MoeModel

from . import event_order

log = logging.getLogger("microbench.rocm_r9700")

PROFILE = "rocm-r9700"
PRESET = "qwen3.8-flash-next"
QTYPE = "Q4_0"
UBATCH = 4096
SLOTS = (0, 2, 3, 4)
MODES = (HostMemoryMode.PINNED, HostMemoryMode.MMAP)
TOKENS = (27000, 64000, 150000, 190000)

# The reported HIP microbench: when stream B was released, in ms, by (host memory, B's wait order).
REPORTED_EVENT_ORDER_MS = {
    ("pinned", "before"): 1.3,
    ("pinned", "after"): 1.3,
    ("pageable", "before"): 1.3,
    ("pageable", "after"): 22.0,
}


@dataclass(frozen=True)
class ReportedRow:
    """One row of the reported prefill tables: t/s (low, high) by prompt length in thousands of tokens."""

    slots: int
    host_memory: str  # the simulated mode it is compared with
    source: str
    tokens_per_s: dict[int, tuple[float, float]]


REPORTED_PREFILL = (
    ReportedRow(0, "pinned", "stock copy path (mmap)", {27: (1014, 1014), 64: (1079, 1079), 190: (917, 917)}),
    ReportedRow(0, "mmap", "stock copy path (mmap)", {27: (1014, 1014), 64: (1079, 1079), 190: (917, 917)}),
    ReportedRow(2, "mmap", "PR branch, mmap", {27: (1059, 1059), 64: (1051, 1051)}),
    ReportedRow(3, "pinned", "PR branch, pinned", {27: (1459, 1532), 64: (1484, 1484)}),
    ReportedRow(
        3,
        "pinned",
        "own staging ring, 3 slots",
        {27: (1518, 1518), 64: (1473, 1473), 150: (1329, 1329), 190: (1232, 1232)},
    ),
    ReportedRow(3, "mmap", "PR branch, mmap", {27: (1319, 1319), 64: (1292, 1292)}),
    ReportedRow(4, "pinned", "own staging ring, 4 or 6 slots", {27: (1555, 1563), 64: (1597, 1600)}),
    ReportedRow(4, "mmap", "PR branch, mmap", {27: (1318, 1318), 64: (1291, 1291)}),
)


REPORTED_DECODE = (24.9, 25.6)  # t/s, "decode unchanged" beside every prefill row
DECODE_STEPS = 8


def relative_error(simulated: float, low: float, high: float) -> float:
    return simulated / ((low + high) / 2) - 1


def event_order_rows() -> list[dict[str, Any]]:
    args = argparse.Namespace(device=0, copy1_mb=64, copy2_mb=1024, repeats=1)
    with expertstream.backend("sim", profile=PROFILE, data=False) as backend:
        rows: list[dict[str, Any]] = event_order.run(backend, args)["rows"]
    for row in rows:
        reported = REPORTED_EVENT_ORDER_MS.get((row["host_memory"], row["wait"]))
        row["reported_ms"] = reported
        row["rel_error"] = None if reported is None else relative_error(row["released_ms"], reported, reported)
    return rows


def prefill_rows(model: MoeModel, tokens: int) -> list[Row]:
    """Every (host memory, slots) row at one prompt length, on a fresh simulated device."""
    settings = Settings(Batching(tokens, UBATCH), SLOTS, MODES)
    with expertstream.backend("sim", profile=PROFILE, data=False) as backend:
        result = measure(backend, backend.device(0), model, settings, lambda what: log.info("%d: %s", tokens, what))
    return result.rows


def decode_rows(model: MoeModel) -> list[Row]:
    """Decode steps (stock path, stand-in routing in timing-only mode) from pinned and mmap memory."""
    settings = Settings(Batching(16, 16, DECODE_STEPS), (0,), MODES)
    with expertstream.backend("sim", profile=PROFILE, data=False) as backend:
        return measure(backend, backend.device(0), model, settings).rows


def comparisons(rows: list[Row]) -> list[dict[str, Any]]:
    """One entry per reported row: the simulated t/s at each prompt length with the reported figure."""
    simulated = {(r.slots, r.host_memory, r.tokens): r.prefill_tokens_per_s for r in rows}
    lengths = sorted({r.tokens for r in rows})
    out = []
    for reported in REPORTED_PREFILL:
        cells = []
        for tokens in lengths:
            value = simulated.get((reported.slots, reported.host_memory, tokens))
            figure = reported.tokens_per_s.get(round(tokens / 1000))
            error = None if value is None or figure is None else relative_error(value, *figure)
            cells.append({"tokens": tokens, "simulated": value, "reported": figure, "rel_error": error})
        out.append(
            {"slots": reported.slots, "host_memory": reported.host_memory, "source": reported.source, "cells": cells}
        )
    return out


def _cell(cell: dict[str, Any]) -> str:
    if cell["simulated"] is None:
        return "-"
    if cell["reported"] is None:
        return f"{cell['simulated']:.0f} (no reported figure)"
    low, high = cell["reported"]
    reported = f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
    return f"{cell['simulated']:.0f} vs {reported} ({cell['rel_error']:+.1%})"


def print_report(
    events: list[dict[str, Any]], rows: list[Row], compared: list[dict[str, Any]], decode: list[Row]
) -> None:
    print(f"event order on {PROFILE} (copy1 64 MiB, copy2 1 GiB): released ms, simulated vs reported")
    print("| host memory | B waits | simulated ms | reported ms | rel. error | host blocked ms |")
    print("|---|---|---|---|---|---|")
    for e in events:
        reported = "-" if e["reported_ms"] is None else f"{e['reported_ms']:g}"
        error = "-" if e["rel_error"] is None else f"{e['rel_error']:+.1%}"
        print(
            f"| {e['host_memory']} | {e['wait']} | {e['released_ms']:.2f} | {reported} | {error} | "
            f"{e['host_blocked_ms']:.2f} |"
        )
    lengths = sorted({r.tokens for r in rows})
    print(f"\nprefill t/s on {PROFILE}, {PRESET} {QTYPE}, ubatch {UBATCH}: simulated vs reported (rel. error)")
    print("| slots | host | reported row | " + " | ".join(f"{t} tokens" for t in lengths) + " |")
    print("|---|---|---|" + "---|" * len(lengths))
    for c in compared:
        cells = " | ".join(_cell(cell) for cell in c["cells"])
        print(f"| {c['slots']} | {c['host_memory']} | {c['source']} | {cells} |")
    low, high = REPORTED_DECODE
    for row in decode:
        rate = row.decode_tokens_per_s or 0.0
        print(
            f"\ndecode t/s ({row.host_memory}, {DECODE_STEPS} steps): {rate:.1f} vs {low}-{high} "
            f"({relative_error(rate, low, high):+.1%})"
        )
    for tokens in lengths:
        print(f"\n{tokens} tokens:")
        print(format_table([r for r in rows if r.tokens == tokens]))


def _token_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of token counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microbench.rocm_r9700", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=_token_list, default=TOKENS, help="comma list of prompt lengths")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    events = event_order_rows()
    with tempfile.TemporaryDirectory(prefix="rocm-r9700-") as folder:
        path = write_sparse_model(PRESET, QTYPE, Path(folder) / f"{PRESET}-{QTYPE}.gguf")
        with MoeModel.open(path) as model:
            expert_bytes = sum(t.nbytes for t in model.expert_tensors)
            rows = [row for tokens in args.tokens for row in prefill_rows(model, tokens)]
            decode = decode_rows(model)
    compared = comparisons(rows)
    if args.json:
        document = {
            "profile": PROFILE,
            "preset": PRESET,
            "expert_type": QTYPE,
            "expert_bytes": expert_bytes,
            "ubatch": UBATCH,
            "event_order": events,
            "prefill": [asdict(r) for r in rows],
            "compared": compared,
            "decode": [asdict(r) for r in decode],
            "reported_decode_tokens_per_s": REPORTED_DECODE,
        }
        print(json.dumps(document, indent=2))
    else:
        print_report(events, rows, compared, decode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
