"""The backend contract: every vendor backend implements exactly this, nothing more.

Public methods here validate their arguments once, for every backend, and then call a
small set of abstract ``_primitives`` that each backend fills in. A backend never returns
an error tuple: failures become one of the exceptions defined below, whose message names
the call, the device, the code and what the user can do about it.
"""

from __future__ import annotations

import abc
import enum
import itertools
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Union

import numpy as np

from .. import ggml
from .._closing import Closing
from .._deprecated import moved
from ..errors import (  # the contract raises these; importable from here as well
    BackendError,
    BackendUnavailable,
    DeviceError,
    ExpertStreamError,
    HazardError,
    InvalidArgument,
    KernelCompileError,
    OutOfDeviceMemory,
    UseAfterClose,
)
from ..ggml import RowType
from ..timeline import OpKind
from .interop import DLDeviceType, TypedView, event_handle, stream_handle, typed_view

if TYPE_CHECKING:
    from ..timeline import TimelineOp
    from .tracing import EventTracer


# --------------------------------------------------------------------------------------
# Closed sets
# --------------------------------------------------------------------------------------


class Vendor(enum.Enum):
    NVIDIA = "nvidia"
    AMD = "amd"
    SIM = "sim"


class Usage(enum.Enum):
    """What a device buffer holds; decides whether its padding is zeroed at allocation."""

    ANY = "any"
    WEIGHTS = "weights"
    COMPUTE = "compute"  # scratch: never zeroed for the caller, whoever fills it clears it


class HostMemory(enum.Enum):
    PAGEABLE = "pageable"  # ordinary memory or a file mapping: copies from it may block the host
    PINNED = "pinned"  # page-locked allocation owned by the backend
    REGISTERED = "registered"  # ordinary memory page-locked in place by host registration


# --------------------------------------------------------------------------------------
# Plain data
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capabilities:
    async_copies: bool
    events: bool
    host_register: bool
    host_register_read_only: bool
    peer_access: frozenset[int] = field(default_factory=frozenset)  # device indices reachable
    # bf16 matrix instructions the kernels use (NVIDIA sm_80+, AMD gfx90a/gfx94x, gfx11, gfx12)
    matrix_cores: bool = False
    # int8 matrix instructions the int8 kernels use (NVIDIA sm_80+: mma.sync m16n8k32 s8)
    int8_matrix_cores: bool = False
    # NVIDIA's mma.sync register fragments (sm_80+), into which direct.cu's kernels decode weights
    mma_fragments: bool = False


class _Exported(abc.ABC):
    """DLPack and the CUDA array interface over a byte range: uint8 and 1-D unless as_array says otherwise."""

    _api_name: ClassVar[str]

    @abc.abstractmethod
    def _export_view(self) -> BufferView: ...

    def as_array(
        self, dtype: Any = np.uint8, shape: int | Sequence[int] | None = None, *, stream: Stream | None = None
    ) -> TypedView:
        """A row-major ``dtype`` array of ``shape`` over the first bytes, for other libraries.

        ``stream`` is the producer stream: the one whose enqueued work writes these bytes (see
        backends.interop for how consumers are ordered after it). Raises InvalidArgument if
        the bytes are too few or misaligned for the shape and type, or the type is unsupported.
        """
        return typed_view(self._export_view(), dtype, shape, stream, f"{self._api_name}.as_array")

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.as_array().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        return self._export_view().buffer.device.dlpack_device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.as_array().__cuda_array_interface__


@dataclass(frozen=True)
class BufferView(_Exported):
    """A byte range of a device buffer; what kernels take as a pointer argument."""

    _api_name: ClassVar[str] = "BufferView"

    buffer: DeviceBuffer
    offset: int
    nbytes: int

    @property
    def address(self) -> int:
        return self.buffer.address + self.offset

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def _export_view(self) -> BufferView:
        return self


KernelArg = Union["DeviceBuffer", BufferView, np.integer, np.floating]


# --------------------------------------------------------------------------------------
# Host memory
# --------------------------------------------------------------------------------------


