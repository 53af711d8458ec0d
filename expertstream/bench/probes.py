"""What `expertstream tune` measures on a device, through the backend's public interface.

Each probe issues the operations the job issues: copies from pinned memory, from a file mapping
(pageable, and registered in place), the MoE kernels through ``MoeKernels`` and the runner's
stand-in kernels, memcpys from a mapping on several host threads, and the event-order
question (when is a stream waiting on an event released, by where its wait was enqueued).
Sizes and repeats are bounded so that all probes together take a few seconds on a GPU. On the
simulator they measure the profile it was opened with, which is how the fit is checked.

Device times come from timing events; host times from ``backend.host.timestamp()``. Kernels
and copies that must run back to back are held behind a short run of memsets on another
stream while they are enqueued, so that the device, not the host, sets their pace.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import UNASKED_SHARED_BYTES, Backend, Device, DeviceBuffer, HostBuffer, Stream, Usage
from ..engine import standin
from ..errors import DeviceError, InvalidArgument
from ..ggml import RowType
from ..hostmem import DEFAULT_RING_CHUNK_BYTES, DEFAULT_RING_CHUNKS, RingFill, StagingRing, default_ring_threads
from ..kernels import MoeKernels, layout, routing
from ..kernels import reference as ref
from ..kernels.layout import weight_format

MIB = 1 << 20
GATE_MARGIN = 3.0  # the gate holds this many times the host's estimated enqueue time
GATE_MIN_S = 1e-3
# The rows the gather probe copies: about one expert tensor of a 30B-class MoE at 4 bits (0.88 MB).
GATHER_ROW_BYTES = 1 << 20


@dataclass(frozen=True)
class Bounds:
    """How much the probes move and how often; the defaults fit in a few seconds on a GPU."""

    copy_bytes: tuple[int, int] = (16 * MIB, 64 * MIB)  # two sizes: rate from the difference
    fill_bytes: tuple[int, int] = (64 * MIB, 256 * MIB)  # memsets and device-local copies
    gate_bytes: int = 64 * MIB
    ring_bytes: int = 512 * MIB  # streamed through the staging ring (reported); its fills time up to 256 MiB
    ring_copies: int = 32  # small copies through the ring, as a decode step makes them
    event_copy_bytes: tuple[int, int] = (16 * MIB, 128 * MIB)  # copy1, copy2 of the event-order probe
    # The temporary file copies from pageable memory read: larger than a host's last-level cache,
    # and read at moving offsets, so its bytes come from memory as a model's do.
    mapping_bytes: int = 1 << 30
    repeats: int = 3
    copies: int = 4  # back-to-back copies per copy timing
    launches: int = 20  # back-to-back launches per kernel timing

    def __post_init__(self) -> None:
        if min(self.copy_bytes) < GATHER_ROW_BYTES:
            raise InvalidArgument(f"copy sizes below {GATHER_ROW_BYTES} bytes cannot time a gather of whole rows")
        largest = max(*self.copy_bytes, self.ring_bytes, sum(self.event_copy_bytes))
        if self.mapping_bytes < largest:
            raise InvalidArgument(f"a {self.mapping_bytes}-byte mapping cannot hold the {largest}-byte copy")


DEFAULT_BOUNDS = Bounds()


@dataclass(frozen=True)
class CopyTiming:
    """One kind of transfer at one size: device seconds between timing events, host seconds in the call."""

    what: str  # h2d-pinned, h2d-gather, h2d-pageable, d2h-pinned, d2h-pageable, d2d, memset
    nbytes: int
    device_s: float  # pinned and device-side: per copy, back to back; pageable: one copy between events
    host_blocked_s: float


@dataclass(frozen=True)
class EventOrderTiming:
    """Stream A: copy1, record e1, copy2; B waits for e1, its wait enqueued before or after copy2."""

    host_memory: str  # pinned or pageable
    wait: str  # before or after
    released_s: float  # from A's start to B passing its wait
    host_blocked_s: float  # host time inside the enqueue calls
    copy2_bytes: int


@dataclass(frozen=True)
class KernelTiming:
    """Device seconds per call of a launcher, calls back to back.

    ``launches`` kernels run per call; ``other_flops`` is the work of those that are not
    ``kernel`` (the grouping kernel before each mul_mat_id).
    """

    kernel: str
    shape: tuple[int, ...]
    size: float
    flops: float
    seconds: float
    launches: int = 1
    other_flops: float = 0.0


@dataclass(frozen=True)
class HostCopyTiming:
    """``threads`` threads filling the staging ring's chunks (``nbytes`` in all) from a mapping."""

    threads: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class RingCopyTiming:
    """Copies of one expert's bytes through the staging ring, none announced (a decode step's)."""

    nbytes: int
    copies: int
    seconds_per_copy: float


