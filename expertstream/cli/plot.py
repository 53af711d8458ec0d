"""`expertstream plot`: a PNG of prefill results (tokens/s against ubatch) or of a trace (a timeline).

matplotlib is an optional extra (`pip install 'expertstream[plot]'`); it draws headless (Agg).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .tools import EXIT_STATUS_HELP, HelpFormatter, UsageError, writable_path

INSTALL_HINT = "pip install 'expertstream[plot]'"
DPI = 100

# One colour per kind of operation in a trace (the timeline's OpKind values).
KIND_COLOURS = {
    "h2d": "#1f77b4",
    "d2h": "#17becf",
    "d2d": "#9edae5",
    "memset": "#7f7f7f",
    "kernel": "#2ca02c",
    "wait": "#d62728",
    "host_copy": "#ff7f0e",
    "host_sync": "#9467bd",
    "host_register": "#8c564b",
}


def register(subparsers: Any) -> None:
    """Add the plot subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plot",
        help="draw prefill results or a trace as a PNG",
        description="RESULTS.json (from `prefill -o json` or `demo --json`): prefill tokens/s against ubatch, "
        "one line per slot setting and host memory mode, with the compute-only and transfer-floor rates. "
        "TRACE.json (from `prefill --trace`): the copy and compute streams per device and the host threads "
        f"on one time axis, copies, kernels and waits in distinct colours. Needs matplotlib: {INSTALL_HINT}.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("input", help="a results or trace JSON file")
    parser.add_argument("-o", "--output", required=True, help="the PNG to write")
    parser.add_argument("--size", default="1200x700", type=_size, help="width x height in pixels")
    parser.set_defaults(run=_plot)


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 1200x700, got {text!r}") from None
    if width < 200 or height < 150:
        raise argparse.ArgumentTypeError(f"at least 200x150 pixels, got {text!r}")
    return width, height


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"plot needs matplotlib: {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot(args: argparse.Namespace, command_line: str) -> int:
    output = writable_path(args.output, "-o")
    plt = _pyplot()
    source = Path(args.input)
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{source}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{source}: not JSON ({exc})") from None
    width, height = args.size
    fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    try:
        if isinstance(doc, dict) and "traceEvents" in doc:
            _timeline(fig, doc["traceEvents"])
        elif isinstance(doc, dict) and ("rows" in doc or "runs" in doc):
            _results(fig, doc.get("runs", [doc]))
        else:
            raise UsageError(f"{source}: neither prefill results (rows) nor a trace (traceEvents)")
        fig.savefig(output, dpi=DPI)
    finally:
        plt.close(fig)
    print(f"wrote {output}")
    return 0


def _results(fig: Any, runs: list[dict[str, Any]]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    lines: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        for row in run.get("rows", []):
            lines[(run.get("model", {}).get("arch"), row["tokens"], row["slots"], row["host_memory"])].append(row)
    if not lines:
        raise UsageError("the results hold no rows")
    several_models = len({key[:2] for key in lines}) > 1
    for key, rows in sorted(lines.items(), key=lambda item: tuple(map(str, item[0]))):
        rows.sort(key=lambda r: r["ubatch"])
        label = f"slots {key[2]}, {key[3]}" + (f" ({key[0]}, p={key[1]})" if several_models else "")
        ax.errorbar(
            [r["ubatch"] for r in rows],
            [r["prefill_tokens_per_s"] for r in rows],
            yerr=[r.get("prefill_tokens_per_s_sd", 0.0) for r in rows],
            marker="o",
            capsize=3,
            label=label,
        )
    _reference(ax, lines, "compute_only_tokens_per_s", "compute only (experts on the device)", "k", "--")
    _reference(ax, lines, "transfer_floor_tokens_per_s", "transfer floor (expert bytes at H2D peak)", "r", ":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ubatch (tokens)")
    ax.set_ylabel("prefill tokens/s")
    ax.set_title("prefill throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()


def _reference(ax: Any, lines: dict[tuple[Any, ...], list[dict[str, Any]]], key: str, label: str, *style: str) -> None:
    """One rate per ubatch from the rows that carry it (the best row's, where several do)."""
    best: dict[int, float] = {}
    for rows in lines.values():
        for row in rows:
            value = row.get(key)
            if value is not None:
                best[row["ubatch"]] = max(best.get(row["ubatch"], 0.0), float(value))
    if best:
        ubatches = sorted(best)
        ax.plot(ubatches, [best[u] for u in ubatches], color=style[0], linestyle=style[1], marker="x", label=label)


def _timeline(fig: Any, events: list[dict[str, Any]]) -> None:
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    spans: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X":
            spans[(event["pid"], event["tid"])].append(event)
    if not spans:
        raise UsageError("the trace holds no timed operations")
    # Devices first (pid 0 is the host), each device's tracks in stream order.
    tracks = sorted(spans, key=lambda track: (track[0] == 0, track))
    origin = min(e["ts"] for rows in spans.values() for e in rows)
    ax = fig.add_subplot(1, 1, 1)
    seen: set[str] = set()
    for y, track in enumerate(tracks):
        by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for event in spans[track]:
            by_kind[event.get("cat", "")].append(((event["ts"] - origin) / 1e3, max(event["dur"], 0.0) / 1e3))
        for kind, bars in by_kind.items():
            colour = KIND_COLOURS.get(kind, "#bcbd22")
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, label=None if kind in seen else kind)
            seen.add(kind)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"{processes.get(p, p)}: {threads.get((p, t), t)}" for p, t in tracks], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title("copies, kernels and waits per stream")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