class HostBuffer(Closing):
    """Host memory that copies read from or write to.

    Wraps a numpy array, a bytes-like object or an mmap (read-only mappings allowed), or
    owns a pinned allocation. ``array`` is a flat uint8 view of the bytes, for backends;
    host code takes its views with ``numpy()``, which the simulator checks against copies.
    """

    def __init__(
        self,
        device: Device,
        array: np.ndarray,
        kind: HostMemory,
        *,
        owner: Any = None,
        pinned_handle: Any = None,
    ) -> None:
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
            raise InvalidArgument("host buffers wrap flat contiguous uint8 arrays")
        self.device = device
        self.array = array
        self.kind = kind
        self._owner = owner  # keeps the wrapped object (mmap, ndarray) alive
        self._pinned_handle = pinned_handle
        self._registered_read_only = False
        self.closed = False
        if kind is HostMemory.PINNED:
            device._count_page_locked(self.nbytes)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data) if self.nbytes else 0

    @property
    def read_only(self) -> bool:
        return not self.array.flags.writeable

    @property
    def is_page_locked(self) -> bool:
        return self.kind in (HostMemory.PINNED, HostMemory.REGISTERED)

    def numpy(self, offset: int = 0, nbytes: int | None = None, *, write: bool = False) -> np.ndarray:
        """A flat uint8 view of bytes ``[offset, offset + nbytes)`` for host code: read-only unless ``write``.

        Copies read and write page-locked memory after they were enqueued: take a view once the
        copies touching those bytes are done (synchronize their stream, or an event recorded
        after them). The simulator raises HazardError for a view that overlaps a copy not yet
        ordered before the calling thread, as it does for device-side hazards.
        """
        call = "HostBuffer.numpy"
        n = self.nbytes - offset if nbytes is None else nbytes
        check_range(call, self, offset, n)
        if write and self.read_only:
            raise InvalidArgument(
                "cannot write read-only host memory", call=call, device=self.device.label, hint="take a read view"
            )
        self.device._check_host_access(self, offset, n, write, call)
        view = self.array[offset : offset + n]
        if not write:
            view = view.view()
            view.flags.writeable = False
        return view

    def register(self, read_only: bool | None = None) -> None:
        """Page-lock this memory in place so copies from it run at full DMA speed.

        ``read_only`` defaults to whether the memory is read-only (a PROT_READ mapping must
        be registered read-only). Raises DeviceError with a hint if the platform refuses.
        """
        self._check_open("HostBuffer.register")
        if self.kind is HostMemory.PINNED:
            raise InvalidArgument("pinned memory is already page-locked", call="HostBuffer.register")
        if self.kind is HostMemory.REGISTERED:
            return
        ro = self.read_only if read_only is None else read_only
        if self.read_only and not ro:
            raise InvalidArgument(
                "a read-only mapping can only be registered read-only",
                call="HostBuffer.register",
                hint="pass read_only=True",
            )
        if ro and not self.device.capabilities.host_register_read_only:
            raise DeviceError(
                "read-only host registration is not supported",
                call="HostBuffer.register",
                device=self.device.label,
                hint="copy the data into pinned memory (alloc_pinned) or use a staging ring",
            )
        if self.nbytes:
            self.device._host_register(self, ro)
        self._registered_read_only = ro
        self.kind = HostMemory.REGISTERED
        self.device._count_page_locked(self.nbytes)

    def unregister(self) -> None:
        self._check_open("HostBuffer.unregister")
        if self.kind is not HostMemory.REGISTERED:
            return
        if self.nbytes:
            self.device._host_unregister(self)
        self.kind = HostMemory.PAGEABLE
        self.device._count_page_locked(-self.nbytes)

    def close(self) -> None:
        """Unregister or free the memory. Pending copies must be finished first."""
        if self.closed:
            return
        if self.kind is HostMemory.REGISTERED:
            self.unregister()
        elif self.kind is HostMemory.PINNED:
            self.device._host_free_pinned(self)
            self.device._count_page_locked(-self.nbytes)
        self.closed = True
        self.array = np.empty(0, dtype=np.uint8)
        self._owner = None

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise UseAfterClose("host buffer is closed", call=call, device=self.device.label)

    def __repr__(self) -> str:
        return f"HostBuffer({self.kind.value}, {self.nbytes} bytes{', read-only' if self.read_only else ''})"