@dataclass(frozen=True)
class ExpertShape:
    """One expert tensor's kernel: what a layer's gate/up (x shared) or down (x per routed pair) is."""

    w_type: RowType
    n_out: int
    n_in: int
    x_per_pair: bool


@dataclass(frozen=True)
class ModelShape:
    """The shapes the runner's kernels take for one model, without the model."""

    n_embd: int
    n_ff: int
    n_expert: int
    top_k: int
    experts: tuple[ExpertShape, ...]


@dataclass
class Measurements:
    """Everything the probes measured on one device (plain data, JSON-able with dataclasses.asdict)."""

    device_name: str
    memory_bytes: int
    host_register: bool
    host_register_read_only: bool
    enqueue_s: float  # host seconds per launch call, back to back (the profile's call_s)
    launch_s: float  # device seconds per empty kernel, back to back
    copies: list[CopyTiming] = field(default_factory=list)
    register_bytes_per_s: float | None = None
    event_order: list[EventOrderTiming] = field(default_factory=list)
    kernels: list[KernelTiming] = field(default_factory=list)
    host_copies: list[HostCopyTiming] = field(default_factory=list)
    matrix_cores: bool = False  # the device's capabilities: which mul_mat_id path its kernels took
    int8_matrix_cores: bool = False
    mma_fragments: bool = False
    max_shared_bytes: int = UNASKED_SHARED_BYTES
    ring_bytes_per_s: float | None = None  # the staging ring itself streaming, on the most threads
    ring_small: RingCopyTiming | None = None


def measure(
    backend: Backend,
    device: Device,
    shape: ModelShape,
    ubatches: Sequence[int],
    host_threads: Sequence[int],
    bounds: Bounds = DEFAULT_BOUNDS,
    progress: Callable[[str], None] = lambda what: None,
    pageable: HostBuffer | None = None,
) -> Measurements:
    """Run every probe on ``device``; ``progress`` is told what runs next.

    ``pageable``: what copies and memcpys from pageable memory read (a model's file mapping, the
    bytes the job reads) instead of the probes' temporary file.
    """
    caps = device.capabilities
    with contextlib.ExitStack() as stack:
        kernels = stack.enter_context(MoeKernels(device))
        stream = stack.enter_context(device.stream())
        gate = stack.enter_context(Gate.opened(device, stream, bounds.gate_bytes))
        mapping = stack.enter_context(file_mapping(device, bounds.mapping_bytes))
        source = _Cycle(pageable if pageable is not None and pageable.nbytes >= bounds.mapping_bytes else mapping)
        progress("compile kernels")  # on a GPU, NVRTC or hipRTC (or the on-disk cache's images)
        kernels.prepare(e.w_type for e in shape.experts)
        progress("copies")
        copies = _copies(backend, device, stream, source, gate, bounds)
        progress("launch overhead")
        enqueue_s, launch_s = _launch_overhead(backend, device, stream, kernels, gate, bounds)
        result = Measurements(
            device.name, device.total_memory, caps.host_register, caps.host_register_read_only, enqueue_s, launch_s
        )
        result.copies = copies
        result.matrix_cores, result.int8_matrix_cores = caps.matrix_cores, caps.int8_matrix_cores
        result.mma_fragments = caps.mma_fragments
        result.max_shared_bytes = caps.max_shared_bytes
        result.register_bytes_per_s, result.host_register_read_only = _registration(backend, mapping)
        progress("event order")
        result.event_order = _event_order(backend, device, mapping, bounds)
        progress("staging ring")
        result.host_copies = _host_copies(backend, device, stream, source, host_threads, bounds)
        offset = source.take(bounds.ring_bytes)
        ring_s = ring_stream(backend, device, stream, source.buffer, offset, bounds.ring_bytes, max(host_threads))
        result.ring_bytes_per_s = bounds.ring_bytes / ring_s
        expert_bytes = max(e.n_out * weight_format(e.w_type).row_bytes(e.n_in) for e in shape.experts)
        offset = source.take(2 * bounds.ring_copies * expert_bytes)
        per_copy = ring_small_copies(backend, device, stream, source.buffer, offset, expert_bytes, bounds.ring_copies)
        result.ring_small = RingCopyTiming(expert_bytes, bounds.ring_copies, per_copy)
        for ubatch in ubatches:
            progress(f"kernels, ubatch {ubatch}")
            result.kernels += _kernels(backend, device, stream, kernels, gate, shape, ubatch, bounds)
    return result


