"""What bounds the staging ring (host memory mode ``ring``), measured three ways.

- ``copy``: host threads copying from the model file's mapping (memcpy) or reading the file (pread)
  into pinned buffers, with no DMA: the host's own ceiling per thread count and part size (this
  machine's, whatever the backend).
- ``prefill``: the prefill rows ``expertstream prefill --host-memory ring`` reports, for each ring
  geometry asked (``--geometry CHUNKSxCHUNK_MIB/PART_MIB``) and thread count. The settings take
  turns over ``--repeats`` rounds, so that a drift of the host shows in every setting alike; the
  median of the rounds is reported. Per row: GB/s and % of the pinned peak; the share of the ring
  threads' time spent copying and waiting for a chunk's DMA; one thread's copy rate; and the host
  CPU time of the ring's copies over their wall time (near 1: the copying itself is slow, not
  waiting for the interpreter lock or a core), the kernel's share of the process's CPU time and its
  minor page faults (first touches of any page: the mapping's, new allocations') per GB the ring
  filled, each
  counted over the whole measurement of that geometry and ubatch (warm-ups and every slot count),
  so the same for its rows.
- ``decode``: a decode step's copies of the experts it uses (``--experts`` of each tensor, spread
  out): all of a tensor's ranges through the ring at once (``StagingRing.copy_ranges``, what the
  scheduler does) against one ``copy`` per range.

    python -m microbench.ring_limits --backend cuda --layers 16 --parts copy prefill decode \\
        --geometry 8x32/8 4x64/4 --ubatch 512 2048 --slots 0 2 3 --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from expertstream.backends.base import Backend, Device, HostBuffer
from expertstream.hostmem import HostMemoryMode, HostWeights, RingRegion
from expertstream.model import MoeModel
from expertstream.moe.measure import Settings, measure
from expertstream.moe.runner import Batching

from ._common import MIB, Column, emit, environment, median, model_arguments, model_file, open_backend
from ._common import parser as common_parser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Geometry:
    chunks: int
    chunk_mib: int
    part_mib: int

    @classmethod
    def parse(cls, text: str) -> Geometry:
        try:
            shape, part = text.split("/")
            chunks, chunk = shape.lower().split("x")
            return cls(int(chunks), int(chunk), int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected CHUNKSxCHUNK_MIB/PART_MIB, e.g. 8x32/8; got {text!r}") from None

    def __str__(self) -> str:
        return f"{self.chunks}x{self.chunk_mib}/{self.part_mib}"


# -- copy: the host alone ------------------------------------------------------------------------


def copy_rows(device: Device, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    size = path.stat().st_size
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    fd = os.open(path, os.O_RDONLY)
    chunks = [device.alloc_pinned(64 * MIB) for _ in range(4)]
    rows = []
    try:
        for part_mib, threads, method in itertools.product(args.part_mib, args.copy_threads, ("memcpy", "pread")):
            part = part_mib * MIB
            if size < 2 * part:
                log.warning("copy: %s is smaller than two parts of %d MiB; row skipped", path, part_mib)
                continue
            count = int(args.copy_gib * (1 << 30)) // part
            span = (size // part - 1) * part
            seconds = _copy_seconds(chunks, part, count, threads, _copier(method, mapping, fd, span, part))
            rows.append(
                {
                    "part": "copy",
                    "method": method,
                    "threads": threads,
                    "part_mib": part_mib,
                    "gb_per_s": count * part / seconds / 1e9,
                }
            )
            log.info("%s", rows[-1])
    finally:
        os.close(fd)
        for chunk in chunks:
            chunk.close()
    return rows


def _copier(method: str, mapping: np.ndarray, fd: int, span: int, part: int) -> Callable[[int, np.ndarray], None]:
    def memcpy(index: int, dst: np.ndarray) -> None:
        src = (index * part) % span
        np.copyto(dst, mapping[src : src + part])

    def pread(index: int, dst: np.ndarray) -> None:
        view, done = memoryview(dst.data), 0
        while done < part:
            got = os.preadv(fd, [view[done:]], (index * part) % span + done)
            if got <= 0:
                raise OSError(f"short read at byte {(index * part) % span + done}")
            done += got

    return memcpy if method == "memcpy" else pread


def _copy_seconds(
    chunks: list[HostBuffer], part: int, count: int, threads: int, copy: Callable[[int, np.ndarray], None]
) -> float:
    """Seconds for ``threads`` threads to copy ``count`` parts, each into the next place of the chunks."""
    per_chunk = chunks[0].nbytes // part
    counter = itertools.count()

    def work() -> None:
        while (index := next(counter)) < count:
            chunk = chunks[index % len(chunks)].array
            at = (index // len(chunks)) % per_chunk * part
            copy(index, chunk[at : at + part])

    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


# -- prefill: the ring inside the job ---------------------------------------------------------------


@contextmanager
def copy_cpu_time(device: Device) -> Iterator[dict[str, float]]:
    """Count the host CPU time, wall time and bytes of ``device.host_copy`` calls (the ring's fills),
    and the process's page faults and kernel-mode share of its CPU time over the block."""
    totals = {"cpu_s": 0.0, "wall_s": 0.0, "bytes": 0.0}
    lock = threading.Lock()
    original = device.host_copy

    def timed(*args: Any, **kwargs: Any) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        original(*args, **kwargs)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        with lock:
            totals["cpu_s"] += cpu
            totals["wall_s"] += wall
            totals["bytes"] += args[4] if len(args) > 4 else kwargs["nbytes"]

    had_own = "host_copy" in vars(device)
    device.host_copy = timed  # type: ignore[method-assign]
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        yield totals
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        totals["minor_faults"] = after.ru_minflt - before.ru_minflt
        totals["user_s"] = after.ru_utime - before.ru_utime
        totals["system_s"] = after.ru_stime - before.ru_stime
        if had_own:
            device.host_copy = original  # type: ignore[method-assign]
        else:
            del device.host_copy  # the class's method again


def prefill_rows(be: Backend, device: Device, model: MoeModel, args: argparse.Namespace) -> list[dict[str, Any]]:
    settings = [(g, t, ub) for ub in args.ubatch for g in args.geometry for t in args.ring_threads]
    found: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}
    peak = None
    for _ in range(args.repeats):
        for geometry, threads, ubatch in settings:
            setting = Settings(
                Batching(args.tokens, ubatch),
                tuple(args.slots),
                (HostMemoryMode.RING,),
                ring_threads=threads,
                ring_chunks=geometry.chunks,
                ring_chunk_bytes=geometry.chunk_mib * MIB,
                ring_part_bytes=geometry.part_mib * MIB,
            )
            with copy_cpu_time(device) as copies:
                result = measure(be, [device], model, setting, h2d_peak_gbps=peak)
            peak = result.baselines.h2d_peak_gbps
            cpu = copies["cpu_s"] / copies["wall_s"] if copies["wall_s"] else None
            process_s = copies["user_s"] + copies["system_s"]
            system = copies["system_s"] / process_s if process_s else None
            faults = copies["minor_faults"] / (copies["bytes"] / 1e9) if copies["bytes"] else None
            for row in result.rows:
                found.setdefault((str(geometry), threads, ubatch, row.slots), []).append(
                    {
                        "gb_per_s": row.h2d_gbps,
                        "pct_of_peak": row.h2d_pct_of_peak,
                        "copy_pct": row.ring_copy_pct,
                        "wait_pct": row.ring_chunk_wait_pct,
                        "thread_gb_per_s": row.ring_thread_gbps,
                        "copy_cpu_over_wall": cpu,
                        "system_share": system,
                        "faults_per_gb": faults,
                    }
                )
    rows = []
    for (geometry_text, threads, ubatch, slots), runs in found.items():
        rows.append(
            {
                "part": "prefill",
                "geometry": geometry_text,
                "threads": threads,
                "ubatch": ubatch,
                "slots": slots,
                "runs_gb_per_s": [round(r["gb_per_s"], 1) for r in runs],
                **{key: median([r[key] for r in runs if r[key] is not None] or [float("nan")]) for key in runs[0]},
            }
        )
    return rows


