"""What bounds the staging ring (host memory mode ``ring``), measured three ways.

- ``copy``: host threads copying from the model file's mapping (memcpy) or reading the file (pread)
  into pinned buffers, with no DMA: the host's own ceiling per thread count and part size (this
  machine's, whatever the backend). Method ``h2d``: the same threads each hand the runtime pageable
  copies from the mapping straight to device memory on a stream of their own (the runtime stages
  them itself): whether its pageable path scales with threads. Method ``lanes``: each thread copies
  into two pinned chunks of its own and DMAs them to the device on a stream of its own, with no
  hand-off between threads: what host copies and DMAs reach together, with nothing to coordinate.
- ``prefill``: the prefill rows ``expertstream prefill --host-memory ring`` reports, for each ring
  geometry asked (``--geometry CHUNKSxCHUNK_MIB/PART_MIB``), worker count and fill. The settings take
  turns over ``--repeats`` rounds, so that a drift of the host shows in every setting alike; the
  median of the rounds is reported. Per row: GB/s and % of the pinned peak; the share of the ring
  workers' time spent copying and waiting for a chunk's DMA; one worker's copy rate; and, for fills
  by threads (fill processes copy outside this process), the host CPU time of the ring's copies over
  their wall time (near 1: the copying itself is slow, not waiting for the interpreter lock or a
  core), the kernel's share of the process's CPU time and its minor page faults (first touches of any
  page: the mapping's, new allocations') per GB the ring filled, each counted over the whole
  measurement of that setting (warm-ups and every slot count), so the same for its rows.
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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from expertstream.backends.base import Backend, Device, DeviceBuffer, Event, Host, HostBuffer, Stream
from expertstream.bench.measure import Settings, measure
from expertstream.engine.runner import Batching
from expertstream.hostmem import HostMemoryMode, HostWeights, RingFill, RingOptions, RingRegion
from expertstream.model import MoeModel

from ._common import MIB, Column, emit, environment, median, model_arguments, model_file, open_backend
from ._common import parser as common_parser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Geometry:
    chunks: int | None  # None: what suits the ring's workers
    chunk_mib: int | None
    part_mib: int | None

    @classmethod
    def parse(cls, text: str) -> Geometry:
        if text == "default":
            return cls(None, None, None)
        try:
            shape, part = text.split("/")
            chunks, chunk = shape.lower().split("x")
            return cls(int(chunks), int(chunk), int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected CHUNKSxCHUNK_MIB/PART_MIB, e.g. 8x32/8; got {text!r}") from None

    def __str__(self) -> str:
        return "default" if self.chunks is None else f"{self.chunks}x{self.chunk_mib}/{self.part_mib}"

    def ring(self, threads: int, fill: str) -> RingOptions:
        return RingOptions(
            fill=fill,
            threads=threads,
            chunks=self.chunks,
            chunk_bytes=None if self.chunk_mib is None else self.chunk_mib * MIB,
            part_bytes=None if self.part_mib is None else self.part_mib * MIB,
        )


# -- copy: the host alone ------------------------------------------------------------------------


def copy_rows(device: Device, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    size = path.stat().st_size
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    fd = os.open(path, os.O_RDONLY)
    chunks = [device.alloc_pinned(64 * MIB) for _ in range(4)]
    pageable = device.wrap_host(mapping)
    rows = []
    try:
        for part_mib, threads, method in itertools.product(args.part_mib, args.copy_threads, args.copy_methods):
            part = part_mib * MIB
            if size < 2 * part:
                log.warning("copy: %s is smaller than two parts of %d MiB; row skipped", path, part_mib)
                continue
            count = int(args.copy_gib * (1 << 30)) // part
            span = (size // part - 1) * part
            if method == "h2d":
                seconds = _h2d_seconds(device, pageable, part, count, threads, span)
            elif method == "lanes":
                seconds = _lanes_seconds(device, pageable, part, count, threads, span)
            else:
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
        pageable.close()
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

    return _threads_seconds(work, [() for _ in range(threads)])


def _threads_seconds(work: Callable[..., None], args: list[tuple[Any, ...]]) -> float:
    """Wall seconds for one thread per ``args`` entry to run ``work(*entry)``, all started together."""
    workers = [threading.Thread(target=work, args=entry) for entry in args]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def _h2d_seconds(device: Device, mapping: HostBuffer, part: int, count: int, threads: int, span: int) -> float:
    """Seconds for ``threads`` threads to copy ``count`` parts of the mapping to the device, pageable."""
    counter = itertools.count()
    with ExitStack() as stack:
        lanes = [
            (stack.enter_context(device.stream()), stack.enter_context(device.alloc(part))) for _ in range(threads)
        ]

        def work(stream: Stream, target: DeviceBuffer) -> None:
            while (index := next(counter)) < count:
                stream.copy_h2d(target, 0, mapping, (index * part) % span, part)
            stream.synchronize()

        seconds = _threads_seconds(work, lanes)
        for stream, _ in lanes:
            stream.synchronize()  # on this thread too, before the targets are freed
        return seconds


def _lanes_seconds(device: Device, mapping: HostBuffer, part: int, count: int, threads: int, span: int) -> float:
    """Seconds for ``threads`` threads to stage ``count`` parts of the mapping through pinned chunks of
    their own (two each) and DMA them to the device, each on its own stream."""
    counter = itertools.count()
    with ExitStack() as stack:
        lanes = []
        for _ in range(threads):
            stream = stack.enter_context(device.stream())
            target = stack.enter_context(device.alloc(part))
            chunks = [stack.enter_context(device.alloc_pinned(part)) for _ in range(2)]
            freed = [stack.enter_context(device.event()) for _ in range(2)]
            lanes.append((stream, target, chunks, freed))

        def work(stream: Stream, target: DeviceBuffer, chunks: list[HostBuffer], freed: list[Event]) -> None:
            turn = 0
            while (index := next(counter)) < count:
                chunk, free = chunks[turn % 2], freed[turn % 2]
                if turn >= 2:
                    free.synchronize()
                device.backend.host.copy(chunk, 0, mapping, (index * part) % span, part)
                stream.copy_h2d(target, 0, chunk, 0, part)
                stream.record(free)
                turn += 1
            stream.synchronize()

        seconds = _threads_seconds(work, lanes)
        for stream, *_ in lanes:
            stream.synchronize()  # on this thread too, before the buffers are freed
        return seconds


# -- prefill: the ring inside the job ---------------------------------------------------------------


@contextmanager
def copy_cpu_time(host: Host) -> Iterator[dict[str, float]]:
    """Count the host CPU time, wall time and bytes of ``host.copy`` calls (the ring's fills),
    and the process's page faults and kernel-mode share of its CPU time over the block."""
    totals = {"cpu_s": 0.0, "wall_s": 0.0, "bytes": 0.0}
    lock = threading.Lock()
    original = host.copy

    def timed(*args: Any, **kwargs: Any) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        original(*args, **kwargs)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        with lock:
            totals["cpu_s"] += cpu
            totals["wall_s"] += wall
            totals["bytes"] += args[4] if len(args) > 4 else kwargs["nbytes"]

    had_own = "copy" in vars(host)
    host.copy = timed  # type: ignore[method-assign]
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        yield totals
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        totals["minor_faults"] = after.ru_minflt - before.ru_minflt
        totals["user_s"] = after.ru_utime - before.ru_utime
        totals["system_s"] = after.ru_stime - before.ru_stime
        if had_own:
            host.copy = original  # type: ignore[method-assign]
        else:
            del host.copy  # the class's method again


def prefill_rows(be: Backend, device: Device, model: MoeModel, args: argparse.Namespace) -> list[dict[str, Any]]:
    settings = list(itertools.product(args.ubatch, args.geometry, args.ring_threads, args.ring_fill))
    found: dict[tuple[str, str, int, int, int], list[dict[str, Any]]] = {}
    peak = None
    for _ in range(args.repeats):
        for ubatch, geometry, threads, fill in settings:
            setting = Settings(
                Batching(args.tokens, ubatch),
                tuple(args.slots),
                (HostMemoryMode.RING,),
                ring=geometry.ring(threads, fill),
            )
            with copy_cpu_time(device.backend.host) as copies:
                result = measure(be, [device], model, setting, h2d_peak=peak)
            peak = result.baselines.h2d_peak
            cpu = copies["cpu_s"] / copies["wall_s"] if copies["wall_s"] else None
            process_s = copies["user_s"] + copies["system_s"]
            system = copies["system_s"] / process_s if process_s else None
            faults = copies["minor_faults"] / (copies["bytes"] / 1e9) if copies["bytes"] else None
            for row in result.rows:
                found.setdefault((str(geometry), fill, threads, ubatch, row.slots), []).append(
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
    for (geometry_text, fill, threads, ubatch, slots), runs in found.items():
        rows.append(
            {
                "part": "prefill",
                "geometry": geometry_text,
                "fill": fill,
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
                start = be.host.timestamp()
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
                seconds = be.host.timestamp() - start
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
    Column("fill", "fill"),
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
    p.add_argument(
        "--copy-methods",
        nargs="+",
        default=["memcpy", "pread"],
        choices=["memcpy", "pread", "h2d", "lanes"],
        help="copy: how the threads copy",
    )
    p.add_argument(
        "--geometry",
        type=Geometry.parse,
        nargs="+",
        default=[Geometry(None, None, None)],
        help="prefill: CHUNKSxCHUNK_MIB/PART_MIB, or default (what suits the workers)",
    )
    p.add_argument(
        "--ring-fill",
        nargs="+",
        default=["auto"],
        choices=[f.value for f in RingFill],
        help="prefill: who fills the chunks (processes, threads, auto)",
    )
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