def as_host_bytes(obj: Any) -> tuple[np.ndarray, Any]:
    """A flat uint8 view of a numpy array, bytes-like object or mmap, plus what to keep alive."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgument("host arrays must be C-contiguous", hint="pass np.ascontiguousarray(a)")
        return obj.reshape(-1).view(np.uint8), obj
    if isinstance(obj, mmap.mmap):
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)  # writable mappings give a writable view
        except TypeError:
            raise InvalidArgument("cannot view this mmap as bytes") from None
        if not arr.flags.writeable:
            return arr, obj
        return np.ndarray(len(obj), dtype=np.uint8, buffer=obj), obj
    try:
        return np.frombuffer(memoryview(obj), dtype=np.uint8), obj
    except TypeError:
        raise InvalidArgument(
            f"cannot use {type(obj).__name__} as host memory",
            hint="pass a numpy array, a bytes-like object or an mmap",
        ) from None


# --------------------------------------------------------------------------------------
# Device memory
# --------------------------------------------------------------------------------------


class DeviceBuffer(_Exported, Closing):
    """Device memory: ``nbytes`` of tensor data inside ``alloc_size`` allocated bytes."""

    _api_name: ClassVar[str] = "DeviceBuffer"

    def __init__(self, device: Device, nbytes: int, alloc_size: int, usage: Usage) -> None:
        self.device = device
        self.nbytes = nbytes
        self.alloc_size = alloc_size
        self.usage = usage
        self.closed = False

    @property
    @abc.abstractmethod
    def address(self) -> int:
        """Device address of byte 0 (0 for a zero-size buffer)."""

    @abc.abstractmethod
    def _free(self) -> None:
        """Release the memory. Called once."""

    def _dlpack_pointer(self) -> int:
        """Where a DLPack consumer finds byte 0, in the memory of ``device.dlpack_device``."""
        return self.address

    def _export_view(self) -> BufferView:
        return self.view()

    def view(self, offset: int = 0, nbytes: int | None = None) -> BufferView:
        n = self.alloc_size - offset if nbytes is None else nbytes
        check_range("DeviceBuffer.view", self, offset, n)
        return BufferView(self, offset, n)

    def close(self) -> None:
        if not self.closed:
            self._free()
            self.closed = True

    def read(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Copy bytes back to a new host array, synchronously (a convenience for tests and tools)."""
        n = self.alloc_size - offset if nbytes is None else nbytes
        out = np.empty(n, dtype=np.uint8)
        host = self.device.wrap_host(out)
        stream = self.device._utility_stream()
        stream.copy_d2h(host, 0, self, offset, n)
        stream.synchronize()
        return out

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy host bytes into the buffer, synchronously."""
        arr, _ = as_host_bytes(data)
        host = self.device.wrap_host(arr)
        stream = self.device._utility_stream()
        stream.copy_h2d(self, offset, host, 0, host.nbytes)
        stream.synchronize()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self.address:x}"
        return f"DeviceBuffer({self.device.label}, {self.usage.value}, {self.nbytes}/{self.alloc_size} bytes, {state})"


def check_sharing(call: str, sharing: int) -> None:
    """``sharing`` must be a positive count of copies."""
    if not isinstance(sharing, (int, np.integer)) or isinstance(sharing, bool) or sharing < 1:
        raise InvalidArgument(f"sharing must be a count of copies >= 1, got {sharing!r}", call=call)


def check_range(call: str, buf: DeviceBuffer | HostBuffer, offset: int, nbytes: int) -> None:
    """Raise unless ``[offset, offset + nbytes)`` lies inside an open buffer."""
    if buf.closed:
        raise UseAfterClose(f"{buf!r} is closed", call=call, device=buf.device.label)
    size = buf.alloc_size if isinstance(buf, DeviceBuffer) else buf.nbytes
    if not isinstance(offset, (int, np.integer)) or not isinstance(nbytes, (int, np.integer)):
        raise InvalidArgument("offsets and sizes must be integers", call=call, device=buf.device.label)
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise InvalidArgument(
            f"byte range [{offset}, {offset + nbytes}) is outside {buf!r} of {size} bytes",
            call=call,
            device=buf.device.label,
        )


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


@dataclass(frozen=True)
class RowGather:
    """What one gather_h2d copies, its arguments validated: rows of a host region named by device ids."""

    src_offset: int  # where the region starts in the host buffer
    nbytes: int  # the region's size: a whole number of rows
    ids: BufferView  # int32 on the copying device
    n_ids: int
    row_nbytes: int
    overrun: int  # bytes after a row copied with it, within the region
    report: BufferView | None = None  # int32 [tag, id] of the first id naming no row
    tag: int = 0

    @property
    def n_rows(self) -> int:
        return self.nbytes // self.row_nbytes

    def row_range(self, row: int) -> tuple[int, int]:
        """The region's bytes ``[start, end)`` copied for ``row``."""
        start = row * self.row_nbytes
        return start, min(start + self.row_nbytes + self.overrun, self.nbytes)

    @property
    def most_bytes(self) -> int:
        """The bytes copied when every id names a different row (a token's top-k ids do)."""
        return gathered_at_most(self.nbytes, self.n_ids, self.row_nbytes, self.overrun)


