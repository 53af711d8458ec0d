"""Streaming a model's expert tensors to the device from each host memory mode.

For each mode (and each ring geometry asked for) the model's tensors are placed with
HostWeights, then every expert tensor is copied in turn into one device buffer on one
stream, as a layer-by-layer prefetch would. Each pass first tells the sources the order of
its copies, as the scheduler does for a run (``--ring-lookahead off`` leaves that out: the
ring then drains at every tensor). ``gb_per_s`` is all those bytes over the time from the
first enqueue to the stream being done (the median of ``--repeats`` passes); ``open_ms`` is
placing the weights (registration, or the pinned copy). The model is written with make-model
into a temporary directory unless ``--model`` names a GGUF file.

    python -m microbench.hostmem_modes --backend cuda --preset qwen3-30b-a3b --layers 8 \\
        --ring-threads 1 4 8 12 --ring-lookahead on off
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from expertstream.backends.base import Backend, Device, DeviceBuffer, Stream
from expertstream.hostmem import HostMemoryMode, HostWeights, RingFill, RingOptions
from expertstream.model import MoeModel
from expertstream.scheduler.source import expect_copies

from ._common import MIB, Column, emit, environment, median, model_arguments, model_file, open_backend
from ._common import parser as common_parser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    requested: str
    mode: str
    bytes: int
    gb_per_s: float
    pass_ms: float
    open_ms: float
    pinned_mib: float
    note: str = ""
    # The staging ring's, in mode ring
    ring_threads: int | None = None
    ring_lookahead: bool | None = None
    ring_fill: str | None = None  # who filled its chunks: processes or threads
    ring_chunks: int | None = None
    ring_chunk_mib: float | None = None


def stream_experts(be: Backend, weights: HostWeights, stream: Stream, dst: DeviceBuffer, lookahead: bool) -> float:
    """Seconds to copy every expert tensor once, from the first enqueue until the stream is done."""
    tensors = weights.model.expert_tensors
    start = be.host.timestamp()
    if lookahead:
        expect_copies(weights[tensor.name] for tensor in tensors)
    for tensor in tensors:
        weights[tensor.name].enqueue_h2d(stream, dst, 0, 0, tensor.nbytes)
    stream.synchronize()
    return be.host.timestamp() - start


def measure(
    be: Backend,
    device: Device,
    model: MoeModel,
    args: argparse.Namespace,
    mode: HostMemoryMode,
    threads: int | None,
    lookahead: bool,
) -> Row:
    ring = RingOptions(
        fill=args.ring_fill,
        threads=threads,
        chunks=args.ring_chunks,
        chunk_bytes=None if args.ring_chunk_mib is None else args.ring_chunk_mib * MIB,
    )
    total = sum(t.nbytes for t in model.expert_tensors)
    largest = max(t.nbytes for t in model.expert_tensors)
    opened = be.host.timestamp()
    with HostWeights.open(model, device, mode, ring=ring) as weights:
        open_ms = (be.host.timestamp() - opened) * 1e3
        with device.stream() as stream, device.alloc(largest) as dst:
            stream_experts(be, weights, stream, dst, lookahead)  # warm-up: page faults, first-use costs
            seconds = median([stream_experts(be, weights, stream, dst, lookahead) for _ in range(args.repeats)])
        used = weights.mode
        note = "; ".join(f"fell back: {f.reason}" for f in weights.stats.fallbacks)
        pinned = weights.stats.pinned_bytes
        row = Row(mode.value, used.value, total, total / seconds / 1e9, seconds * 1e3, open_ms, pinned / MIB, note)
        if weights.rings:
            ring_used = weights.rings[0]
            row = replace(
                row,
                ring_threads=ring_used.threads,
                ring_lookahead=lookahead,
                ring_fill=ring_used.fill.value,
                ring_chunks=ring_used.chunks,
                ring_chunk_mib=ring_used.chunk_bytes / MIB,
            )
    return row


def run(be: Backend, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    device = be.device(args.device)
    rows = []
    with MoeModel.open(path) as model:
        for name in args.modes:
            mode = HostMemoryMode(name)
            is_ring = mode is HostMemoryMode.RING
            for threads in args.ring_threads if is_ring else [None]:
                for lookahead in args.ring_lookahead if is_ring else ["on"]:
                    row = measure(be, device, model, args, mode, threads, lookahead == "on")
                    log.info("%s", row)
                    rows.append(asdict(row))
        shape = repr(model)
    return {**environment(be, device), "model": shape, "repeats": args.repeats, "rows": rows}


COLUMNS = (
    Column("requested", "requested"),
    Column("mode", "used"),
    Column("ring_threads", "threads"),
    Column("ring_lookahead", "lookahead"),
    Column("ring_fill", "fill"),
    Column("ring_chunks", "chunks"),
    Column("ring_chunk_mib", "chunk MiB", "{:g}"),
    Column("bytes", "bytes"),
    Column("gb_per_s", "GB/s", "{:.1f}"),
    Column("pass_ms", "pass ms", "{:.1f}"),
    Column("open_ms", "open ms", "{:.1f}"),
    Column("pinned_mib", "pinned MiB", "{:g}"),
    Column("note", ""),
)


def main(argv: list[str] | None = None) -> int:
    p = common_parser("hostmem_modes", "Expert-tensor streaming bandwidth from each host memory mode.")
    model_arguments(p, layers=8)
    p.add_argument(
        "--modes",
        nargs="+",
        default=[m.value for m in HostMemoryMode if m is not HostMemoryMode.PREFERRED],
        choices=[m.value for m in HostMemoryMode],
    )
    p.add_argument("--ring-threads", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument(
        "--ring-lookahead",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="tell the ring the order of the copies (on, as the scheduler does) or not (off)",
    )
    p.add_argument(
        "--ring-chunk-mib",
        "--ring-chunk-mb",  # the spelling of older results' commands
        dest="ring_chunk_mib",
        type=int,
        default=None,
        help="MiB per staging chunk, as prefill's --ring-chunk-mib (default: what suits the ring's workers)",
    )
    p.add_argument("--ring-chunks", type=int, default=None, help="as prefill's --ring-chunks")
    p.add_argument("--ring-fill", default="auto", choices=[f.value for f in RingFill], help="as prefill's --ring-fill")
    p.add_argument("--repeats", type=int, default=3, help="passes per row; the median is reported")
    args = p.parse_args(argv)
    with model_file(args, "hostmem-modes") as path, open_backend(args) as be:
        result = run(be, args, path)
    emit(args, result, COLUMNS, "expert streaming by host memory mode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
