"""`expertstream plot`: a PNG of prefill results (tokens/s against ubatch) or of a trace (a timeline).

matplotlib is an optional extra (`pip install 'expertstream[plot]'`); it draws headless (Agg).
"""

from __future__ import annotations

import argparse
import json
import textwrap
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
# Kernels drawn over copies, copies over the rest, where spans of one track meet.
DRAW_ORDER = {"kernel": 3, "h2d": 2}


def register(subparsers: Any) -> None:
    """Add the plot subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plot",
        help="draw prefill results or a trace as a PNG",
        description="RESULTS.json (from `prefill -o json` or `demo --json`): prefill tokens/s against ubatch, "
        "one panel per model (named by its file, layers, experts and type) and backend (the device, or the "
        "simulator and its profile, in the title), one line per slot setting and host memory mode, with that "
        "model's compute-only and transfer-floor rates; a rate far above the rows is marked at the top with its "
        "value written, so the rows keep the panel's height. TRACE.json (from `prefill --trace`): the copy and "
        "compute streams per device and the host threads on one time axis, copies, kernels and waits in "
        "distinct colours, each span at least a pixel wide, the backend in the title. Needs matplotlib: "
        f"{INSTALL_HINT}.",
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
            _timeline(fig, doc["traceEvents"], doc.get("otherData") or {})
        elif isinstance(doc, dict) and ("rows" in doc or "runs" in doc):
            _results(fig, doc.get("runs", [doc]))
        else:
            raise UsageError(f"{source}: neither prefill results (rows) nor a trace (traceEvents)")
        fig.savefig(output, dpi=DPI)
    finally:
        plt.close(fig)
    print(f"wrote {output}")
    return 0


# A reference rate above this many times the fastest row would squash the rows into the bottom of
# the panel: it is marked at the top edge with its value written instead.
REFERENCE_IN_SCALE = 2.0
HEADROOM = 1.15
TITLE_CHARS = 120  # of a panel title across the whole figure, before it wraps


def _model_label(model: dict[str, Any]) -> str:
    """The model as a person tells models apart: its file's name, then layers, experts and type."""
    name = Path(str(model.get("path", "?"))).stem
    nbytes = model.get("expert_bytes")
    size = "" if nbytes is None else f", {nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f", {nbytes / 1e6:.1f} MB"
    return (
        f"{name}: {model.get('arch', '?')}, {model.get('n_layer', '?')} layers, {model.get('n_expert', '?')} experts, "
        f"{model.get('expert_type', '?')}{size}{' of experts' if size else ''}"
    )


def backend_label(header: dict[str, Any]) -> str:
    """Where the numbers come from: the simulator with its profile, or the device and its backend."""
    if header.get("backend") is None:
        return "backend not recorded"
    if header["backend"] == "sim":
        what = "virtual time, no data" if header.get("timing_only") else "virtual time, with data"
        return f"simulated {header.get('device')} (profile {header.get('profile')}; {what})"
    return f"{header.get('device')} ({header['backend']})"


