"""Simulated streams and events: each primitive becomes one Work item for the simulation core."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import DeviceError, InvalidArgument, UseAfterClose
from ...timeline import OpKind
from ..base import (
    Backend,
    BufferView,
    Device,
    DeviceBuffer,
    Event,
    Graph,
    HostBuffer,
    HostMemory,
    Kernel,
    RowGather,
    Stream,
)
from .core import CapturedEvent, Recorded, StreamState, Work
from .engine import EngineKind
from .hazards import HazardKind, SimHazardError, Touch
from .kernels import Access, SimKernel
from .memory import SimDeviceBuffer

if TYPE_CHECKING:
    from .device import SimDevice


# A fill kernel runs on its stream's queue beside other streams' kernels: it takes no engine that
# kernels wait for (booking it on the compute engine made a tail clear enqueued on a copy stream
# hold back kernels that were ready before it).
_MEMSET_ENGINE: dict[str, EngineKind | None] = {"fill-kernel": None, "copy-engine": EngineKind.D2D}


def _device_bytes(buf: DeviceBuffer, offset: int, n: int) -> np.ndarray | None:
    array = buf.array if isinstance(buf, SimDeviceBuffer) else None
    return None if array is None else array[offset : offset + n]


def _host_touch(host: HostBuffer, offset: int, n: int, *, write: bool, blocks_host: bool) -> tuple[Touch, ...]:
    # The DMA reads or writes page-locked memory after the call returns; pageable bytes are
    # staged (or the call waits), so the caller may reuse or free them at once.
    deferred = host.is_page_locked or (write and not blocks_host)
    return (Touch(host, offset, offset + n, write=write),) if deferred else ()


def check_own_host(user: Device | Backend, host: HostBuffer, call: str) -> None:
    """Refuse host memory another simulator handed out (``user``: the device or backend using it).

    Each simulator keeps its own hazard checker and host clocks: a DMA here from another's pinned
    buffer would be seen by neither against the host refilling it through the other. Refused
    rather than tracked across both: real pinned memory belongs to its runtime's context too
    (CUDA lets other contexts of one process use it, which no test needs the simulator to model).
    """
    mine = user if isinstance(user, Backend) else user.backend
    theirs = host.device.backend
    if theirs is not mine:
        used_by = f"backend {mine.instance_name}"
        if isinstance(user, Device):
            used_by = f"{user.label} of {used_by}"
        raise InvalidArgument(
            f"{host!r} is host memory of backend {theirs.instance_name}, used by {used_by}",
            call=call,
            device=user.label if isinstance(user, Device) else None,
            hint="allocate or wrap host memory through a device of the backend that uses it",
        )


def _copy_effect(dst: np.ndarray | None, src: np.ndarray | None) -> Callable[[], None] | None:
    if dst is None or src is None:
        return None
    return functools.partial(np.copyto, dst, src)


# What a capture holds, in enqueue order: the stream (its state's id) and its work, record or wait.
_Captured = tuple[int, Work | CapturedEvent]


class SimStream(Stream):
    def __init__(self, device: SimDevice, state: StreamState, *, owned: bool = True) -> None:
        super().__init__(device, owned=owned)
        self.sim_device = device
        self.state = state
        self._sim = device.sim
        self._captured: list[_Captured] = []  # the origin's, for every stream of its capture

    @property
    def handle(self) -> int:
        return self.state.id

    @property
    def name(self) -> str:
        return self.state.name

    def _copy_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, src_offset: int, n: int) -> None:
        check_own_host(self.sim_device, src, "Stream.copy_h2d")
        profile = self._sim.profile
        pageable = src.kind is HostMemory.PAGEABLE
        blocks_host = pageable and profile.pageable_blocks_host
        source = src.array[src_offset : src_offset + n]
        if self._sim.data and pageable and not profile.pageable_blocks_host:
            source = source.copy()  # the runtime stages pageable bytes before the call returns
        self._submit(
            Work(
                OpKind.H2D,
                f"h2d {src.kind.value}",
                "h2d copy",
                "Stream.copy_h2d",
                n,
                EngineKind.H2D,
                profile.copy_latency_s + (profile.h2d_pageable_latency_s if pageable else 0.0),
                n / (profile.h2d_pageable_bps if pageable else profile.h2d_pinned_bps),
                blocks_host=blocks_host,
                pageable=pageable,
                effect=_copy_effect(_device_bytes(dst, dst_offset, n), source),
                touches=(
                    Touch(dst, dst_offset, dst_offset + n, write=True),
                    *_host_touch(src, src_offset, n, write=False, blocks_host=blocks_host),
                ),
            )
        )

    def _copy_d2h(self, dst: HostBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, n: int) -> None:
        check_own_host(self.sim_device, dst, "Stream.copy_d2h")
        profile = self._sim.profile
        pageable = dst.kind is HostMemory.PAGEABLE
        blocks_host = pageable and profile.pageable_blocks_host
        self._submit(
            Work(
                OpKind.D2H,
                f"d2h {dst.kind.value}",
                "d2h copy",
                "Stream.copy_d2h",
                n,
                EngineKind.D2H,
                profile.copy_latency_s,
                n / (profile.d2h_pageable_bps if pageable else profile.d2h_bps),
                blocks_host=blocks_host,
                pageable=pageable,
                effect=_copy_effect(dst.array[dst_offset : dst_offset + n], _device_bytes(src, src_offset, n)),
                touches=(
                    Touch(src, src_offset, src_offset + n, write=False),
                    *_host_touch(dst, dst_offset, n, write=True, blocks_host=blocks_host),
                ),
            )
        )

    def _copy_d2d(self, dst: DeviceBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, n: int) -> None:
        profile = self._sim.profile
        peer = dst.device is not self.device or src.device is not self.device
        self._submit(
            Work(
                OpKind.D2D,
                "d2d peer" if peer else "d2d",
                "d2d copy",
                "Stream.copy_d2d",
                n,
                EngineKind.D2D,
                profile.copy_latency_s,
                n / (profile.peer_bps if peer else profile.d2d_bps),
                effect=_copy_effect(_device_bytes(dst, dst_offset, n), _device_bytes(src, src_offset, n)),
                touches=(
                    Touch(src, src_offset, src_offset + n, write=False),
                    Touch(dst, dst_offset, dst_offset + n, write=True),
                ),
            )
        )

    def _memset(self, dst: DeviceBuffer, offset: int, n: int, value: int) -> None:
        profile = self._sim.profile
        target = _device_bytes(dst, offset, n)
        self._submit(
            Work(
                OpKind.MEMSET,
                f"memset {value:#04x}",
                "memset",
                "Stream.memset",
                n,
                _MEMSET_ENGINE[profile.memset_engine],
                profile.launch_latency_s,
                n / profile.memset_bps,
                effect=None if target is None else functools.partial(target.fill, value),
                touches=(Touch(dst, offset, offset + n, write=True),),
                zero_fill=value == 0,
            )
        )

    def _gather_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, rows: RowGather) -> None:
        # A kernel that reads over the link: booked on the link's engine, beside other streams' kernels.
        # Its time is computed at enqueue, before the ids exist: every id counted as its own row.
        check_own_host(self.sim_device, src, "Stream.gather_h2d")
        profile = self._sim.profile
        effect = None
        if self._sim.data:
            ids = _device_bytes(rows.ids.buffer, rows.ids.offset, 4 * rows.n_ids)
            region = _device_bytes(dst, dst_offset, rows.dst_nbytes)
            assert ids is not None and region is not None
            source = src.array[rows.src_offset : rows.src_offset + rows.nbytes]
            report = None if rows.report is None else _device_bytes(rows.report.buffer, rows.report.offset, 8)
            skip = None if rows.skip is None else _device_bytes(rows.skip.buffer, rows.skip.offset, 4 * rows.n_skip)
            slot_ids = (
                None if rows.slots is None else _device_bytes(rows.slots.buffer, rows.slots.offset, 4 * rows.n_ids)
            )
            effect = functools.partial(_gather_rows, region, source, ids, rows, report, skip, slot_ids)
        reported = rows.report
        report_touch = (
            () if reported is None else (Touch(reported.buffer, reported.offset, reported.offset + 8, write=True),)
        )
        skipped = rows.skip
        skip_touch = (
            ()
            if skipped is None
            else (Touch(skipped.buffer, skipped.offset, skipped.offset + 4 * rows.n_skip, write=False),)
        )
        slots = rows.slots
        slots_touch = () if slots is None else (Touch(slots.buffer, slots.offset, slots.offset + 4 * rows.n_ids, True),)
        written_from = dst_offset + (rows.n_skip * rows.row_nbytes if rows.packed else 0)
        # Booked at enqueue, before the ids exist: every id its own row, less the skipped ids the
        # profile expects among them (a predicted expert the router also chose).
        booked = max(rows.n_ids - profile.lookahead_hit * min(rows.n_skip, rows.n_ids), 0.0) / max(rows.n_ids, 1)
        self._submit(
            Work(
                OpKind.H2D,
                "gather h2d",
                "h2d gather",
                "Stream.gather_h2d",
                rows.most_bytes,
                EngineKind.H2D,
                profile.launch_latency_s,
                booked * rows.most_bytes / profile.gather_bps,
                effect=effect,
                touches=(
                    Touch(rows.ids.buffer, rows.ids.offset, rows.ids.offset + 4 * rows.n_ids, write=False),
                    Touch(dst, written_from, dst_offset + rows.dst_nbytes, write=True),
                    Touch(src, rows.src_offset, rows.src_offset + rows.nbytes, write=False),
                    *report_touch,
                    *skip_touch,
                    *slots_touch,
                ),
            )
        )

    def _record(self, event: Event) -> None:
        assert isinstance(event, SimEvent)
        state = self._live_state("Stream.record")
        if self.capturing:
            event.recorded, event.capture_key = None, next(_capture_keys)
            self._capture(CapturedEvent(event.capture_key, wait=False))
            return
        event.recorded, event.capture_key = self._sim.record(state, "record"), None

    def _wait(self, event: Event) -> None:
        assert isinstance(event, SimEvent)
        if self.capturing:  # the contract let only this capture's records through
            assert event.capture_key is not None
            self._live_state("Stream.wait")
            self._capture(CapturedEvent(event.capture_key, wait=True))
            self.sim_device.capturing_streams.add(self.state.id)  # a fork joins with its first wait
            return
        # A wait binds to the record current now; a later re-record does not move it.
        name = "wait" if event.recorded is not None else "wait (never recorded: no-op)"
        work = Work(OpKind.WAIT, name, "event wait", "Stream.wait")
        self._sim.submit(self._live_state(work.call), work, event.recorded)

    def _launch(
        self,
        kernel: Kernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int,
    ) -> None:
        assert isinstance(kernel, SimKernel)
        spec = kernel.spec
        call = f"Stream.launch({spec.name})"
        touches = tuple(self._touch(call, access) for access in spec.accesses(args))
        effect = None
        if self._sim.data:
            arrays = tuple(_argument_bytes(a) for a in args)
            effect = functools.partial(_run_twin, spec.run, spec.name, arrays, grid, block, self.device.label)
        profile = self._sim.profile
        self._submit(
            Work(
                OpKind.KERNEL,
                spec.name,
                f"kernel {spec.name!r}",
                call,
                0,
                EngineKind.COMPUTE,
                profile.launch_latency_s,
                spec.seconds(args, profile),
                effect=effect,
                touches=touches,
            )
        )

    def _touch(self, call: str, access: Access) -> Touch:
        if not isinstance(access, Access) or not isinstance(access.view, BufferView):
            raise InvalidArgument(
                f"the kernel twin's accesses must be Access objects over BufferViews, got {access!r}",
                call=call,
                device=self.device.label,
                hint="use Access(buffer.view(offset, nbytes), write=...)",
            )
        view, buf = access.view, access.view.buffer
        if buf.closed:
            raise UseAfterClose(f"{buf!r} is closed", call=call, device=self.device.label)
        if not self.device.can_access_peer(buf.device):
            raise SimHazardError(
                HazardKind.CROSS_DEVICE,
                f"cross-device hazard: the kernel touches {buf!r} bytes [{view.offset}, {view.end}) on "
                f"{buf.device.label}, which {self.device.label} cannot access",
                call=call,
                device=self.device.label,
                hint="allocate it on the launching device or enable peer access",
            )
        return Touch(buf, view.offset, view.end, access.write, access.padded_from)

    def _submit(self, work: Work) -> None:
        state = self._live_state(work.call)
        if self.capturing:
            self._capture(work)
            return
        self._sim.submit(state, work)

    def _capture(self, item: Work | CapturedEvent) -> None:
        origin = self.capture_origin
        assert isinstance(origin, SimStream)
        self._sim.capture_call()
        origin._captured.append((self.state.id, item))

    def _begin_capture(self) -> None:
        self._live_state("Stream.begin_capture")
        self._captured = []
        self.sim_device.capturing_streams.add(self.state.id)

    def _end_capture(self, keep: bool) -> Graph | None:
        items, self._captured = self._captured, []
        lanes = {sid for sid, _ in items} - {self.state.id}
        self.sim_device.capturing_streams.difference_update({self.state.id, *lanes})
        unjoined = _unjoined(items, self.state.id)
        if unjoined:
            # What CUDA and HIP answer: the capture is invalidated.
            raise DeviceError(
                f"{len(unjoined)} stream(s) forked into the capture never joined it back",
                call="Stream.end_capture",
                device=self.device.label,
                code="stream capture unjoined",
                hint="end each forked stream's work with a record that a stream of the capture waits on",
            )
        return SimGraph(self.sim_device, items, self.state.id) if keep else None

    def _live_state(self, call: str) -> StreamState:
        if self.state.destroyed:  # only a from_handle wrapper can outlive its stream
            raise UseAfterClose(
                f"the stream behind handle {self.state.id} was destroyed", call=call, device=self.device.label
            )
        return self.state

    def synchronize(self) -> None:
        self._refuse_while_capturing("Stream.synchronize")
        self._sim.synchronize_stream(self.state)

    def query(self) -> bool:
        self._refuse_while_capturing("Stream.query")
        return self._sim.query_stream(self.state)

    def _refuse_while_capturing(self, call: str) -> None:
        # What CUDA and HIP answer with an error that also ends the capture.
        if self.capturing:
            raise DeviceError(
                "operation not permitted when stream is capturing",
                call=call,
                device=self.device.label,
                code="stream capture unsupported",
                hint="end the capture before waiting for the stream",
            )

    def _destroy(self) -> None:
        self.state.destroyed = True  # enqueued work still completes, as on a real device
        self.sim_device.capturing_streams.discard(self.state.id)  # a capture ends with its stream


def _argument_bytes(arg: Any) -> Any:
    if isinstance(arg, BufferView):
        array = _device_bytes(arg.buffer, arg.offset, arg.nbytes)
    elif isinstance(arg, DeviceBuffer):
        array = _device_bytes(arg, 0, arg.alloc_size)
    else:
        return arg
    assert array is not None  # data mode: every simulated buffer has its bytes
    return array


def _gather_rows(
    region: np.ndarray,
    source: np.ndarray,
    ids: np.ndarray,
    rows: RowGather,
    report: np.ndarray | None,
    skip: np.ndarray | None,
    slots: np.ndarray | None,
) -> None:
    """gather.cu's copy: each distinct id's row at its own offset, or, packed, at ``rows.dst_row`` of
    the id's first position (a skipped id's at its first position among the skipped ids; a packed row
    nothing goes to gets the bytes read past the row before it zeroed)."""
    skipped = [] if skip is None else skip.view(np.int32).tolist()
    first_met: dict[int, int] = {}
    slot_of = np.zeros(rows.n_ids, np.int32)
    size = rows.row_nbytes
    for j, row in enumerate(ids.view(np.int32).tolist()):
        if not 0 <= row < rows.n_rows:
            _report(report, rows.tag, row)
        elif row in skipped:
            slot_of[j] = skipped.index(row)  # copied ahead
        elif (met := first_met.setdefault(row, j)) != j:
            slot_of[j] = rows.dst_row(met)  # copied for the id first met
        elif rows.packed:
            slot_of[j] = rows.dst_row(j)
            region[slot_of[j] * size : (slot_of[j] + 1) * size] = source[row * size : (row + 1) * size]
            continue
        else:
            start, end = rows.row_range(row)
            region[start:end] = source[start:end]
            continue
        if rows.packed:
            at = rows.dst_row(j) * size
            region[at : at + min(rows.overrun, size)] = 0
    if slots is not None:
        slots.view(np.int32)[:] = slot_of


def _report(report: np.ndarray | None, tag: int, row: int) -> None:
    """The first id naming no row, where the gather was asked to report it."""
    if report is not None:
        pair = report.view(np.int32)
        if pair[0] == -1:
            pair[:] = (tag, row)


def _run_twin(
    run: Callable[..., None],
    name: str,
    args: tuple[Any, ...],
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    device: str,
) -> None:
    try:
        run(args, grid, block)
    except Exception as exc:
        raise DeviceError(f"the Python twin of kernel {name!r} failed: {exc!r}", call="kernel", device=device) from exc


_capture_keys = itertools.count()


def _unjoined(items: list[_Captured], origin: int) -> set[int]:
    """The forked streams of a capture whose last work is not a record some other stream waited on after."""
    last: dict[int, int] = {}  # stream -> index of its last item
    for index, (sid, _) in enumerate(items):
        last[sid] = index
    waited_after: dict[int, int] = {}  # record key -> index of the first wait on it
    for index, (_, item) in enumerate(items):
        if isinstance(item, CapturedEvent) and item.wait:
            waited_after.setdefault(item.key, index)
    unjoined = set()
    for sid, index in last.items():
        if sid == origin:
            continue
        item = items[index][1]
        joined = isinstance(item, CapturedEvent) and not item.wait and waited_after.get(item.key, -1) > index
        if not joined:
            unjoined.add(sid)
    return unjoined


class SimGraph(Graph):
    """The operations a capture recorded, each enqueued again (effects and hazard checks included) per launch.

    Work of streams forked into the capture runs on streams of the graph's own, beside the
    launching stream, ordered against it by the captured records and waits.
    """

    def __init__(self, device: SimDevice, items: list[_Captured], origin: int) -> None:
        super().__init__(device, sum(1 for _, item in items if isinstance(item, Work)))
        self._sim = device.sim
        self._items = items
        self._origin = origin
        forked = dict.fromkeys(sid for sid, _ in items if sid != origin)
        self._lanes = {
            sid: self._sim.new_stream(device.index, device.label, f"graph fork {n}") for n, sid in enumerate(forked)
        }

    def _launch(self, stream: Stream) -> None:
        assert isinstance(stream, SimStream)
        lanes = {**self._lanes, self._origin: stream._live_state("Graph.launch")}
        self._sim.launch_graph(lanes, self._items)

    def _destroy(self) -> None:
        self._items = []


class SimEvent(Event):
    def __init__(self, device: SimDevice, timing: bool) -> None:
        super().__init__(device, timing)
        self._sim = device.sim
        self.recorded: Recorded | None = None
        self.capture_key: int | None = None  # recorded inside a capture: the graph's record it names

    def query(self) -> bool:
        return self._sim.query_event(self.recorded)

    def synchronize(self) -> None:
        self._sim.synchronize_event(self.recorded)

    def _elapsed_ms(self, end: Event) -> float:
        assert isinstance(end, SimEvent)
        call = "Event.elapsed_ms"
        if self.recorded is None or end.recorded is None:
            raise DeviceError(
                "both events must have been recorded",
                call=call,
                device=self.device.label,
                code="invalid handle",
                hint="record both events before asking for the time between",
            )
        if not (self.query() and end.query()):
            raise DeviceError(
                "the events have not completed yet",
                call=call,
                device=self.device.label,
                code="not ready",
                hint="synchronize the later event first",
            )
        return (end.recorded.time - self.recorded.time) * 1e3

    def _destroy(self) -> None:
        self.recorded = None


__all__ = ["SimEvent", "SimGraph", "SimStream"]