# -- helpers ---------------------------------------------------------------------------------


class Gate:
    """Holds a stream behind pinned copies on another stream, so what it is given next runs back to back.

    The copies, not memsets, hold it: their rate is the first thing measured, so the gate can be
    sized to outlast the host's enqueueing by a margin.
    """

    def __init__(self, device: Device, host: HostBuffer, scratch: DeviceBuffer, rate: float) -> None:
        self.device = device
        self.host = host
        self.scratch = scratch
        self.rate = rate  # bytes/s of one copy of ``host`` into ``scratch``

    @classmethod
    @contextlib.contextmanager
    def opened(cls, device: Device, stream: Stream, nbytes: int) -> Iterator[Gate]:
        with device.alloc_pinned(nbytes) as host, device.alloc(nbytes) as scratch:
            stream.copy_h2d(scratch, 0, host, 0, nbytes)  # warm-up
            stream.synchronize()
            seconds = _timed(device, stream, lambda: stream.copy_h2d(scratch, 0, host, 0, nbytes))
            yield cls(device, host, scratch, nbytes / seconds)

    @contextlib.contextmanager
    def held(self, stream: Stream, seconds: float) -> Iterator[None]:
        """Work enqueued on ``stream`` in the next ``seconds`` of host time starts only when the gate opens."""
        hold = max(GATE_MARGIN * seconds, GATE_MIN_S)
        count = max(1, math.ceil(hold * self.rate / self.host.nbytes))
        with self.device.stream() as other, self.device.event() as go:
            for _ in range(count):
                other.copy_h2d(self.scratch, 0, self.host, 0, self.host.nbytes)
            other.record(go)
            stream.wait(go)
            yield
            stream.synchronize()


class _Cycle:
    """Offsets into a host buffer that move on with every read, so no read finds the last in a cache."""

    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer
        self._next = 0

    def take(self, nbytes: int) -> int:
        if self._next + nbytes > self.buffer.nbytes:
            self._next = 0
        offset, self._next = self._next, self._next + nbytes
        return offset


def back_to_back(
    backend: Backend, device: Device, stream: Stream, gate: Gate, enqueue: Callable[[], None], count: int
) -> tuple[float, float]:
    """(device seconds per call with ``count`` calls running back to back, host seconds per call)."""
    enqueue()  # warm-up (a kernel compiles on its first launch)
    stream.synchronize()
    one = _host_seconds(backend, enqueue)
    stream.synchronize()
    calls: list[float] = []
    with gate.held(stream, one * count):
        device_s = _timed(device, stream, lambda: calls.extend(_host_seconds(backend, enqueue) for _ in range(count)))
    return device_s / count, statistics.median(calls)


def _timed(device: Device, stream: Stream, enqueue: Callable[[], None]) -> float:
    """Device seconds between timing events recorded around ``enqueue()``."""
    with device.event(timing=True) as start, device.event(timing=True) as end:
        stream.record(start)
        enqueue()
        stream.record(end)
        end.synchronize()
        return start.elapsed_ms(end) / 1e3


