"""Rows of a prefill run (one per setting), their table, CSV, JSON and the hash check."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Row:
    """What one setting did. Times come from backend.host.timestamp (virtual on the simulator).

    Times and rates are the median of ``repetitions`` timed runs after a warm-up; ``*_sd`` is
    their sample standard deviation (0 for one repetition).
    """

    slots: int
    host_memory: str  # the mode used, after any fallback
    tokens: int
    ubatch: int
    ttft_s: float  # wall time of the whole prefill plan
    prefill_tokens_per_s: float
    h2d_bytes: int  # expert bytes copied during one prefill (lookahead and stock)
    h2d_gbps: float
    h2d_pct_of_peak: float  # of the pinned H2D peak measured in the same run
    transfer_only_s: float  # h2d_bytes at the measured peak: the floor a transfer-bound prefill cannot beat
    # The same plan with every expert tensor device-resident; None where not measured (and the two below).
    compute_only_s: float | None
    overlap_efficiency: float | None  # max(transfer_only_s, compute_only_s) / ttft_s: 1.0 is perfect overlap
    over_compute_ms: float | None  # ttft minus compute only: what streaming added to the prefill
    slot_wait_ms: float | None  # slots > 0: the compute stream's waits on slot-ready events; None for 0
    fires: int
    fallbacks: dict[str, int]
    prefill_sha256: str
    repetitions: int = 1
    ttft_sd_s: float = 0.0
    prefill_tokens_per_s_sd: float = 0.0
    layers_streamed: int = 0  # MoE layers whose experts stream from host memory (llama.cpp's n_cpu_moe)
    bytes_per_ubatch: int = 0  # expert bytes copied per ubatch
    h2d_peak_gbps: float = 0.0
    batch: int | None = None  # llama.cpp's logical batch (-b), when given
    decode_steps: int = 0
    decode_tokens_per_s: float | None = None  # tokens over the time all steps took (mean of the runs, as llama-bench)
    decode_tokens_per_s_sd: float | None = None
    decode_median_step_ms: float | None = None  # the median step (median of the runs' medians)
    decode_bytes: int = 0  # expert bytes one repetition of the decode steps copied (used experts only)
    decode_lookahead: int = 0  # experts per streamed layer copied ahead on a prediction (0: none were)
    decode_lookahead_bytes: int = 0  # their bytes in one repetition, at most (used or not)
    decode_path: str | None = None  # "graph": one captured step replayed; "calls": each step's calls issued
    prefill_path: str | None = None  # "graph": one captured ubatch replayed per full ubatch; "calls": calls issued
    decode_sha256: str | None = None
    output_sha256: str = ""  # prefill and decode outputs together; empty when the backend holds no data
    nonfinite: int = 0  # NaN or infinite output values: a wrong byte read somewhere
    layers_resident: int = 0  # MoE layers whose experts were uploaded once and stay on the device
    streamed_bytes_per_ubatch: int = 0  # expert bytes the streamed layers hold: what one ubatch must copy
    devices: int = 1  # devices the layers are split over
    crossing: str = ""  # how the hidden state crosses between them: "peer" or "host" per boundary
    predicted_ttft_s: float | None = None  # the simulator's prediction with a tuned profile (prefill --predict)
    predicted_decode_tokens_per_s: float | None = None
    # Host memory ring only, over the timed prefills: the share of its threads' time spent copying
    # into chunks and waiting for a chunk's DMA to end, and one thread's rate while copying.
    ring_threads: int | None = None
    ring_fill: str | None = None  # who filled the ring's chunks: processes or threads
    ring_copy_pct: float | None = None
    ring_chunk_wait_pct: float | None = None
    ring_thread_gbps: float | None = None
    # Host memory disk only, per timed prefill: the expert bytes its RAM tier (the host cache) served,
    # the bytes read from the drive (each read rounded out to the drive's alignment), those read out of
    # the page cache instead (ranges the kernel held already), and the share of the copied bytes the
    # RAM tier served (0 without a host cache).
    host_cache_bytes: int | None = None
    disk_bytes_read: int | None = None
    page_cache_bytes: int | None = None
    host_cache_hit_pct: float | None = None
    # The same share over the decode steps' used experts, per repetition.
    decode_host_cache_hit_pct: float | None = None
    # The offload setting of the row, where the command line gave one (None otherwise, and left out
    # of JSON and CSV): -ncmoe's layer count or "all", or --gpu-memory's size ("24G") or "auto".
    n_cpu_moe: int | str | None = None
    gpu_memory: str | None = None
    host_cache: str | None = None  # --host-cache's size ("24G"), where given
    # What ran: "whole" (the model end to end) or "experts" (the expert blocks alone, --experts-only),
    # in which prefill order, and the device memory it held besides the prefetch slots.
    work: str = "whole"
    prefill_order: str = "ubatch"
    device_bytes: int = 0  # weights but the streamed experts, KV cache, activations, resident experts
    kv_cache_bytes: int = 0
    # Device memory by kind (engine.uploads.DeviceMemory: weights, kv_cache, activations,
    # resident_experts, staging: the most the prompt or the steps held at once, total) and what the
    # devices' free memory fell by from before the runner to the end of the row, as the driver counts
    # it (the kernels' code, its own pools; by then decode has freed the prompt's slots).
    device_memory: dict[str, int] = field(default_factory=dict)
    device_used_bytes: int | None = None

    @property
    def decode_step_s(self) -> float | None:
        """The median decode step in seconds: what predictions and fits of one step are held to."""
        return None if self.decode_median_step_ms is None else self.decode_median_step_ms / 1e3

    @property
    def label(self) -> str:
        return f"slots={self.slots}/{self.host_memory}"

    @property
    def transfer_floor_tokens_per_s(self) -> float | None:
        """The prefill rate if copies at the H2D peak were all that took time (None: nothing copied)."""
        return self.tokens / self.transfer_only_s if self.transfer_only_s else None

    @property
    def compute_only_tokens_per_s(self) -> float | None:
        """The prefill rate with every expert already on the device."""
        return self.tokens / self.compute_only_s if self.compute_only_s else None

    @property
    def decode_link_limit_tokens_per_s(self) -> float | None:
        """The decode rate if each step's expert copies at the H2D peak were all that took time: the
        link's limit (None where the steps copied nothing, or over several devices, whose links the one
        peak measured does not add up)."""
        if not (self.decode_bytes and self.decode_steps and self.h2d_peak_gbps) or self.devices > 1:
            return None
        return self.h2d_peak_gbps * 1e9 * self.decode_steps / self.decode_bytes

    @property
    def decode_link_pct(self) -> float | None:
        """The decode rate as a percent of the link's limit."""
        limit = self.decode_link_limit_tokens_per_s
        return None if limit is None or self.decode_tokens_per_s is None else 100.0 * self.decode_tokens_per_s / limit