# -- decode: a step's experts ----------------------------------------------------------------------


def decode_rows(be: Backend, device: Device, model: MoeModel, args: argparse.Namespace) -> list[dict[str, Any]]:
    tensors = model.expert_tensors
    n_expert = model.n_expert
    chosen = np.linspace(0, n_expert - 1, args.experts).round().astype(int)
    rows = []
    with HostWeights.open(model, device, HostMemoryMode.RING) as weights, device.stream() as stream:
        largest = max(t.nbytes for t in tensors)
        with device.alloc(largest) as dst:
            for at_once in (True, False, True, False):
                start = be.host_timestamp()
                for tensor in tensors:
                    region = weights[tensor.name]
                    assert isinstance(region, RingRegion)
                    per = tensor.nbytes // n_expert
                    ranges = [(int(e) * per, (int(e) + 1) * per) for e in chosen]
                    if at_once:
                        region.enqueue_h2d_ranges(stream, dst, ranges)
                    else:
                        for begin, end in ranges:
                            region.enqueue_h2d(stream, dst, begin, begin, end - begin)
                stream.synchronize()
                seconds = be.host_timestamp() - start
                rows.append(
                    {
                        "part": "decode",
                        "method": "ranges at once" if at_once else "one copy per range",
                        "threads": weights.rings[0].threads,
                        "copies": len(tensors) * len(chosen),
                        "ms_per_step": seconds * 1e3,
                        "gb_per_s": len(tensors) * len(chosen) * (tensors[0].nbytes // n_expert) / seconds / 1e9,
                    }
                )
                log.info("%s", rows[-1])
    return rows[2:]  # the first round warms the ring's threads and maps the pages


def run(be: Backend, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    device = be.device(args.device)
    rows: list[dict[str, Any]] = []
    if "copy" in args.parts:
        rows += copy_rows(device, path, args)
    with MoeModel.open(path) as model:
        if "prefill" in args.parts:
            rows += prefill_rows(be, device, model, args)
        if "decode" in args.parts:
            rows += decode_rows(be, device, model, args)
    return {**environment(be, device), "model": str(path), "tokens": args.tokens, "rows": rows}


COLUMNS = (
    Column("part", "part"),
    Column("method", "method"),
    Column("geometry", "chunks/part"),
    Column("threads", "threads"),
    Column("part_mib", "part MiB"),
    Column("ubatch", "ub"),
    Column("slots", "slots"),
    Column("gb_per_s", "GB/s", "{:.1f}"),
    Column("pct_of_peak", "% peak", "{:.1f}"),
    Column("runs_gb_per_s", "runs"),
    Column("copy_pct", "copy %", "{:.0f}"),
    Column("wait_pct", "wait %", "{:.0f}"),
    Column("thread_gb_per_s", "GB/s/thread", "{:.2f}"),
    Column("copy_cpu_over_wall", "cpu/wall", "{:.2f}"),
    Column("system_share", "sys", "{:.2f}"),
    Column("faults_per_gb", "faults/GB", "{:.0f}"),
    Column("ms_per_step", "ms/step", "{:.1f}"),
)


def main(argv: list[str] | None = None) -> int:
    p = common_parser("ring_limits", "What bounds the staging ring: host copies, prefill rows, decode copies.")
    model_arguments(p, layers=16)
    p.add_argument("--parts", nargs="+", default=["copy", "prefill", "decode"], choices=["copy", "prefill", "decode"])
    p.add_argument("--copy-threads", type=int, nargs="+", default=[8, 12, 16])
    p.add_argument("--part-mib", type=int, nargs="+", default=[4, 16], help="copy: bytes each thread copies at once")
    p.add_argument("--copy-gib", type=float, default=8.0, help="copy: bytes copied per row")
    p.add_argument("--geometry", type=Geometry.parse, nargs="+", default=[Geometry(8, 32, 8)])
    p.add_argument("--ring-threads", type=int, nargs="+", default=[12])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ubatch", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--slots", type=int, nargs="+", default=[0, 2, 3])
    p.add_argument("--repeats", type=int, default=3, help="prefill: rounds over every setting; medians reported")
    p.add_argument("--experts", type=int, default=8, help="decode: experts copied of each tensor")
    args = p.parse_args(argv)
    with model_file(args, "ring-limits") as path, open_backend(args) as be:
        result = run(be, args, path)
    emit(args, result, COLUMNS, "what bounds the staging ring")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