def _host_seconds(backend: Backend, call: Callable[[], None]) -> float:
    start = backend.host.timestamp()
    call()
    return backend.host.timestamp() - start


@contextlib.contextmanager
def file_mapping(device: Device, nbytes: int) -> Iterator[HostBuffer]:
    """A read-only mapping of a temporary file of non-zero bytes, in the page cache, as model files are.

    Where the backend holds no data the file is sparse: nothing reads its bytes.
    """
    chunk = np.full(min(nbytes, 64 * MIB), 0x5A, dtype=np.uint8).tobytes()
    with tempfile.TemporaryFile(prefix="expertstream-tune-") as f:
        if device.backend.host.holds_data:
            for start in range(0, nbytes, len(chunk)):
                f.write(chunk[: min(len(chunk), nbytes - start)])
        f.truncate(nbytes)
        f.flush()
        mapping = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
        buffer = device.wrap_host(mapping)
        try:
            yield buffer
        finally:
            buffer.close()
            with contextlib.suppress(BufferError):  # a view still alive: the collector closes it
                mapping.close()


def _device_buffer(device: Device, data: np.ndarray | None, nbytes: int, usage: Usage = Usage.ANY) -> DeviceBuffer:
    """A buffer holding ``data`` where the backend holds data, else zeros (nothing reads them)."""
    if data is not None and device.backend.host.holds_data:
        return device.upload(data, usage)
    buf = device.alloc(nbytes, usage)
    with device.stream() as stream:
        stream.memset(buf, 0, buf.alloc_size, 0)
        stream.synchronize()
    return buf


def copy_fit(copies: Sequence[CopyTiming], what: str) -> tuple[float, float]:
    """(seconds per byte, seconds at zero bytes) of ``what`` through its smallest and largest size."""
    rows = sorted((c for c in copies if c.what == what), key=lambda c: c.nbytes)
    small, large = rows[0], rows[-1]
    slope = (large.device_s - small.device_s) / (large.nbytes - small.nbytes)
    return slope, small.device_s - slope * small.nbytes


# -- probes ----------------------------------------------------------------------------------


def _launch_overhead(
    backend: Backend, device: Device, stream: Stream, kernels: MoeKernels, gate: Gate, bounds: Bounds
) -> tuple[float, float]:
    """(host seconds per launch call, device seconds per empty kernel back to back)."""
    with _device_buffer(device, None, 4) as h, _device_buffer(device, None, 4) as delta, backend.host.bare_calls():
        device_s, host_s = back_to_back(
            backend,
            device,
            stream,
            gate,
            lambda: standin.add_inplace(kernels, stream, h.view(), delta.view(), 1),
            bounds.launches,
        )
    return host_s, device_s