COLUMNS_HELP = """\
columns (times and rates are the median of -r repetitions after a warm-up, decode t/s their mean as
llama-bench's; +- is the sample sd):
  slots          prefetch slots: 0 is the stock path (each expert tensor copied right before the
                 split that reads it); N >= 2 copies split i+N-1 while split i computes
  host           host memory the weights were copied from (after any fallback)
  ttft s         time to first token: the whole prefill
  prefill t/s    prompt tokens per second (the median of each repetition's rate)
  H2D GB/s       expert bytes copied per second of prefill; % peak: of the pinned H2D peak (the
                 median of a probe's few copies; their range is in the summary and the JSON)
  overlap        max(transfer only, compute only) / ttft, where transfer only is the expert bytes
                 at the H2D peak and compute only is the same prefill with every expert already on
                 the device; 1.00 means copies are fully hidden behind compute (or vice versa)
  +compute ms    ttft minus compute only: the time streaming added
  slot wait ms   slots > 0: how long the compute stream waited for slots to be filled ("-" for 0)
  p, ub          prompt tokens and tokens per ubatch
  ncmoe, gpu mem the -ncmoe or --gpu-memory setting of the row, when one is given
  streamed       MoE layers streamed from host memory / all MoE layers, and expert bytes copied per ubatch
  work           what ran: whole (the model end to end) or experts (the expert blocks alone around a
                 weightless stand-in, --experts-only); /L where the prefill ran layer-major
  decode t/s     decode tokens over the time all the steps took, the mean of the repetitions' rates
                 ("-" without -n); the JSON adds the
                 median step (decode_median_step_ms), which predictions and tune are held to, and,
                 where the steps copy experts, the link's limit (decode_link_limit_tokens_per_s: the
                 steps' expert bytes at the H2D peak) and the rate's share of it (decode_link_pct)
  output sha256  hash of the outputs; every row must agree (exit status 1 if not); the whole
                 model's rows agree within one ubatch size (attention sums its keys by tiles)
  pred s, err    with --predict: the predicted ttft and (measured / predicted - 1); pred t/s: decode
  ring copy/wait host memory ring: % of its threads' time spent copying from the mapping into its
                 pinned chunks / waiting for a chunk's DMA to end; copying near 100 means the host's
                 copy rate bounds the ring, long waits that the copies to the device hold it back"""


