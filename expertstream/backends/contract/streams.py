"""The contract's queues of device work: streams, events, kernels and captured graphs.

Every enqueue is validated here once, for every backend (open objects, host vs device
arguments, byte ranges, devices), then handed to a backend's ``_primitive``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._closing import Closing
from ...errors import HazardError, InvalidArgument, UseAfterClose
from ...timeline import OpKind
from ..dlpack import DLDeviceType, ProducerStream
from .memory import BufferView, DeviceBuffer, HostBuffer, RowGather, check_range

if TYPE_CHECKING:
    from .devices import Device


KernelArg = DeviceBuffer | BufferView | np.integer | np.floating


def _check_kinds(call: str, dst: object, dst_type: type, src: object, src_type: type | None) -> None:
    """Refuse a device buffer where host memory is expected, and the reverse.

    An unchecked is_host once handed device pointers to host-to-device copies.
    """
    for role, obj, expected in (("destination", dst, dst_type), ("source", src, src_type)):
        if expected is not None and not isinstance(obj, expected):
            raise InvalidArgument(
                f"{role} must be a {expected.__name__}, got {type(obj).__name__}",
                call=call,
                hint="host data goes through HostBuffer (device.wrap_host / alloc_pinned), device data through "
                "DeviceBuffer",
            )


class Event(abc.ABC, Closing):
    """A marker in a stream. Waits bind to the most recent record at the time they are enqueued."""

    def __init__(self, device: Device, timing: bool, *, owned: bool = True) -> None:
        self.device = device
        self.timing = timing
        self.owned = owned  # False for events wrapped with event_from: close() leaves them alone
        self.closed = False
        # The origin stream of the capture the event was last recorded in (None: recorded outside one).
        self.captured_in: Stream | None = None

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the recorded work is done (or the event was never recorded)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the recorded work is done."""

    @abc.abstractmethod
    def _elapsed_ms(self, end: Event) -> float: ...

    @abc.abstractmethod
    def _destroy(self) -> None: ...

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; both must be timing events."""
        if not (self.timing and end.timing):
            raise InvalidArgument(
                "elapsed time needs timing events", call="Event.elapsed_ms", hint="create with event(timing=True)"
            )
        self._check_open("Event.elapsed_ms")
        end._check_open("Event.elapsed_ms")
        return self._elapsed_ms(end)

    def close(self) -> None:
        """Destroy the event; events from event_from are left alone."""
        if not self.closed:
            if self.owned:
                self._destroy()
            self.closed = True

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise UseAfterClose("event is closed", call=call, device=self.device.label)


class Kernel:
    """A compiled kernel bound to one device."""

    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.name = name

    def __repr__(self) -> str:
        return f"Kernel({self.name!r} on {self.device.label})"


Dim3 = int | Sequence[int]


def dim3(d: Dim3) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(t) <= 3 or any(int(x) < 1 for x in t):
        raise InvalidArgument(f"grid and block sizes must be 1..3 positive integers, got {d!r}")
    return (int(t[0]), int(t[1]) if len(t) > 1 else 1, int(t[2]) if len(t) > 2 else 1)


class Graph(abc.ABC, Closing):
    """Work captured from a stream (Stream.begin_capture .. end_capture), run again with one launch.

    A graph holds the addresses its work was captured with: the buffers it reads and writes must
    stay open, and hold what the work expects, for as long as it is launched.
    """

    def __init__(self, device: Device, operations: int) -> None:
        self.device = device
        self.operations = operations  # the work captured (the records and waits of events only order it)
        self.closed = False

    @abc.abstractmethod
    def _launch(self, stream: Stream) -> None: ...

    @abc.abstractmethod
    def _destroy(self) -> None: ...

    def launch(self, stream: Stream) -> None:
        """Enqueue everything the graph captured on ``stream``, in the captured order."""
        call = "Graph.launch"
        if self.closed:
            raise UseAfterClose("graph is closed", call=call, device=self.device.label)
        stream._check_open(call)
        if stream.device is not self.device:
            raise InvalidArgument(
                f"the graph was captured on {self.device.label}", call=call, device=stream.device.label
            )
        if stream.capturing:
            raise InvalidArgument("cannot launch a graph into a capture", call=call, device=self.device.label)
        stream._traced(OpKind.KERNEL, f"graph of {self.operations} calls", 0, lambda: self._launch(stream))

    def close(self) -> None:
        """Release the graph; launches already enqueued still run."""
        if not self.closed:
            self._destroy()
            self.closed = True


class Stream(ProducerStream, Closing):
    """An in-order queue of device work. Every enqueue returns at once unless noted."""

    def __init__(self, device: Device, *, owned: bool = True) -> None:
        self.device = device
        self.owned = owned  # False for streams wrapped with from_handle: close() leaves them alone
        self.closed = False
        self.capturing = False  # between begin_capture and end_capture: work is recorded, not run
        # While capturing: the stream whose begin_capture started the capture (itself, or the one
        # whose captured event this stream waited on: it joined that capture).
        self.capture_origin: Stream | None = None
        self._joined: list[Stream] = []  # an origin's streams that joined its capture

    # -- primitives each backend implements (arguments already validated) -------------
    @property
    @abc.abstractmethod
    def handle(self) -> int:
        """The native stream handle (cudaStream_t / hipStream_t value), for interop."""

    @abc.abstractmethod
    def _copy_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, src_offset: int, n: int) -> None: ...

    @abc.abstractmethod
    def _copy_d2h(self, dst: HostBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, n: int) -> None: ...

    @abc.abstractmethod
    def _copy_d2d(self, dst: DeviceBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, n: int) -> None: ...

    @abc.abstractmethod
    def _memset(self, dst: DeviceBuffer, offset: int, n: int, value: int) -> None: ...

    @abc.abstractmethod
    def _gather_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, rows: RowGather) -> None: ...

    @abc.abstractmethod
    def _begin_capture(self) -> None: ...

    @abc.abstractmethod
    def _end_capture(self, keep: bool) -> Graph | None: ...

    @abc.abstractmethod
    def _record(self, event: Event) -> None: ...

    @abc.abstractmethod
    def _wait(self, event: Event) -> None: ...

    @abc.abstractmethod
    def _launch(
        self,
        kernel: Kernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int,
    ) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work enqueued so far is done."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when all work enqueued so far is done."""

    @abc.abstractmethod
    def _destroy(self) -> None: ...

    # -- the public, validated API ------------------------------------------------------
    def copy_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, src_offset: int, nbytes: int) -> None:
        """Copy host -> device (ggml's async set_tensor). From pageable memory this may block the host."""
        call = "Stream.copy_h2d"
        self._check_h2d(call, dst, dst_offset, src, src_offset, nbytes)
        self._check_capturable(call, src)
        if nbytes:
            self._traced(
                OpKind.H2D, "copy_h2d", nbytes, lambda: self._copy_h2d(dst, dst_offset, src, src_offset, nbytes)
            )

    def copy_d2h(self, dst: HostBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> None:
        call = "Stream.copy_d2h"
        self._check_open(call)
        _check_kinds(call, dst, HostBuffer, src, DeviceBuffer)
        check_range(call, dst, dst_offset, nbytes)
        check_range(call, src, src_offset, nbytes)
        self._check_same_device(call, src)
        self._check_capturable(call, dst)
        if dst.read_only:
            raise InvalidArgument("cannot copy into read-only host memory", call=call, device=self.device.label)
        if nbytes:
            self._traced(
                OpKind.D2H, "copy_d2h", nbytes, lambda: self._copy_d2h(dst, dst_offset, src, src_offset, nbytes)
            )

    def copy_d2d(self, dst: DeviceBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> None:
        """Copy device -> device; across devices it needs peer access enabled."""
        call = "Stream.copy_d2d"
        self._check_open(call)
        _check_kinds(call, dst, DeviceBuffer, src, DeviceBuffer)
        check_range(call, dst, dst_offset, nbytes)
        check_range(call, src, src_offset, nbytes)
        for buf in (dst, src):
            if not self.device.can_access_peer(buf.device):
                raise InvalidArgument(
                    f"{buf!r} is on {buf.device.label} and {self.device.label} has no peer access to it",
                    call=call,
                    device=self.device.label,
                    hint="call enable_peer_access() first, or stage the copy through host memory",
                )
        if nbytes:
            self._traced(
                OpKind.D2D, "copy_d2d", nbytes, lambda: self._copy_d2d(dst, dst_offset, src, src_offset, nbytes)
            )

    def memset(self, dst: DeviceBuffer, offset: int, nbytes: int, value: int = 0) -> None:
        call = "Stream.memset"
        self._check_open(call)
        _check_kinds(call, dst, DeviceBuffer, None, None)
        check_range(call, dst, offset, nbytes)
        self._check_same_device(call, dst)
        if not 0 <= value <= 255:
            raise InvalidArgument(f"memset value {value} is not a byte", call=call, device=self.device.label)
        if nbytes:
            self._traced(OpKind.MEMSET, "memset", nbytes, lambda: self._memset(dst, offset, nbytes, value))

    def gather_h2d(
        self,
        dst: DeviceBuffer,
        dst_offset: int,
        src: HostBuffer,
        src_offset: int,
        nbytes: int,
        ids: BufferView,
        n_ids: int,
        row_nbytes: int,
        overrun: int = 0,
        *,
        report: BufferView | None = None,
        tag: int = 0,
        skip: BufferView | None = None,
        n_skip: int = 0,
        packed: bool = False,
        slots: BufferView | None = None,
    ) -> None:
        """Copy host -> device the rows that ids on the device name, without the host reading them.

        ``[src_offset, src_offset + nbytes)`` of ``src`` holds rows of ``row_nbytes``; for each
        distinct id in the first ``n_ids`` int32 of ``ids`` that names a row, the row's bytes and
        up to ``overrun`` bytes after it (what kernels read past a row's end; never past
        ``nbytes``) go to the same offsets after ``dst_offset``. Other ids are skipped and other
        bytes of ``dst`` keep their values. The device reads ``src`` itself (it must be page-locked:
        pinned or registered), in stream order after the work that writes ``ids``, so a decode
        step's expert copies need no host round trip to learn which experts to copy.

        ``report``: two int32 on the device, the first -1 beforehand. The first gather to meet an
        id naming no row writes ``tag`` and that id there, for the caller to read once the
        stream is done (the host never waits for it here).

        ``skip``: ``n_skip`` int32 ids on the device whose rows are not copied (a decode step's
        predicted experts, copied ahead of the router: ``Scheduler``'s decode lookahead).

        ``packed``: the rows go one after another from ``dst_offset`` instead of at their own
        offsets, so that ``dst`` need only hold ``n_skip + n_ids`` rows (a decode step uses a few
        of many experts). The row of the id first met at position ``j`` of ``ids`` goes to row
        ``n_skip + j``, without its overrun (the row after it is another's); a skipped id's row
        is taken to be at row ``p``, its first position in ``skip``: where a packed gather of the
        skipped ids put it. ``slots`` (packed only): ``n_ids`` int32 on the device that receive
        the row of ``dst`` each id's row is at (0 for an id naming no row), for kernels to index
        ``dst`` by.
        """
        call = "Stream.gather_h2d"
        if not isinstance(packed, bool):
            raise InvalidArgument(f"packed must be a bool, got {packed!r}", call=call)
        if slots is not None and not packed:
            raise InvalidArgument("slots are written by packed gathers only", call=call, hint="pass packed=True")
        self._check_open(call)
        _check_kinds(call, dst, DeviceBuffer, src, HostBuffer)
        check_range(call, src, src_offset, nbytes)
        self._check_same_device(call, dst)
        if not src.is_page_locked:
            raise InvalidArgument(
                f"the device cannot read {src.kind.value} host memory",
                call=call,
                device=self.device.label,
                hint="register the memory (HostBuffer.register) or copy from pinned memory; for pageable "
                "memory read the ids back and copy the rows with copy_h2d",
            )
        checked = (
            ("n_ids", n_ids, 0),
            ("row_nbytes", row_nbytes, 1),
            ("overrun", overrun, 0),
            ("tag", tag, 0),
            ("n_skip", n_skip, 0),
        )
        for name, value, least in checked:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"{name} must be an integer >= {least}, got {value!r}", call=call)
        self._check_int32_view(call, "ids", ids, n_ids)
        if report is not None:
            if not isinstance(report, BufferView) or report.nbytes < 8 or report.offset % 4:
                raise InvalidArgument("report must be a 4-byte aligned BufferView of two int32", call=call)
            self._check_same_device(call, report.buffer)
        self._check_skip(call, skip, n_skip)
        if slots is not None:
            self._check_int32_view(call, "slots", slots, n_ids)
        if nbytes % row_nbytes:
            raise InvalidArgument(
                f"rows of {row_nbytes} bytes do not divide the {nbytes}-byte region",
                call=call,
                hint="give the region of whole rows (one expert's bytes per row)",
            )
        rows = RowGather(
            src_offset,
            nbytes,
            ids,
            int(n_ids),
            int(row_nbytes),
            int(overrun),
            report,
            int(tag),
            skip if n_skip else None,
            int(n_skip),
            packed,
            slots,
        )
        check_range(call, dst, dst_offset, rows.dst_nbytes)
        if nbytes and n_ids:
            self._traced(
                OpKind.H2D, "gather_h2d", rows.most_bytes, lambda: self._gather_h2d(dst, dst_offset, src, rows)
            )

    def begin_capture(self) -> None:
        """Record this stream's next work into a graph instead of running it (CUDA and HIP stream capture).

        Until ``end_capture`` the stream takes copies between device memory and page-locked host
        memory, fills, gathers, kernel launches and events; nothing runs and nothing may wait for
        it (synchronize and pageable copies are refused). ``Graph.launch`` then runs all of it
        with one call: what a decode step is worth replaying, since it is hundreds of small
        calls whose host time would otherwise bound it.

        Another stream of the device joins the capture by waiting on an event recorded in it
        (a fork): its work is captured too, beside this stream's, and must end with a record
        that a stream of the capture waits on before ``end_capture`` (a join). The graph keeps
        the fork and the join: a launch runs the joined stream's work beside the launching
        stream's, in the same order against it.
        """
        call = "Stream.begin_capture"
        self._check_open(call)
        if self.capturing:
            raise InvalidArgument("the stream is capturing already", call=call, device=self.device.label)
        self._begin_capture()
        self.capturing = True
        self.capture_origin = self
        self._joined = []

    def end_capture(self, keep: bool = True) -> Graph | None:
        """End the capture: the graph of what was enqueued since begin_capture (None with ``keep=False``).

        Called on the stream that began it; the streams that joined it leave it with it.
        """
        call = "Stream.end_capture"
        self._check_open(call)
        if not self.capturing:
            raise InvalidArgument("the stream is not capturing", call=call, device=self.device.label)
        if self.capture_origin is not self:
            raise InvalidArgument(
                "this stream joined another stream's capture",
                call=call,
                device=self.device.label,
                hint="end the capture on the stream that began it",
            )
        joined, self._joined = self._joined, []
        try:
            return self._end_capture(keep)
        finally:
            for stream in (self, *joined):
                stream.capturing = False
                stream.capture_origin = None

    def record(self, event: Event) -> None:
        """Mark the current end of this stream in ``event`` (re-recording re-arms it)."""
        self._check_open("Stream.record")
        event._check_open("Stream.record")
        if event.device is not self.device:
            raise InvalidArgument(
                f"event belongs to {event.device.label}", call="Stream.record", device=self.device.label
            )
        self._record(event)
        event.captured_in = self.capture_origin

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for the event's most recent record.

        A wait on an event that was never recorded is a no-op. Events of another device are
        allowed (cross-device ordering). A stream that is not capturing joins a capture by
        waiting on an event recorded in it (``begin_capture``); a capturing stream waits only
        on events recorded in its own capture.
        """
        call = "Stream.wait"
        self._check_open(call)
        event._check_open(call)
        origin = event.captured_in
        if origin is not None and not origin.capturing:
            raise InvalidArgument(
                "the event was recorded in a capture that has ended",
                call=call,
                device=self.device.label,
                hint="record it again outside the capture, or launch the graph and wait on what follows it",
            )
        if self.capturing and origin is not self.capture_origin:
            raise InvalidArgument(
                "a capturing stream waits only on events recorded in its own capture",
                call=call,
                device=self.device.label,
                hint="record the event in this capture, or wait on it before begin_capture",
            )
        if origin is not None and not self.capturing:
            if origin.device is not self.device:
                raise InvalidArgument(
                    f"a capture of {origin.device.label} cannot take work of {self.device.label}",
                    call=call,
                    device=self.device.label,
                )
            self.capturing = True  # forked: this stream's work joins the capture until it ends
            self.capture_origin = origin
            origin._joined.append(self)
        self._wait(event)

    def launch(
        self,
        kernel: Kernel,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None:
        """Launch ``kernel``; pointer arguments are device buffers or views, scalars numpy scalars."""
        call = f"Stream.launch({kernel.name})"
        self._check_open(call)
        if kernel.device is not self.device:
            raise InvalidArgument(f"{kernel!r} was compiled for another device", call=call, device=self.device.label)
        for i, arg in enumerate(args):
            if isinstance(arg, (DeviceBuffer, BufferView)):
                buf = arg if isinstance(arg, DeviceBuffer) else arg.buffer
                if buf.closed:
                    raise UseAfterClose(f"argument {i} {buf!r} is closed", call=call, device=self.device.label)
                if not self.device.can_access_peer(buf.device):
                    # Prefetch slots on the wrong GPU: a kernel handed another device's memory reads garbage.
                    raise HazardError(
                        f"cross-device access: argument {i} lives on {buf.device.label}, which "
                        f"{self.device.label} cannot access",
                        call=call,
                        device=self.device.label,
                        hint="allocate it on the launching device or enable peer access",
                    )
            elif not isinstance(arg, (np.integer, np.floating)):
                raise InvalidArgument(
                    f"argument {i} is a {type(arg).__name__}; scalars must be typed",
                    call=call,
                    device=self.device.label,
                    hint="pass numpy scalars such as np.int32(n) or np.float32(x)",
                )
        if shared_mem and not 0 < shared_mem <= self.device.capabilities.max_shared_bytes:
            raise InvalidArgument(
                f"{shared_mem} bytes of shared memory a block; this device allows "
                f"{self.device.capabilities.max_shared_bytes}",
                call=call,
                device=self.device.label,
                hint="launch with less, or pick the kernel by Capabilities.max_shared_bytes",
            )
        grid3, block3, arg_tuple = dim3(grid), dim3(block), tuple(args)
        self._traced(OpKind.KERNEL, kernel.name, 0, lambda: self._launch(kernel, grid3, block3, arg_tuple, shared_mem))

    def _traced(self, kind: OpKind, name: str, nbytes: int, enqueue: Callable[[], None]) -> None:
        tracer = self.device.backend._tracer
        if tracer is None or self.capturing:  # a capture holds no timing events: its graph is traced whole
            enqueue()
        else:
            tracer.around(self, kind, name, nbytes, enqueue)

    def close(self) -> None:
        """Destroy the stream (after its work is done); streams from from_handle are left alone."""
        if not self.closed:
            if self.owned:
                self._destroy()
            self.closed = True

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise UseAfterClose("stream is closed", call=call, device=self.device.label)

    def _check_h2d(
        self, call: str, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, src_offset: int, nbytes: int
    ) -> None:
        """The checks of every host -> device copy: an open stream, the kinds, both ranges, this device."""
        self._check_open(call)
        _check_kinds(call, dst, DeviceBuffer, src, HostBuffer)
        check_range(call, dst, dst_offset, nbytes)
        check_range(call, src, src_offset, nbytes)
        self._check_same_device(call, dst)

    def _check_capturable(self, call: str, host: HostBuffer) -> None:
        """Refuse, while capturing, copies with pageable memory."""
        if not self.capturing or host.is_page_locked:
            return
        raise InvalidArgument(
            "a capturing stream takes no copies with pageable host memory",
            call=call,
            device=self.device.label,
            hint="end the capture first; a graph holds copies with device or page-locked memory, fills, gathers, "
            "kernels and events",
        )

    def _check_int32_view(self, call: str, name: str, view: BufferView, count: int) -> None:
        """A view of at least ``count`` int32 on this device, open and aligned (gather_h2d's ids, slots)."""
        if not isinstance(view, BufferView):
            raise InvalidArgument(
                f"{name} must be a BufferView of int32 on the device, got {type(view).__name__}", call=call
            )
        if view.buffer.closed:
            raise UseAfterClose(f"the {name}' {view.buffer!r} is closed", call=call, device=self.device.label)
        self._check_same_device(call, view.buffer)
        if view.offset % 4:
            raise InvalidArgument(f"the {name} view starts at byte {view.offset}, not at an int32", call=call)
        if 4 * count > view.nbytes:
            raise InvalidArgument(
                f"the {name} view holds {view.nbytes} bytes; {count} int32 {name} need {4 * count}", call=call
            )

    def _check_skip(self, call: str, skip: BufferView | None, n_skip: int) -> None:
        """gather_h2d's skipped ids: on this device, whole int32, open."""
        if skip is None:
            if n_skip:
                raise InvalidArgument(f"n_skip is {n_skip} but no skip ids were given", call=call)
            return
        if not isinstance(skip, BufferView) or skip.offset % 4 or skip.nbytes < 4 * n_skip:
            raise InvalidArgument(f"skip must be a 4-byte aligned BufferView of at least {n_skip} int32 ids", call=call)
        if skip.buffer.closed:
            raise UseAfterClose(f"the skipped ids' {skip.buffer!r} is closed", call=call, device=self.device.label)
        self._check_same_device(call, skip.buffer)

    def _check_same_device(self, call: str, buf: DeviceBuffer) -> None:
        if buf.device is not self.device:
            raise InvalidArgument(
                f"{buf!r} is on {buf.device.label}, this stream on {self.device.label}",
                call=call,
                device=self.device.label,
                hint="use a stream of the buffer's device",
            )

    @classmethod
    def from_handle(cls, device: Device, handle: int) -> Stream:
        """Wrap a stream created elsewhere (torch.cuda.Stream().cuda_stream, cupy's ptr)."""
        return device.stream_from_handle(handle)

    @property
    def __cuda_stream__(self) -> Callable[[], tuple[int, int]]:
        """The CUDA stream protocol, on CUDA streams only: ``stream.__cuda_stream__()`` is (0, handle)."""
        if self.device.dlpack_device[0] is not DLDeviceType.CUDA:
            raise AttributeError(f"__cuda_stream__ exists on CUDA streams only, not on {self.device.label}")
        self._check_open("Stream.__cuda_stream__")
        handle = self.handle
        return lambda: (0, handle)


__all__ = ["Dim3", "Event", "Graph", "Kernel", "KernelArg", "Stream", "dim3"]
