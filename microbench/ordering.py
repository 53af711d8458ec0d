"""Per-split stall of the lookahead copy/compute pattern in three orders, on simulated profiles.

The pattern is the scheduler's (N = 3 slots, the copy for split i+2 fired while split i
computes), built here by hand from backend primitives so that each order can be run:

- ``wait-after-copy``: after launching split i the host enqueues the copy for split i+2, then
  the compute stream's wait for split i+1 (the first llama.cpp implementation, PR #28414);
- ``wait-before-copy``: the wait for split i+1 first, then the copy for i+2, same thread;
- ``scheduler``: the wait first, and copies from memory that can block the host are enqueued
  by a copy worker thread, each once the wait for the split before it is enqueued (what
  expertstream's scheduler does).

Stall of split j = how long its kernel started after both its data and the previous kernel
were done. Times are virtual (the simulated backend in timing-only mode).

    python -m microbench.ordering [--json] [--splits 12]
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import expertstream
from expertstream.backends.base import Backend, HostBuffer, HostMemory, Usage
from expertstream.timeline import OpKind

ORDERS = ("wait-after-copy", "wait-before-copy", "scheduler")
PROFILES = ("cuda-h200", "rocm-r9700")
KERNEL = "es_bench_split"
SLOTS = 3
# The ROCm timeline reported in the review of llama.cpp PR #28414: up/gate tensors of ~891 MB
# and down tensors of ~629 MB per layer.
TENSOR_BYTES = (891_000_000, 891_000_000, 629_000_000)


def _register_twin() -> None:
    from expertstream.backends.sim import Access, KernelSpec, register_kernel

    register_kernel(
        KernelSpec(
            KERNEL,
            run=lambda args, grid, block: None,
            accesses=lambda args: [Access(args[0], write=False)],
            flops=lambda args: float(args[1]),
        )
    )


@dataclass(frozen=True)
class Row:
    profile: str
    host_memory: str
    order: str
    mean_stall_ms: float
    max_stall_ms: float
    wall_ms: float
    stalls_ms: tuple[float, ...]


def run_pattern(profile: str, host_memory: HostMemory, order: str, n_splits: int = 12, compute_ms: float = 12.0) -> Row:
    """Run the pattern once on a fresh simulated backend and measure every split's stall."""
    _register_twin()
    with expertstream.backend("sim", profile=profile, data=False) as backend:
        sizes = [TENSOR_BYTES[j % len(TENSOR_BYTES)] for j in range(n_splits)]
        stalls, wall = _pattern(backend, sizes, host_memory, order, compute_ms)
    return Row(
        profile,
        host_memory.value,
        order,
        float(np.mean(stalls)),
        float(np.max(stalls)),
        wall,
        tuple(round(s, 3) for s in stalls),
    )