def mismatched(rows: Sequence[Row]) -> list[str]:
    """Labels of the rows whose output hash differs from the first row's (empty when all agree)."""
    if not rows:
        return []
    reference = rows[0].output_sha256
    differing = [r for r in rows if r.output_sha256 != reference]
    return [rows[0].label, *(r.label for r in differing)] if differing else []


# Figures derived from a row's fields, in its JSON and CSV beside them.
DERIVED_FIELDS = (
    "transfer_floor_tokens_per_s",
    "compute_only_tokens_per_s",
    "decode_link_limit_tokens_per_s",
    "decode_link_pct",
)

# Fields a row carries only when the command line set them.
OPTIONAL_FIELDS = ("n_cpu_moe", "gpu_memory", "host_cache")


def row_json(row: Row) -> dict[str, Any]:
    values = {
        **asdict(row),
        **{name: getattr(row, name) for name in DERIVED_FIELDS},
    }
    for name in OPTIONAL_FIELDS:
        if values[name] is None:
            del values[name]
    return values


def as_json(header: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    return {**header, "rows": [row_json(r) for r in rows]}


def jsonl_line(header: dict[str, Any], row: Row) -> str:
    """One row as llama-bench's jsonl has it: a JSON object carrying the run's header."""
    return json.dumps({**header, **row_json(row)})


def csv_fields(rows: Sequence[Row]) -> list[str]:
    """The CSV columns of ``rows``: every field, the optional ones where some row has them."""
    names = [f.name for f in fields(Row)] + list(DERIVED_FIELDS)
    absent = {name for name in OPTIONAL_FIELDS if all(getattr(r, name) is None for r in rows)}
    return [name for name in names if name not in absent]


def csv_lines(rows: Sequence[Row], names: Sequence[str], header: bool = True) -> str:
    """``rows`` as CSV lines of the columns ``names`` (with the header line first if ``header``)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, names, lineterminator="\n", extrasaction="ignore")
    if header:
        writer.writeheader()
    for row in rows:
        values = row_json(row)
        for nested in ("fallbacks", "device_memory"):
            values[nested] = json.dumps(values[nested], sort_keys=True)
        writer.writerow(values)
    return out.getvalue().rstrip("\n")


def _streamed(row: Row) -> str:
    layers = f"{row.layers_streamed}/{row.layers_streamed + row.layers_resident}L"
    return f"{layers}/{row.bytes_per_ubatch / 1e6:.1f}MB"


def _decode_rate(row: Row, sd: bool) -> str:
    value = row.decode_tokens_per_s_sd if sd else row.decode_tokens_per_s
    return "-" if value is None else f"{value:.1f}"


Column = tuple[str, int, Callable[[Row], str]]

_COLUMNS: tuple[Column, ...] = (
    ("slots", 5, lambda r: str(r.slots)),
    ("host", 10, lambda r: r.host_memory),
    ("ttft s", 9, lambda r: f"{r.ttft_s:.4f}"),
    ("+-", 7, lambda r: f"{r.ttft_sd_s:.4f}"),
    ("prefill t/s", 11, lambda r: f"{r.prefill_tokens_per_s:.0f}"),
    ("+-", 6, lambda r: f"{r.prefill_tokens_per_s_sd:.0f}"),
    ("H2D GB/s", 8, lambda r: f"{r.h2d_gbps:.1f}"),
    ("% peak", 6, lambda r: f"{r.h2d_pct_of_peak:.0f}"),
    ("overlap", 7, lambda r: "-" if r.overlap_efficiency is None else f"{r.overlap_efficiency:.2f}"),
    ("+compute ms", 11, lambda r: "-" if r.over_compute_ms is None else f"{r.over_compute_ms:.1f}"),
    ("slot wait ms", 12, lambda r: "-" if r.slot_wait_ms is None else f"{r.slot_wait_ms:.1f}"),
    ("p", 6, lambda r: str(r.tokens)),
    ("ub", 5, lambda r: str(r.ubatch)),
    ("streamed", 12, _streamed),
    ("work", 8, lambda r: r.work if r.prefill_order == "ubatch" else f"{r.work}/L"),
    ("decode t/s", 10, lambda r: _decode_rate(r, False)),
    ("+-", 5, lambda r: _decode_rate(r, True)),
    ("output sha256", 16, lambda r: r.output_sha256[:16] or "(no data)"),
)


def _error(measured: float | None, predicted: float | None) -> str:
    return "-" if measured is None or not predicted else f"{measured / predicted - 1:+.1%}"


_PREDICTED: tuple[Column, ...] = (
    ("pred s", 9, lambda r: "-" if r.predicted_ttft_s is None else f"{r.predicted_ttft_s:.4f}"),
    ("err", 6, lambda r: _error(r.ttft_s, r.predicted_ttft_s)),
    (
        "pred t/s",
        8,
        lambda r: "-" if r.predicted_decode_tokens_per_s is None else f"{r.predicted_decode_tokens_per_s:.1f}",
    ),
)


def _ring_share(row: Row) -> str:
    if row.ring_copy_pct is None or row.ring_chunk_wait_pct is None:
        return "-"
    return f"{row.ring_copy_pct:.0f}/{row.ring_chunk_wait_pct:.0f}"


_RING: tuple[Column, ...] = (("ring copy/wait", 14, _ring_share),)
_N_CPU_MOE: tuple[Column, ...] = (("ncmoe", 5, lambda r: "-" if r.n_cpu_moe is None else str(r.n_cpu_moe)),)
_GPU_MEMORY: tuple[Column, ...] = (("gpu mem", 7, lambda r: r.gpu_memory or "-"),)
_BEFORE_STREAMED = [name for name, _, _ in _COLUMNS].index("streamed")


def table_columns(rows: Sequence[Row]) -> tuple[Column, ...]:
    """Every column; the predicted ones only when some row has a prediction, the ring's only with a
    ring, the offload settings only where given. A run printing rows as they come decides them from
    its first rows: the settings that add columns are the same in every group of its rows."""
    predicted = any(r.predicted_ttft_s is not None for r in rows)
    ring = any(r.ring_copy_pct is not None for r in rows)
    n_cpu_moe = any(r.n_cpu_moe is not None for r in rows)
    gpu_memory = any(r.gpu_memory is not None for r in rows)
    return (
        _COLUMNS[:_BEFORE_STREAMED]
        + (_N_CPU_MOE if n_cpu_moe else ())
        + (_GPU_MEMORY if gpu_memory else ())
        + _COLUMNS[_BEFORE_STREAMED:-1]
        + (_PREDICTED if predicted else ())
        + (_RING if ring else ())
        + _COLUMNS[-1:]
    )


# A ring whose threads copy at least this share of the time is bound by the host's copy rate; one
# whose threads wait at least this share for chunk DMAs is held back by the copies to the device.
RING_COPY_BOUND_PCT = 60.0
RING_WAIT_BOUND_PCT = 50.0
RING_IDLE_BELOW_PCT = 50.0  # copying and waiting together below this: the threads mostly idle


def ring_note(rows: Sequence[Row]) -> str | None:
    """One line on where the staging ring's threads spent their time, over its rows (None without a ring);
    rows of mode disk, whose ring reads the drive, have ``disk_note``."""
    rows = [r for r in rows if r.host_memory != "disk"]
    shares = [(c, w) for r in rows if (c := r.ring_copy_pct) is not None and (w := r.ring_chunk_wait_pct) is not None]
    if not shares:
        return None
    copy, wait = [share[0] for share in shares], [share[1] for share in shares]
    rates = [rate for r in rows if (rate := r.ring_thread_gbps) is not None]
    threads, fill = next((r.ring_threads, r.ring_fill) for r in rows if r.ring_threads is not None)
    worker = "process" if fill == "processes" else "thread"
    workers = "fill processes" if fill == "processes" else "threads"
    waiting = "its caller waiting for chunk DMAs" if fill == "processes" else "waiting for chunk DMAs"
    line = (
        f"staging ring ({threads} {workers}): copying {_span(copy, '.0f')}% of the time, {waiting} "
        f"{_span(wait, '.0f')}%"
    )
    if rates:
        line += f", {_span(rates, '.1f')} GB/s per {worker} while copying"
    reached = [r.h2d_pct_of_peak for r in rows if r.ring_copy_pct is not None]
    reach = f"; its rows reached {_span(reached, '.0f')}% of the pinned peak"
    if max(copy) >= RING_COPY_BOUND_PCT:
        # How fast the host copies from the page cache differs from machine to machine (the H200
        # hosts of docs/results/hostmem-h200.md gave 44-74% of the peak at slots 3): say so here.
        return (
            line + f": the host's copy from the mapping bounds it; more slots will not help{reach}, what this "
            "host's copies allow (where the device can page-lock the file, --host-memory registered streams "
            "at the link's rate)"
        )
    if min(wait) >= RING_WAIT_BOUND_PCT:
        return line + f": the copies to the device hold it back, not its threads{reach}"
    if max(sum(share) for share in shares) < RING_IDLE_BELOW_PCT:
        return line + f": its {workers} are mostly idle, so the ring is not what bounds the run{reach}"
    return line + reach


def disk_note(rows: Sequence[Row]) -> str | None:
    """One line on where the threads reading the model's file (mode disk) spent their time (None without such rows)."""
    rows = [r for r in rows if r.host_memory == "disk" and r.ring_copy_pct is not None]
    if not rows:
        return None
    reading = [r.ring_copy_pct or 0.0 for r in rows]
    wait = [r.ring_chunk_wait_pct or 0.0 for r in rows]
    rates = _span([r.h2d_gbps for r in rows], ".1f")
    line = (
        f"reads from the drive ({rows[0].ring_threads} threads): reading {_span(reading, '.0f')}% of the time, "
        f"waiting for chunk DMAs {_span(wait, '.0f')}%; its rows reached {rates} GB/s"
    )
    line += _host_cache_part(rows)
    if max(reading) >= RING_COPY_BOUND_PCT:
        return line + ": the drive bounds it; more slots will not help (a faster drive or more RAM would)"
    if min(wait) >= RING_WAIT_BOUND_PCT:
        return line + ": the copies to the device hold it back, not the drive"
    return line


def _host_cache_part(rows: Sequence[Row]) -> str:
    """What the RAM tier served and what was read from the drive per prefill, where a host cache served
    any; what the page cache held, where it held any; then the share of the used experts' bytes decode
    found in RAM, where it found any."""
    part = ""
    served = [r for r in rows if r.host_cache_bytes and r.host_cache_hit_pct is not None]
    if served:
        hits = _span([r.host_cache_hit_pct or 0.0 for r in served], ".0f")
        ram = _span([(r.host_cache_bytes or 0) / 1e6 for r in served], ".1f")
        drive = _span([(r.disk_bytes_read or 0) / 1e6 for r in served], ".1f")
        setting = f" ({served[0].host_cache})" if served[0].host_cache else ""
        part = f"; the host cache{setting} served {hits}% of the expert bytes ({ram} MB per prefill), {drive} MB read"
    cached = [r.page_cache_bytes / 1e6 for r in rows if r.page_cache_bytes]
    if cached:
        part += f"; {_span(cached, '.1f')} MB per prefill found in the page cache (not read from the drive)"
    decoded = [r.decode_host_cache_hit_pct for r in rows if r.decode_host_cache_hit_pct]
    if decoded:
        part += f"; decode found {_span(decoded, '.0f')}% of its experts' bytes in RAM"
    return part


def _span(values: Sequence[float], fmt: str) -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def table_header(columns: Sequence[Column]) -> str:
    return "  ".join(f"{name:>{width}}" for name, width, _ in columns)


def table_line(row: Row, columns: Sequence[Column]) -> str:
    """One row of aligned columns, no spaces inside a cell."""
    return "  ".join(f"{cell(row):>{width}}" for _, width, cell in columns)


def format_table(rows: Sequence[Row]) -> str:
    """Aligned columns, one line per row, no spaces inside a cell."""
    columns = table_columns(rows)
    return "\n".join([table_header(columns), *(table_line(row, columns) for row in rows)])


def markdown_header(columns: Sequence[Column]) -> str:
    return "| " + " | ".join(name for name, _, _ in columns) + " |\n|" + "|".join("---:" for _ in columns) + "|"


def markdown_line(row: Row, columns: Sequence[Column]) -> str:
    return "| " + " | ".join(cell(row) for _, _, cell in columns) + " |"
