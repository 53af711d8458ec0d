"""File to device memory through KvikIO (cuFile where GPUDirect Storage works, else its POSIX
compatibility mode), to set beside mode disk's O_DIRECT ring on the same drive.

    KVIKIO_NTHREADS=16 python -m microbench.kvikio_read --file model.gguf [--gib 2] [--read-mib 256]

KvikIO reads through its own thread pool (KVIKIO_NTHREADS threads, KVIKIO_TASK_SIZE bytes a task,
KVIKIO_COMPAT_MODE: the environment sets them before it loads). Each of the reads (--read-mib, one
at a time, consecutive from the file's start, wrapping around) lands in one device buffer; the
first and last MiB of the last read are checked against os.pread of the same bytes. Drop the page
cache first (`echo 3 > /proc/sys/vm/drop_caches`) for the drive's rate. Needs the kvikio-cu13 (or
-cu12) wheel, which the project does not install: it is measured here, not used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

MIB = 1 << 20


def setting(kvikio: object, name: str) -> object:
    defaults = kvikio.defaults  # type: ignore[attr-defined]
    if hasattr(defaults, "get"):
        return defaults.get(name)
    return getattr(defaults, {"num_threads": "get_num_threads"}.get(name, name))()


def _posix_preferred(kvikio: object) -> bool | None:
    """Whether KvikIO takes its POSIX path (compatibility mode) for these reads, as it decides it under
    AUTO: no cuFile library, or a system cuFile cannot serve."""
    preferred = getattr(kvikio.defaults, "is_compat_mode_preferred", None)  # type: ignore[attr-defined]
    return bool(preferred()) if callable(preferred) else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m microbench.kvikio_read", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, required=True)
    p.add_argument("--gib", type=float, default=2.0, help="bytes to read, GiB")
    p.add_argument("--read-mib", type=int, default=256, help="bytes a pread, MiB")
    args = p.parse_args(argv)
    try:
        import cupy
        import kvikio
        import kvikio.defaults  # a submodule kvikio's __init__ does not import (26.10)
    except ImportError as e:
        print(f"kvikio_read: {e}; install the kvikio-cu13 wheel (with cupy) to run it", file=sys.stderr)
        return 2
    size = args.file.stat().st_size
    read = min(args.read_mib * MIB, size // MIB * MIB)
    reads = max(1, int(args.gib * (1 << 30)) // read)
    buf = cupy.empty(read, dtype=cupy.uint8)
    offsets = [(i * read) % (size - read + 1) for i in range(reads)]
    with kvikio.CuFile(args.file, "r") as f:
        f.pread(buf, read, offsets[0]).get()  # the pool and the buffer's registration, untimed
        cupy.cuda.runtime.deviceSynchronize()
        offsets = [(o + read) % (size - read + 1) for o in offsets]
        start = time.perf_counter()
        for offset in offsets:
            got = f.pread(buf, read, offset).get()
            if got != read:
                raise SystemExit(f"{args.file}: a read at offset {offset} returned {got} of {read} bytes")
        cupy.cuda.runtime.deviceSynchronize()
        seconds = time.perf_counter() - start
    fd = os.open(args.file, os.O_RDONLY)
    try:
        for at in (0, read - MIB):
            want = os.pread(fd, MIB, offsets[-1] + at)
            if bytes(buf[at : at + MIB].get()) != want:
                raise SystemExit(f"{args.file}: the device's bytes at offset {offsets[-1] + at} differ from the file's")
    finally:
        os.close(fd)
    out = {
        "file": str(args.file),
        "compat_mode": str(setting(kvikio, "compat_mode")),
        # True: KvikIO reads through POSIX (its compatibility mode), not cuFile; None where it cannot say
        "posix_reads": _posix_preferred(kvikio),
        "num_threads": setting(kvikio, "num_threads"),
        "task_size": setting(kvikio, "task_size"),
        "read_mib": read / MIB,
        "reads": reads,
        "seconds": seconds,
        "gb_per_s": reads * read / seconds / 1e9,
        "kvikio": getattr(kvikio, "__version__", "?"),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
