"""What the transfer microbenchmarks share: the command line, host memory of each kind, timing, output.

Device times come from timing events; host-blocked times from ``backend.host.timestamp()``
around the enqueue calls (the wall clock on real devices, virtual time on the simulator), so
the same code measures every backend through its public interface.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import logging
import mmap
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import expertstream
from expertstream.backends.base import Backend, Device, HostBuffer
from expertstream.model import make_model

log = logging.getLogger(__name__)

MIB = 1 << 20
FILL_BYTE = 0x5A  # any non-zero byte: touches every page so no copy pays first-touch faults
_FILE_CHUNK = 64 * MIB


class HostKind(enum.Enum):
    """The host-memory kinds the benchmarks compare (values are the command-line spellings)."""

    PAGEABLE = "pageable"
    PINNED = "pinned"
    REGISTERED = "registered"
    REGISTERED_RO_MMAP = "registered-ro-mmap"  # a PROT_READ mapping of a file, registered read-only


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m microbench.{prog}", description=description)
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "hip", "sim"))
    p.add_argument("--profile", help="simulator profile (implies --backend sim), e.g. cuda-h200, rocm-r9700")
    p.add_argument("--device", type=int, default=0, help="device index")
    p.add_argument("--json", action="store_true", help="print JSON on stdout (the table goes to stderr)")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    return p


def model_arguments(p: argparse.ArgumentParser, layers: int) -> None:
    """--model FILE, or the model to write: --preset, --type, --layers (``model_file`` reads them)."""
    p.add_argument("--model", type=Path, help="a GGUF MoE model; default: write one with --preset")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--type", dest="qtype", default="Q4_0")
    p.add_argument("--layers", type=int, default=layers)


@contextlib.contextmanager
def model_file(args: argparse.Namespace, prog: str) -> Iterator[Path]:
    """--model, or a model of the ``model_arguments`` written to a temporary folder for the block."""
    if args.model:
        yield args.model
        return
    with tempfile.TemporaryDirectory(prefix=f"{prog}-") as tmp:
        yield make_model(args.preset, args.qtype, Path(tmp) / "model.gguf", layers=args.layers)


def open_backend(args: argparse.Namespace, *, data: bool = False) -> Backend:
    """The backend asked for; the simulator timing-only unless ``data`` (most benchmarks never
    check the bytes)."""
    if args.profile or args.backend == "sim":
        return expertstream.backend("sim", profile=args.profile, data=data)
    return expertstream.backend(args.backend)


def environment(backend: Backend, device: Device) -> dict[str, Any]:
    """Backend, device and whatever versions the backend reports, for the JSON header."""
    described = backend.describe()
    extra = {k: v for k, v in described.items() if k not in ("name", "vendor", "devices")}
    return {"backend": backend.name, "device": device.name, "arch": device.arch, **extra}


@dataclass(frozen=True)
class HostSource:
    buffer: HostBuffer
    register_ms: float | None  # time the host spent page-locking it, for registered kinds


@contextlib.contextmanager
def host_memory(backend: Backend, device: Device, kind: HostKind, nbytes: int) -> Iterator[HostSource]:
    """Host memory of ``kind`` holding ``nbytes`` of non-zero data; released on exit."""
    with contextlib.ExitStack() as stack:
        if kind is HostKind.PINNED:
            buffer = device.alloc_pinned(nbytes)
            buffer.array.fill(FILL_BYTE)
        elif kind is HostKind.REGISTERED_RO_MMAP:
            mapping = stack.enter_context(_read_only_file_mapping(nbytes))
            buffer = device.wrap_host(mapping)
        else:
            buffer = device.wrap_host(np.full(nbytes, FILL_BYTE, dtype=np.uint8))
        stack.callback(buffer.close)
        register_ms = None
        if kind in (HostKind.REGISTERED, HostKind.REGISTERED_RO_MMAP):
            start = backend.host.timestamp()
            buffer.register(read_only=kind is HostKind.REGISTERED_RO_MMAP)
            register_ms = (backend.host.timestamp() - start) * 1e3
        yield HostSource(buffer, register_ms)


@contextlib.contextmanager
def _read_only_file_mapping(nbytes: int) -> Iterator[mmap.mmap]:
    """A PROT_READ mapping of a temporary file, its pages already in the page cache."""
    chunk = np.full(min(nbytes, _FILE_CHUNK), FILL_BYTE, dtype=np.uint8).tobytes()
    with tempfile.TemporaryFile(prefix="microbench-") as f:
        for start in range(0, nbytes, len(chunk)):
            f.write(chunk[: min(len(chunk), nbytes - start)])
        f.flush()
        mapping = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
        try:
            yield mapping
        finally:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: the GC closes it
                mapping.close()


def blocked_ms(backend: Backend, enqueue: Callable[[], None]) -> float:
    """Run ``enqueue`` and return how long the calling thread was held in it."""
    start = backend.host.timestamp()
    enqueue()
    return (backend.host.timestamp() - start) * 1e3


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{}"


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], file: TextIO) -> None:
    cells = [[c.header for c in columns]]
    cells += [["-" if row.get(c.key) is None else c.fmt.format(row[c.key]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)), file=file)


def emit(args: argparse.Namespace, result: dict[str, Any], columns: Sequence[Column], title: str) -> None:
    """Write the JSON where asked, then the table last (on stderr when stdout carries JSON)."""
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    table_file = sys.stdout
    if args.json:
        print(text)
        table_file = sys.stderr
    print(f"{title} ({result['backend']}: {result['device']})", file=table_file)
    print_table(result["rows"], columns, table_file)