def gathered_at_most(nbytes: int, n_ids: int, row_nbytes: int, overrun: int) -> int:
    """What a gather of ``n_ids`` rows (and their overrun) from ``nbytes`` copies if no two ids repeat."""
    return min(n_ids, nbytes // row_nbytes) * min(row_nbytes + overrun, nbytes)


# --------------------------------------------------------------------------------------
# Events, kernels, streams
# --------------------------------------------------------------------------------------


class Event(abc.ABC, Closing):
    """A marker in a stream. Waits bind to the most recent record at the time they are enqueued."""

    def __init__(self, device: Device, timing: bool, *, owned: bool = True) -> None:
        self.device = device
        self.timing = timing
        self.owned = owned  # False for events wrapped with event_from: close() leaves them alone
        self.closed = False

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
        self.operations = operations  # the calls captured
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


class Stream(abc.ABC, Closing):
    """An in-order queue of device work. Every enqueue returns at once unless noted."""

    def __init__(self, device: Device, *, owned: bool = True) -> None:
        self.device = device
        self.owned = owned  # False for streams wrapped with from_handle: close() leaves them alone
        self.closed = False
        self.capturing = False  # between begin_capture and end_capture: work is recorded, not run

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
        """
        call = "Stream.gather_h2d"
        self._check_h2d(call, dst, dst_offset, src, src_offset, nbytes)
        if not src.is_page_locked:
            raise InvalidArgument(
                f"the device cannot read {src.kind.value} host memory",
                call=call,
                device=self.device.label,
                hint="register the memory (HostBuffer.register) or copy from pinned memory; for pageable "
                "memory read the ids back and copy the rows with copy_h2d",
            )
        if not isinstance(ids, BufferView):
            raise InvalidArgument(
                f"ids must be a BufferView of int32 on the device, got {type(ids).__name__}", call=call
            )
        if ids.buffer.closed:
            raise UseAfterClose(f"the ids' {ids.buffer!r} is closed", call=call, device=self.device.label)
        self._check_same_device(call, ids.buffer)
        if ids.offset % 4:
            raise InvalidArgument(f"the ids view starts at byte {ids.offset}, not at an int32", call=call)
        if report is not None:
            if not isinstance(report, BufferView) or report.nbytes < 8 or report.offset % 4:
                raise InvalidArgument("report must be a 4-byte aligned BufferView of two int32", call=call)
            self._check_same_device(call, report.buffer)
        checked = (("n_ids", n_ids, 0), ("row_nbytes", row_nbytes, 1), ("overrun", overrun, 0), ("tag", tag, 0))
        for name, value, least in checked:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"{name} must be an integer >= {least}, got {value!r}", call=call)
        if 4 * n_ids > ids.nbytes:
            raise InvalidArgument(
                f"the ids view holds {ids.nbytes} bytes; {n_ids} int32 ids need {4 * n_ids}", call=call
            )
        if nbytes % row_nbytes:
            raise InvalidArgument(
                f"rows of {row_nbytes} bytes do not divide the {nbytes}-byte region",
                call=call,
                hint="give the region of whole rows (one expert's bytes per row)",
            )
        if nbytes and n_ids:
            rows = RowGather(src_offset, nbytes, ids, int(n_ids), int(row_nbytes), int(overrun), report, int(tag))
            self._traced(
                OpKind.H2D, "gather_h2d", rows.most_bytes, lambda: self._gather_h2d(dst, dst_offset, src, rows)
            )

    def begin_capture(self) -> None:
        """Record this stream's next work into a graph instead of running it (CUDA and HIP stream capture).

        Until ``end_capture`` the stream takes copies between device memory and page-locked host
        memory, fills, gathers and kernel launches; nothing runs and nothing may wait for it
        (synchronize, events, pageable copies are refused). ``Graph.launch`` then runs all of it
        with one call: what a decode step is worth replaying, since it is hundreds of small
        calls whose host time would otherwise bound it.
        """
        call = "Stream.begin_capture"
        self._check_open(call)
        if self.capturing:
            raise InvalidArgument("the stream is capturing already", call=call, device=self.device.label)
        self._begin_capture()
        self.capturing = True

    def end_capture(self, keep: bool = True) -> Graph | None:
        """End the capture: the graph of what was enqueued since begin_capture (None with ``keep=False``)."""
        call = "Stream.end_capture"
        self._check_open(call)
        if not self.capturing:
            raise InvalidArgument("the stream is not capturing", call=call, device=self.device.label)
        self.capturing = False
        return self._end_capture(keep)

    def record(self, event: Event) -> None:
        """Mark the current end of this stream in ``event`` (re-recording re-arms it)."""
        self._check_open("Stream.record")
        event._check_open("Stream.record")
        self._check_capturable("Stream.record", None)
        if event.device is not self.device:
            raise InvalidArgument(
                f"event belongs to {event.device.label}", call="Stream.record", device=self.device.label
            )
        self._record(event)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for the event's most recent record.

        A wait on an event that was never recorded is a no-op. Events of another device are
        allowed (cross-device ordering).
        """
        self._check_open("Stream.wait")
        event._check_open("Stream.wait")
        self._check_capturable("Stream.wait", None)
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
                    # Staging slots on the wrong GPU: a kernel handed another device's memory reads garbage.
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

    def _check_capturable(self, call: str, host: HostBuffer | None) -> None:
        """Refuse, while capturing, events (host argument None) and copies with pageable memory."""
        if not self.capturing or (host is not None and host.is_page_locked):
            return
        what = "events" if host is None else "copies with pageable host memory"
        raise InvalidArgument(
            f"a capturing stream takes no {what}",
            call=call,
            device=self.device.label,
            hint="end the capture first; a graph holds one stream's copies with device or page-locked memory, "
            "fills, gathers and kernels",
        )

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


# --------------------------------------------------------------------------------------
# Devices and backends
# --------------------------------------------------------------------------------------


class Device(abc.ABC):
    """One GPU (or one simulated GPU)."""

    foreign_handles: ClassVar[bool] = False  # whether streams and events of other libraries can exist here

    def __init__(self, backend: Backend, index: int, name: str) -> None:
        self.backend = backend
        self.index = index
        self.name = name
        self._utility: Stream | None = None
        self._utility_lock = threading.Lock()
        self._page_locked_bytes = 0

    @property
    def label(self) -> str:
        return f"{self.backend.name}:{self.index}"

    @property
    def page_locked_bytes(self) -> int:
        """Host memory page-locked through this device and not yet released (pinned and registered)."""
        return self._page_locked_bytes

    def _count_page_locked(self, nbytes: int) -> None:
        with self._utility_lock:
            self._page_locked_bytes += nbytes

    # -- primitives ---------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def total_memory(self) -> int: ...

    @abc.abstractmethod
    def free_memory(self) -> int: ...

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @property
    @abc.abstractmethod
    def arch(self) -> str:
        """Compile target: 'sm_90', 'gfx942', or the simulator's profile name."""

    @abc.abstractmethod
    def _alloc(self, nbytes: int, alloc_size: int, usage: Usage) -> DeviceBuffer:
        """Allocate ``alloc_size`` bytes; raise OutOfDeviceMemory naming asked and free bytes."""

    @abc.abstractmethod
    def stream(self) -> Stream:
        """A new non-blocking stream."""

    @abc.abstractmethod
    def stream_from_handle(self, handle: int) -> Stream:
        """Wrap a native stream handle; the wrapper does not own it."""

    def event_from_handle(self, handle: int, timing: bool = False) -> Event:
        """Wrap a native event handle; the wrapper does not own it (``timing``: it was created with timing)."""
        raise InvalidArgument(
            f"the {self.backend.name} backend has no native event handles",
            call="Device.event_from_handle",
            device=self.label,
        )

    @property
    @abc.abstractmethod
    def dlpack_device(self) -> tuple[DLDeviceType, int]:
        """Where this device's buffers live for DLPack: (device type, device id)."""

    @abc.abstractmethod
    def event(self, timing: bool = False) -> Event: ...

    @abc.abstractmethod
    def compile(self, source: str, name: str) -> Kernel:
        """Compile ``extern "C" __global__`` source and return kernel ``name`` (cached)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work on this device is done."""

    @abc.abstractmethod
    def enable_peer_access(self, other: Device) -> None:
        """Let this device's kernels and copies touch ``other``'s memory."""

    @abc.abstractmethod
    def alloc_pinned(self, nbytes: int) -> HostBuffer: ...

    @abc.abstractmethod
    def _host_register(self, host: HostBuffer, read_only: bool) -> None: ...

    @abc.abstractmethod
    def _host_unregister(self, host: HostBuffer) -> None: ...

    @abc.abstractmethod
    def _host_free_pinned(self, host: HostBuffer) -> None: ...

    # -- validated API ------------------------------------------------------------------
    def alloc_size(self, nbytes: int, row_type: RowType | None = None, ne0: int | None = None) -> int:
        """Bytes to allocate for a tensor, including the quantized-row padding kernels read."""
        return ggml.padded_size(nbytes, row_type, ne0)

    def alloc(
        self,
        nbytes: int,
        usage: Usage = Usage.ANY,
        *,
        row_type: RowType | None = None,
        ne0: int | None = None,
    ) -> DeviceBuffer:
        """Allocate a buffer for ``nbytes`` of tensor data (plus padding for ``row_type``/``ne0``).

        The padding of WEIGHTS and ANY buffers is zeroed here; COMPUTE buffers are left as
        they are, and whoever fills one must clear the padding it relies on.
        """
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise InvalidArgument(f"cannot allocate {nbytes!r} bytes", call="Device.alloc", device=self.label)
        if not isinstance(usage, Usage):
            raise InvalidArgument(f"usage must be a Usage member, got {usage!r}", call="Device.alloc")
        size = self.alloc_size(int(nbytes), row_type, ne0)
        buf = self._alloc(int(nbytes), size, usage)
        if usage is not Usage.COMPUTE and size > nbytes:
            try:
                stream = self._utility_stream()
                stream.memset(buf, int(nbytes), size - int(nbytes), 0)
                stream.synchronize()
            except BaseException:
                buf.close()
                raise
        return buf

    def upload(self, data: Any, usage: Usage = Usage.ANY) -> DeviceBuffer:
        """Allocate a buffer holding a copy of ``data`` (synchronous)."""
        arr, _ = as_host_bytes(data)
        buf = self.alloc(arr.nbytes, usage)
        try:
            buf.write(arr)
        except BaseException:
            buf.close()
            raise
        return buf

    def stream_from(self, obj: Any) -> Stream:
        """Wrap a stream of this device made elsewhere; closing the wrapper leaves it alone.

        Takes a Stream of this device, an int handle, and on GPUs a torch.cuda.Stream, a CuPy
        stream or any object with ``__cuda_stream__``. Anything else is an InvalidArgument
        naming its type.
        """
        return self.stream_from_handle(stream_handle(obj, self, foreign=self.foreign_handles))

    def event_from(self, obj: Any, timing: bool = False) -> Event:
        """Wrap an event made elsewhere (an int handle, torch.cuda.Event, CuPy event); not owned."""
        return self.event_from_handle(event_handle(obj, self, foreign=self.foreign_handles), timing)

    def wrap_host(self, obj: Any) -> HostBuffer:
        """Wrap a numpy array, bytes-like object or mmap as pageable host memory (no copy)."""
        arr, owner = as_host_bytes(obj)
        return HostBuffer(self, arr, HostMemory.PAGEABLE, owner=owner)

    def host_copy(
        self,
        dst: HostBuffer,
        dst_offset: int,
        src: HostBuffer,
        src_offset: int,
        nbytes: int,
        *,
        sharing: int = 1,
        fixed_cost: bool = True,
    ) -> None:
        """A memcpy between host buffers in the calling thread (the simulator charges its time).

        ``sharing``: how many such copies the caller runs at once on its threads, this one
        included. The simulator gives each that share of the host's memory bus. ``fixed_cost``:
        whether the copy pays the simulator's fixed cost per copy (False: one in a row the thread
        was handed while busy, as a fill process takes its next command without waking).
        """
        check_range("Device.host_copy", dst, dst_offset, nbytes)
        check_range("Device.host_copy", src, src_offset, nbytes)
        check_sharing("Device.host_copy", sharing)
        np.copyto(dst.array[dst_offset : dst_offset + nbytes], src.array[src_offset : src_offset + nbytes])

    def can_access_peer(self, other: Device) -> bool:
        """Whether this device's kernels and copies may touch ``other``'s memory (a device of this backend)."""
        return other is self or (other.backend is self.backend and other.index in self.capabilities.peer_access)

    def _check_host_access(  # noqa: B027 - a no-op unless a backend checks host accesses
        self, host: HostBuffer, offset: int, nbytes: int, write: bool, call: str
    ) -> None:
        """The calling thread is about to read (or write) these host bytes; the simulator checks them."""

    def _utility_stream(self) -> Stream:
        with self._utility_lock:
            if self._utility is None or self._utility.closed:
                self._utility = self.stream()
            return self._utility

    def close(self) -> None:
        if self._utility is not None:
            self._utility.close()
            self._utility = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label} {self.name!r}>"


