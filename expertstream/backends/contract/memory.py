"""The contract's memory: host buffers, device buffers and their byte ranges.

Host memory is what copies read from or write to (a wrapped array or mapping, or a pinned
allocation); device memory is ``nbytes`` of tensor data inside the allocated bytes, exported to
other libraries through DLPack and the CUDA array interface (backends.dlpack).
"""

from __future__ import annotations

import abc
import enum
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..._closing import Closing
from ...errors import DeviceError, InvalidArgument, UseAfterClose
from ..dlpack import DLDeviceType, TypedView, typed_view

if TYPE_CHECKING:
    from .devices import Device
    from .streams import Stream


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
        backends.dlpack for how consumers are ordered after it). Raises InvalidArgument if
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
    skip: BufferView | None = None  # int32 ids on the copying device whose rows are not copied
    n_skip: int = 0
    packed: bool = False  # rows one after another in dst (Stream.gather_h2d), not at their own offsets
    slots: BufferView | None = None  # int32 on the copying device: the row of dst each id's row is at

    @property
    def dst_nbytes(self) -> int:
        """The bytes of dst (from its offset) the gather may write: the region, or the packed rows."""
        return (self.n_skip + self.n_ids) * self.row_nbytes if self.packed else self.nbytes

    def dst_row(self, first_met: int) -> int:
        """Where a packed gather puts the row of the id first met at position ``first_met`` of the ids."""
        return self.n_skip + first_met

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
        return gathered_at_most(self.nbytes, self.n_ids, self.row_nbytes, 0 if self.packed else self.overrun)


def gathered_at_most(nbytes: int, n_ids: int, row_nbytes: int, overrun: int) -> int:
    """What a gather of ``n_ids`` rows (and their overrun) from ``nbytes`` copies if no two ids repeat."""
    return min(n_ids, nbytes // row_nbytes) * min(row_nbytes + overrun, nbytes)


__all__ = [
    "BufferView",
    "DeviceBuffer",
    "HostBuffer",
    "HostMemory",
    "RowGather",
    "Usage",
    "as_host_bytes",
    "check_range",
    "check_sharing",
    "gathered_at_most",
]