def _copies(
    backend: Backend, device: Device, stream: Stream, source: _Cycle, gate: Gate, bounds: Bounds
) -> list[CopyTiming]:
    """Page-locked and device-side copies back to back (their fixed cost is the DMA setup);
    pageable ones one at a time, since they may hold the host until they are done."""
    rows: list[CopyTiming] = []
    largest = max(*bounds.copy_bytes, *bounds.fill_bytes)
    region = max(bounds.copy_bytes) // GATHER_ROW_BYTES * GATHER_ROW_BYTES
    with (
        device.alloc(largest, Usage.COMPUTE) as dst,
        device.alloc_pinned(max(bounds.copy_bytes)) as pinned,
        device.upload(np.arange(region // GATHER_ROW_BYTES, dtype=np.int32)) as ids,
    ):
        pageable = device.wrap_host(np.zeros(max(bounds.copy_bytes), dtype=np.uint8))
        stream.memset(dst, 0, dst.alloc_size, 0)
        fills = [n // 2 for n in bounds.fill_bytes]

        def gather(n: int) -> None:  # n // GATHER_ROW_BYTES experts of a decode step, named on the device
            stream.gather_h2d(dst, 0, pinned, 0, region, ids.view(), n // GATHER_ROW_BYTES, GATHER_ROW_BYTES)

        back_to_back_kinds: list[tuple[str, Sequence[int], Callable[[int], None]]] = [
            ("h2d-pinned", bounds.copy_bytes, lambda n: stream.copy_h2d(dst, 0, pinned, 0, n)),
            ("h2d-gather", bounds.copy_bytes, gather),
            ("d2h-pinned", bounds.copy_bytes, lambda n: stream.copy_d2h(pinned, 0, dst, 0, n)),
            ("d2d", fills, lambda n: stream.copy_d2d(dst, n, dst, 0, n)),
            ("memset", bounds.fill_bytes, lambda n: stream.memset(dst, 0, n, 0)),
        ]
        for what, sizes, enqueue in back_to_back_kinds:
            for n in sizes:
                trials = [
                    back_to_back(backend, device, stream, gate, functools.partial(enqueue, n), bounds.copies)
                    for _ in range(bounds.repeats)
                ]
                rows.append(
                    CopyTiming(
                        what, n, statistics.median(t[0] for t in trials), statistics.median(t[1] for t in trials)
                    )
                )
        single_kinds: list[tuple[str, Callable[[int], None]]] = [
            ("h2d-pageable", lambda n: stream.copy_h2d(dst, 0, source.buffer, source.take(n), n)),
            ("d2h-pageable", lambda n: stream.copy_d2h(pageable, 0, dst, 0, n)),
        ]
        for what, enqueue in single_kinds:
            enqueue(min(bounds.copy_bytes))  # warm-up: first-touch and mapping costs
            stream.synchronize()
            for n in bounds.copy_bytes:
                single = [_timed_copy(backend, device, stream, enqueue, n) for _ in range(bounds.repeats)]
                rows.append(
                    CopyTiming(
                        what, n, statistics.median(t[0] for t in single), statistics.median(t[1] for t in single)
                    )
                )
        pageable.close()
    return rows


def _copy_row(what: str, nbytes: int, trials: Sequence[tuple[float, float]]) -> CopyTiming:
    return CopyTiming(what, nbytes, statistics.median(t[0] for t in trials), statistics.median(t[1] for t in trials))


def _timed_copy(
    backend: Backend, device: Device, stream: Stream, enqueue: Callable[[int], None], nbytes: int
) -> tuple[float, float]:
    """(device seconds, host seconds in the call) of one ``enqueue(nbytes)``."""
    blocked: list[float] = []
    device_s = _timed(device, stream, lambda: blocked.append(_host_seconds(backend, lambda: enqueue(nbytes))))
    return device_s, blocked[0]


def _registration(backend: Backend, mapping: HostBuffer) -> tuple[float | None, bool]:
    """(bytes/s of page-locking the mapping in place, whether read-only registration worked)."""
    caps = mapping.device.capabilities
    if not caps.host_register:
        return None, False
    target = mapping if caps.host_register_read_only else mapping.device.wrap_host(np.zeros(mapping.nbytes, np.uint8))
    try:
        seconds = _host_seconds(backend, lambda: target.register(read_only=target.read_only))
    except DeviceError:
        return None, False
    finally:
        target.unregister()
        if target is not mapping:
            target.close()
    return mapping.nbytes / seconds if seconds > 0 else None, target is mapping


def _event_order(backend: Backend, device: Device, mapping: HostBuffer, bounds: Bounds) -> list[EventOrderTiming]:
    copy1, copy2 = bounds.event_copy_bytes
    rows = []
    with (
        device.stream() as a,
        device.stream() as b,
        device.alloc(copy1 + copy2) as dst,
        device.alloc_pinned(copy1 + copy2) as pinned,
    ):
        for kind, host in (("pinned", pinned), ("pageable", mapping)):
            for wait in ("before", "after"):
                trials = [event_order_once(backend, device, (a, b), dst, host, (copy1, copy2), wait) for _ in range(2)]
                released, _, blocked = trials[-1]  # the first ran on cold memory
                rows.append(EventOrderTiming(kind, wait, released, blocked, copy2))
    return rows


def event_order_once(
    backend: Backend,
    device: Device,
    streams: tuple[Stream, Stream],
    dst: DeviceBuffer,
    host: HostBuffer,
    sizes: tuple[int, int],
    wait: str,
) -> tuple[float, float, float]:
    """One trial: stream A copies copy1, records e1, copies copy2; B waits for e1, its wait enqueued
    ``before`` or ``after`` copy2. Returns (seconds until B passes its wait by timing events, seconds
    until the host saw it, host seconds inside the enqueue calls)."""
    (a, b), (copy1, copy2) = streams, sizes
    with device.event(timing=True) as start, device.event(timing=True) as released, device.event() as e1:

        def consumer() -> None:
            b.wait(e1)
            b.record(released)

        begun = backend.host.timestamp()
        blocked = _host_seconds(backend, lambda: a.record(start))
        blocked += _host_seconds(backend, lambda: a.copy_h2d(dst, 0, host, 0, copy1))
        blocked += _host_seconds(backend, lambda: a.record(e1))
        if wait == "before":
            blocked += _host_seconds(backend, consumer)
        blocked += _host_seconds(backend, lambda: a.copy_h2d(dst, copy1, host, copy1, copy2))
        if wait == "after":
            blocked += _host_seconds(backend, consumer)
        released.synchronize()
        seen = backend.host.timestamp() - begun
        a.synchronize()
        return start.elapsed_ms(released) / 1e3, seen, blocked


def _host_copies(
    backend: Backend,
    device: Device,
    stream: Stream,
    source: _Cycle,
    thread_counts: Sequence[int],
    bounds: Bounds,
) -> list[HostCopyTiming]:
    """The staging ring's fills on 1..N threads: memcpys from the mapping into pinned memory as
    large as the ring's chunks together, while DMAs keep the bus busy as the ring's own do.

    One pass over the range first: in the job the ring reads pages the process has mapped
    already (the warm-up run read them), so the timed passes do not pay for first touch.
    """
    nbytes = min(DEFAULT_RING_CHUNK_BYTES * DEFAULT_RING_CHUNKS, bounds.ring_bytes)
    chunk = min(DEFAULT_RING_CHUNK_BYTES, nbytes)
    offset = source.take(nbytes)
    rows = []
    with device.alloc_pinned(nbytes) as chunks, device.alloc_pinned(chunk) as busy, device.alloc(chunk) as dst:
        for warm_up, threads in [(True, max(thread_counts)), *((False, t) for t in sorted(set(thread_counts)))]:
            # One executor per thread: each part has its own thread (and, on the simulator, its own clock).
            workers = [
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertstream-tune") for _ in range(threads)
            ]
            try:
                trials = []
                for _ in range(1 if warm_up else bounds.repeats):
                    for _ in range(nbytes // chunk * 4):
                        stream.copy_h2d(dst, 0, busy, 0, chunk)
                    trials.append(_parallel_copy(backend, workers, chunks, source.buffer, offset))
                    stream.synchronize()
            finally:
                for worker in workers:
                    worker.shutdown()
            if not warm_up:
                rows.append(HostCopyTiming(threads, nbytes, statistics.median(trials)))
    return rows


def _parallel_copy(
    backend: Backend,
    workers: Sequence[ThreadPoolExecutor],
    dst: HostBuffer,
    src: HostBuffer,
    src_offset: int,
) -> float:
    """Seconds for ``workers`` to fill ``dst`` from ``src``, one equal part each, all at once."""
    start = backend.host.timestamp()
    nbytes = dst.nbytes
    step = -(-nbytes // len(workers))
    offsets = range(0, nbytes, step)

    def part(offset: int) -> float:
        backend.host.resume_at(start)  # the handoff: each thread starts when the caller did
        backend.host.copy(dst, offset, src, src_offset + offset, min(step, nbytes - offset), sharing=len(offsets))
        return backend.host.timestamp()

    parts = [worker.submit(part, offset) for worker, offset in zip(workers, offsets, strict=False)]
    ends = [p.result() for p in parts]
    for end in ends:
        backend.host.resume_at(end)
    return max(ends) - start


def ring_stream(
    backend: Backend, device: Device, stream: Stream, host: HostBuffer, offset: int, nbytes: int, threads: int
) -> float:
    """Seconds for a staging ring of the job's chunk geometry on ``threads`` threads to copy
    ``host[offset : offset + nbytes]`` to the device, announced as a run announces its copies:
    memcpys into pinned chunks and their DMAs overlapped, as --host-memory ring does."""
    with (
        device.alloc(nbytes) as dst,
        StagingRing(
            host,
            chunk_bytes=DEFAULT_RING_CHUNK_BYTES,
            chunks=DEFAULT_RING_CHUNKS,
            threads=threads,
            fill=RingFill.THREADS,
        ) as ring,
    ):
        region = ring.region(offset, nbytes)
        start = backend.host.timestamp()
        ring.expect([region])
        region.enqueue_h2d(stream, dst, 0, 0, nbytes)
        stream.synchronize()
        return backend.host.timestamp() - start


def ring_small_copies(
    backend: Backend, device: Device, stream: Stream, host: HostBuffer, offset: int, nbytes: int, copies: int
) -> float:
    """Seconds per copy of ``nbytes`` through a staging ring, none announced: a decode step's copies
    of the experts it uses, each filled by one ring thread and then DMAed.

    The copies read every other ``nbytes`` of ``host`` from ``offset`` (``2 * copies * nbytes`` in
    all), so that no two are adjacent, as a decode step's experts seldom are.
    """
    with (
        device.alloc(nbytes) as dst,
        StagingRing(
            host,
            chunk_bytes=DEFAULT_RING_CHUNK_BYTES,
            chunks=DEFAULT_RING_CHUNKS,
            threads=default_ring_threads(device),
            fill=RingFill.THREADS,
        ) as ring,
    ):

        def run() -> None:
            for i in range(copies):
                ring.copy(stream, dst, 0, offset + 2 * i * nbytes, nbytes)
            stream.synchronize()

        run()  # warm-up: the ring's threads start, the pages are mapped
        return _host_seconds(backend, run) / copies


def _kernels(
    backend: Backend,
    device: Device,
    stream: Stream,
    kernels: MoeKernels,
    gate: Gate,
    shape: ModelShape,
    ubatch: int,
    bounds: Bounds,
) -> list[KernelTiming]:
    """The runner's kernels at one ubatch: router, stand-ins, elementwise, and mul_mat_id per expert tensor."""
    rng = np.random.default_rng(ubatch)
    k, n_embd, n_ff, n_expert = shape.top_k, shape.n_embd, shape.n_ff, shape.n_expert
    pairs = ubatch * k
    data = device.backend.host.holds_data
    ids = np.argsort(rng.random((ubatch, n_expert)), axis=1)[:, :k].astype(np.int32) if data else None

    def normal(*shape: int) -> np.ndarray | None:
        return rng.standard_normal(shape, dtype=np.float32) if data else None

    widest = max(n_embd, n_ff)
    rows = []
    with contextlib.ExitStack() as stack:

        def buf(values: np.ndarray | None, nbytes: int) -> DeviceBuffer:
            return stack.enter_context(_device_buffer(device, values, nbytes))

        x = buf(normal(pairs, widest), pairs * widest * 4)
        y = buf(None, pairs * widest * 4)
        z = buf(None, pairs * widest * 4)
        ids_buf = buf(ids, pairs * 4)
        route = buf(None, pairs * 4)
        router = buf(normal(n_expert, n_embd), n_expert * n_embd * 4)

        def time(
            name: str,
            launch: Callable[[], None],
            flops: float,
            shape: tuple[int, ...] = (),
            size: float | None = None,
            launches: int = 1,
            other_flops: float = 0.0,
        ) -> None:
            per_call, _ = back_to_back(backend, device, stream, gate, launch, bounds.launches)
            rows.append(
                KernelTiming(name, shape, flops if size is None else size, flops, per_call, launches, other_flops)
            )

        tokens = ubatch * n_embd
        time(
            "moe_rms_norm",
            lambda: standin.rms_norm(kernels, stream, x.view(0, tokens * 4), y.view(0, tokens * 4), ubatch, n_embd),
            3.0 * tokens,
        )
        if n_expert <= layout.ROUTER_MAX_EXPERTS and k <= layout.ROUTER_MAX_K:  # else the runner routes otherwise
            # router_topk's two launches, each under its kernel's name (the simulator rates kernels by
            # name): the logits first, whose bytes the selection then reads.
            logits = y.view(0, ubatch * n_expert * 4)
            time(
                "moe_router_logits",
                lambda: routing.router_logits(
                    kernels, stream, x.view(), router.view(), None, logits, ubatch, n_embd, n_expert
                ),
                2.0 * ubatch * n_embd * n_expert,
            )
            time(
                "moe_router_select",
                lambda: routing.router_select(
                    kernels,
                    stream,
                    logits,
                    None,
                    routing.SELECTED_SOFTMAX,
                    ubatch,
                    n_expert,
                    k,
                    ids_buf.view(),
                    route.view(),
                ),
                8.0 * ubatch * n_expert * k,
            )
        n = pairs * n_ff
        time("moe_swiglu", lambda: kernels.swiglu(stream, x.view(), y.view(), z.view(), n), 4.0 * n)
        time(
            "moe_combine",
            lambda: kernels.combine(stream, x.view(), route.view(), None, y.view(0, tokens * 4), ubatch, k, n_embd),
            2.0 * pairs * n_embd,
        )
        for expert in shape.experts:
            w = stack.enter_context(expert_weights(device, rng, expert.w_type, expert.n_out, expert.n_in, n_expert))
            x_rows = pairs if expert.x_per_pair else ubatch

            def mul_mat_id(expert: ExpertShape = expert, w: DeviceBuffer = w, x_rows: int = x_rows) -> None:
                kernels.mul_mat_id(
                    stream,
                    w.view(),
                    expert.w_type,
                    n_expert,
                    expert.n_out,
                    expert.n_in,
                    x.view(0, x_rows * expert.n_in * 4),
                    expert.x_per_pair,
                    ids_buf.view(),
                    ubatch,
                    k,
                    y.view(0, pairs * expert.n_out * 4),
                )

            # The matrix kernel; before it the grouping kernels (the simulator charges each one flop
            # per pair) and the activation quantizer on the int8 path or the bf16 rounding of the
            # direct kernels.
            quantized = kernels.path_for(expert.w_type) is layout.MatrixPath.INT8
            rounded = kernels.uses_direct(expert.w_type, expert.n_in)
            time(
                kernels.mul_mat_id_kernel(expert.w_type, pairs, n_expert, expert.n_in),
                mul_mat_id,
                2.0 * pairs * expert.n_out * expert.n_in,
                shape=(expert.n_out, expert.n_in),
                size=pairs / n_expert,
                launches=1 + layout.GROUP_LAUNCHES + (1 if quantized or rounded else 0),
                other_flops=layout.GROUP_LAUNCHES * float(pairs)
                + (3.0 * x_rows * expert.n_in if quantized else 0.0)
                + (float(x_rows * expert.n_in) if rounded else 0.0),
            )
    return rows


@contextlib.contextmanager
def expert_weights(
    device: Device, rng: np.random.Generator, w_type: RowType, n_out: int, n_in: int, n_expert: int
) -> Iterator[DeviceBuffer]:
    """An [n_expert][n_out][n_in] tensor of ``w_type``: one random expert repeated (speed does not
    depend on the values), with its padded tail zeroed; zeros where the backend holds no data."""
    fmt = weight_format(w_type)
    nbytes = n_expert * n_out * fmt.row_bytes(n_in)
    buf = device.alloc(nbytes, Usage.WEIGHTS, row_type=w_type, ne0=n_in)
    try:
        with device.stream() as stream:
            stream.memset(buf, 0, buf.alloc_size, 0)
            stream.synchronize()
        if device.backend.host.holds_data:
            one = ref.random_weights(rng, w_type, n_out, n_in).reshape(-1)
            buf.write(np.tile(one, n_expert))
        yield buf
    finally:
        buf.close()