def _results(fig: Any, runs: list[dict[str, Any]]) -> None:
    """One panel per model and backend, each with its own rows and reference rates."""
    panels: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        panels[(_model_label(run.get("model", {})), backend_label(run))].extend(run.get("rows", []))
    panels = {key: rows for key, rows in panels.items() if rows}
    if not panels:
        raise UsageError("the results hold no rows")
    backends = {backend for _, backend in panels}
    common = backends.pop() if len(backends) == 1 else None
    columns = min(len(panels), 3)
    for index, ((model, backend), rows) in enumerate(panels.items()):
        ax = fig.add_subplot(-(-len(panels) // columns), columns, index + 1)
        _panel(ax, rows)
        title = textwrap.fill(model, TITLE_CHARS // columns) + ("" if common else "\n" + backend)
        ax.set_title(title, fontsize="medium")
    fig.suptitle("prefill throughput" + (f": {common}" if common else ""))
    fig.tight_layout()


def _panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    lines: dict[tuple[int, int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        lines[(row["tokens"], row["slots"], row["host_memory"])].append(row)
    prompts = sorted({tokens for tokens, _, _ in lines})
    for (tokens, slots, mode), points in sorted(lines.items()):
        points.sort(key=lambda r: r["ubatch"])
        ax.errorbar(
            [r["ubatch"] for r in points],
            [r["prefill_tokens_per_s"] for r in points],
            yerr=[r.get("prefill_tokens_per_s_sd", 0.0) for r in points],
            marker="o",
            capsize=3,
            label=f"slots {slots}, {mode}" + (f", p={tokens}" if len(prompts) > 1 else ""),
        )
    fastest = max(r["prefill_tokens_per_s"] for r in rows)
    references = [
        ("compute_only_tokens_per_s", "compute only (experts on the device)", "k", "--"),
        ("transfer_floor_tokens_per_s", "transfer floor (expert bytes at H2D peak)", "r", ":"),
    ]
    in_scale = [
        float(r[key]) for key, *_ in references for r in rows if r.get(key) and r[key] <= REFERENCE_IN_SCALE * fastest
    ]
    top = HEADROOM * max([fastest, *in_scale])
    for tokens in prompts:
        for key, label, colour, style in references:
            suffix = f", p={tokens}" if len(prompts) > 1 else ""
            _reference(ax, [r for r in rows if r["tokens"] == tokens], key, label + suffix, top, colour, style)
    ax.set_ylim(0, top)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ubatch (tokens)")
    ax.set_ylabel("prefill tokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _reference(ax: Any, rows: list[dict[str, Any]], key: str, label: str, top: float, *style: str) -> None:
    """One rate per ubatch from the rows that carry it (the best row's, where several do); a rate above
    ``top`` is a marker at the top edge with its value beside it, so the rows keep the panel."""
    best: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if value is not None:
            best[row["ubatch"]] = max(best.get(row["ubatch"], 0.0), float(value))
    inside = sorted(u for u, value in best.items() if value <= top)
    above = sorted(u for u, value in best.items() if value > top)
    colour, linestyle = style
    if inside:
        ax.plot(inside, [best[u] for u in inside], color=colour, linestyle=linestyle, marker="x", label=label)
    if above:
        ax.plot(
            above,
            [top] * len(above),
            color=colour,
            linestyle="none",
            marker="^",
            clip_on=False,
            label=None if inside else f"{label}: off scale, value written",
        )
        for ubatch in above:
            ax.annotate(
                f"{best[ubatch]:,.0f} t/s",
                (ubatch, top),
                xytext=(0, -12),
                textcoords="offset points",
                ha="center",
                fontsize="small",
                color=colour,
            )


def _timeline(fig: Any, events: list[dict[str, Any]], header: dict[str, Any]) -> None:
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
    end = max(e["ts"] + max(e["dur"], 0.0) for rows in spans.values() for e in rows)
    ax = fig.add_subplot(1, 1, 1)
    # Kernels of a small model take well under a pixel of a whole run: each span is drawn at
    # least one pixel wide, or most of them would not show at all.
    pixel_ms = (end - origin) / 1e3 / max(ax.get_position().width * fig.get_figwidth() * fig.dpi, 1.0)
    seen: set[str] = set()
    for y, track in enumerate(tracks):
        by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for event in spans[track]:
            by_kind[event.get("cat", "")].append(
                ((event["ts"] - origin) / 1e3, max(max(event["dur"], 0.0) / 1e3, pixel_ms))
            )
        for kind, bars in by_kind.items():
            colour = KIND_COLOURS.get(kind, "#bcbd22")
            ax.broken_barh(
                bars,
                (y - 0.4, 0.8),
                facecolors=colour,
                label=None if kind in seen else kind,
                zorder=DRAW_ORDER.get(kind, 1),
            )
            seen.add(kind)
    ax.set_xlim(0, (end - origin) / 1e3)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"{processes.get(p, p)}: {threads.get((p, t), t)}" for p, t in tracks], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(f"time (ms); spans shorter than a pixel ({pixel_ms * 1e3:.2g} us) are drawn a pixel wide")
    where = backend_label(header) if header else "the trace does not say which backend ran it"
    model = f"\n{_model_label(header['model'])}" if "model" in header else ""
    ax.set_title(f"copies, kernels and waits per stream: {where}{model}", fontsize="medium")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