class Backend(abc.ABC, Closing):
    """One vendor runtime and its devices. Exactly one is active per use; see backends.backend()."""

    name: ClassVar[str]
    vendor: ClassVar[Vendor]
    _tracer: EventTracer | None = None
    _opened: ClassVar[dict[str, Iterator[int]]] = {}  # backend name -> the numbers of those opened
    _number: int

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        backend = super().__new__(cls)
        backend._number = next(Backend._opened.setdefault(cls.name, itertools.count(1)))
        return backend

    @property
    def instance_name(self) -> str:
        """The name and the number of this backend among those of its name opened in this process
        ("sim#2"): what tells apart devices of two of them, whose labels are alike ("sim:0")."""
        return f"{self.name}#{self._number}"

    @property
    @abc.abstractmethod
    def devices(self) -> Sequence[Device]: ...

    def device(self, index: int = 0) -> Device:
        devs = self.devices
        if not 0 <= index < len(devs):
            raise InvalidArgument(
                f"no device {index}; this backend has {len(devs)}",
                call="Backend.device",
                hint=f"use an index in 0..{len(devs) - 1}",
            )
        return devs[index]

    def close(self) -> None:
        if self._tracer is not None:
            self._tracer.close()
            self._tracer = None
        for d in self.devices:
            d.close()

    # Host threads. The simulator keeps a virtual clock per host thread; work handed from one
    # thread to another (a copy worker, a fill pool) carries the sender's timestamp so the
    # receiver cannot start it earlier. Real backends need nothing more than the wall clock.
    def host_timestamp(self) -> float:
        """The calling thread's clock in seconds (virtual on the simulator)."""
        return time.perf_counter()

    def host_resume_at(self, timestamp: float) -> None:  # noqa: B027 - a no-op unless time is virtual
        """Tell the backend the calling thread is now at least at ``timestamp`` (a handoff)."""

    @contextmanager
    def bare_calls(self) -> Iterator[None]:
        """The calling thread's calls inside come back to back, with none of its caller's work
        between them (a staging ring's DMAs and records; a decode step's copies of expert ranges one
        by one; a probe's launches): the simulator charges them its profile's ``call_s`` rather than
        the job's time per call. A no-op elsewhere."""
        yield

    @property
    def virtual_time(self) -> bool:
        """True where time is simulated: work done outside this process's threads takes none of it."""
        return False

    @property
    def holds_data(self) -> bool:
        """False when buffers hold no bytes (the simulator's timing-only mode): outputs are meaningless."""
        return True

    @property
    def ring_threads(self) -> int | None:
        """Host threads a staging ring runs on the machine this backend stands for, where it says
        (a simulator profile describing another machine); None: this host's default."""
        return None

    @property
    def ring_fill(self) -> str | None:
        """Who fills a staging ring's chunks on the machine this backend stands for, where it says (a
        simulator profile's "threads" or "processes"); None: what this host can run."""
        return None

    @property
    def timeline(self) -> Sequence[TimelineOp] | None:
        """Every operation with its start and end: always on the simulator, after start_trace() elsewhere."""
        return None if self._tracer is None else self._tracer.timeline()

    def start_trace(self) -> None:
        """Record every copy, memset and kernel from now on, for ``timeline``.

        Costs two timing events per operation; a backend that always records (the simulator)
        ignores it.
        """
        if self._tracer is None and self.timeline is None:
            from .tracing import EventTracer

            self._tracer = EventTracer()

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description: name, vendor, devices with memory and capabilities."""
        return {
            "name": self.name,
            "vendor": self.vendor.value,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "arch": d.arch,
                    "total_memory": d.total_memory,
                    "free_memory": d.free_memory(),
                    "capabilities": {
                        "async_copies": d.capabilities.async_copies,
                        "events": d.capabilities.events,
                        "host_register": d.capabilities.host_register,
                        "host_register_read_only": d.capabilities.host_register_read_only,
                        "peer_access": sorted(d.capabilities.peer_access),
                        "matrix_cores": d.capabilities.matrix_cores,
                        "int8_matrix_cores": d.capabilities.int8_matrix_cores,
                        "mma_fragments": d.capabilities.mma_fragments,
                    },
                }
                for d in self.devices
            ],
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {len(self.devices)} device(s)>"


__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "BufferView",
    "Capabilities",
    "Device",
    "DeviceBuffer",
    "DeviceError",
    "Dim3",
    "Event",
    "ExpertStreamError",
    "Graph",
    "HazardError",
    "HostBuffer",
    "HostMemory",
    "InvalidArgument",
    "Kernel",
    "KernelArg",
    "KernelCompileError",
    "OutOfDeviceMemory",
    "RowGather",
    "RowType",
    "Stream",
    "Usage",
    "UseAfterClose",
    "Vendor",
    "as_host_bytes",
    "check_range",
    "dim3",
    "gathered_at_most",
]

__getattr__ = moved(
    __name__,
    {
        "MATRIX_ROW_PADDING": "expertstream.ggml.MATRIX_ROW_PADDING",
        "is_quantized": "expertstream.ggml.is_quantized",
        "row_size": "expertstream.ggml.row_size",
        "padded_size": "expertstream.ggml.padded_size",
        "HostSource": "expertstream.scheduler.source.HostSource",
        "HostRegion": "expertstream.scheduler.source.HostRegion",
    },
)