def _pattern(
    backend: Backend, sizes: list[int], host_memory: HostMemory, order: str, compute_ms: float
) -> tuple[list[float], float]:
    device = backend.device(0)
    kernel = device.compile("", KERNEL)
    flops = compute_ms * 1e-3 * backend.profile.flops_per_s  # type: ignore[attr-defined]
    sources = [_host(device, n, host_memory) for n in sizes]
    compute, copy = device.stream(), device.stream()
    slots = [device.alloc(max(sizes), Usage.COMPUTE) for _ in range(SLOTS)]
    ready = [device.event() for _ in range(SLOTS)]
    free = [device.event() for _ in range(SLOTS)]
    worker = _Worker(backend) if order == "scheduler" else None

    enqueued: dict[int, _Done] = {}
    waited = [_Done(backend) for _ in sizes]

    def fire(j: int) -> None:
        slot = j % SLOTS

        def job() -> None:
            copy.wait(free[slot])
            copy.copy_h2d(slots[slot], 0, sources[j], 0, sizes[j])
            copy.record(ready[slot])

        def gated_job() -> None:
            if j:
                waited[j - 1].join()  # the worker's gate: behind the wait for the split before
            job()

        enqueued[j] = _Done(backend)
        if worker is not None and not sources[j].is_page_locked:
            worker.submit(gated_job, enqueued[j])
        else:
            job()
            enqueued[j].set()

    def wait(j: int) -> None:
        enqueued[j].join()  # the copy for j must be enqueued before its ready event is waited on
        compute.wait(ready[j % SLOTS])
        waited[j].set()

    start = backend.host.timestamp()
    for j in range(SLOTS - 1):
        fire(j)
    wait(0)
    for i in range(len(sizes)):
        view = slots[i % SLOTS].view(0, sizes[i])
        compute.launch(kernel, 1, 1, (view, np.float64(flops)))
        compute.record(free[i % SLOTS])
        nxt, ahead = i + 1, i + SLOTS - 1
        steps: list[Callable[[], None]] = []
        if nxt < len(sizes):
            steps.append(lambda nxt=nxt: wait(nxt))  # type: ignore[misc]
        if ahead < len(sizes):
            steps.append(lambda ahead=ahead: fire(ahead))  # type: ignore[misc]
        if order == "wait-after-copy":
            steps.reverse()
        for step in steps:
            step()
    if worker is not None:
        worker.stop()
    compute.synchronize()
    copy.synchronize()
    wall_ms = (backend.host.timestamp() - start) * 1e3
    return _stalls(backend, len(sizes)), wall_ms


def _stalls(backend: Backend, n_splits: int) -> list[float]:
    ops = backend.timeline
    assert ops is not None, "the ordering microbench runs on the simulator, whose timeline is always on"
    kernels = [op for op in ops if op.kind is OpKind.KERNEL and op.name == KERNEL]
    copies = [op for op in ops if op.kind is OpKind.H2D]
    assert len(kernels) == n_splits and len(copies) == n_splits
    stalls = []
    for j, k in enumerate(kernels):
        ready_at = copies[j].end
        if j:
            ready_at = max(ready_at, kernels[j - 1].end)
        stalls.append(max(0.0, (k.start - ready_at) * 1e3))
    return stalls


def _host(device: Any, nbytes: int, kind: HostMemory) -> HostBuffer:
    # Timing-only mode moves no bytes, so an untouched allocation is enough.
    host: HostBuffer = device.wrap_host(np.empty(nbytes, dtype=np.uint8))
    if kind is HostMemory.REGISTERED:
        host.register()
    elif kind is HostMemory.PINNED:
        host = device.alloc_pinned(nbytes)
    return host


class _Done:
    """Set by the thread that enqueued a copy; the waiter resumes at that thread's clock."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._event = threading.Event()
        self._at = 0.0

    def set(self) -> None:
        self._at = self._backend.host.timestamp()
        self._event.set()

    def join(self) -> None:
        self._event.wait()
        self._backend.host.resume_at(self._at)


class _Worker:
    """A copy thread, as in the scheduler: jobs run in order with the submitter's clock."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._jobs: queue.Queue[tuple[Callable[[], None], _Done, float] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], done: _Done) -> None:
        self._jobs.put((job, done, self._backend.host.timestamp()))

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done, at = item
            self._backend.host.resume_at(at)
            job()
            done.set()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m microbench.ordering", description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=int, default=12)
    parser.add_argument("--compute-ms", type=float, default=12.0, help="virtual compute time of one split")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        run_pattern(profile, host, order, args.splits, args.compute_ms)
        for profile in PROFILES
        for host in (HostMemory.PINNED, HostMemory.PAGEABLE)
        for order in ORDERS
    ]
    if args.json:
        print(json.dumps({"backend": "sim", "slots": SLOTS, "rows": [asdict(r) for r in rows]}, indent=2))
        return 0
    print(f"{'profile':11} {'host':9} {'order':17} {'mean stall ms':>13} {'max stall ms':>12} {'wall ms':>9}")
    for r in rows:
        print(
            f"{r.profile:11} {r.host_memory:9} {r.order:17} {r.mean_stall_ms:13.2f} {r.max_stall_ms:12.2f} "
            f"{r.wall_ms:9.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
