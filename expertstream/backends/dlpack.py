"""Device memory, streams and events as other libraries see them.

Typed views export DLPack (every backend: CUDA and ROCm memory on GPUs, CPU memory on the
simulator, whose device bytes are numpy arrays) and the CUDA array interface (CUDA only).
Foreign streams and events (torch, CuPy, anything with ``__cuda_stream__``, raw handles)
are turned into handles the backends wrap without owning them.

Synchronization. A typed view may name the producer stream: the stream on which the work
that writes its bytes is enqueued. The CUDA array interface reports it in its ``stream``
key and the consumer orders itself after it. DLPack is the other way round: the consumer
passes its stream to ``__dlpack__`` and the producer orders it, here by recording an event
on the producer stream and making the consumer's stream wait for it (nothing is done when
both are the same stream, or the consumer passes -1). A CPU consumer has no stream: the
host waits for the producer stream before the capsule is handed out. A view that names no
producer stream promises that its bytes are ready whenever they are read.
"""

from __future__ import annotations

import abc
import ctypes
import enum
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from ..errors import InvalidArgument, UseAfterClose

if TYPE_CHECKING:
    from .base import BufferView, Device, Event


class DLDeviceType(enum.IntEnum):
    """DLPack's device types for the memory a backend hands out."""

    CPU = 1
    CUDA = 2
    ROCM = 10


class ProducerStream(abc.ABC):
    """What a typed view asks of its producer stream; the contract's Stream is the one kind there is.

    Declared here rather than imported from the contract, which builds on this module.
    """

    device: Device

    @property
    @abc.abstractmethod
    def handle(self) -> int: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def record(self, event: Event) -> None: ...


# --------------------------------------------------------------------------------------
# Element types
# --------------------------------------------------------------------------------------


class _DLCode(enum.IntEnum):
    INT = 0
    UINT = 1
    FLOAT = 2
    BFLOAT = 4
    COMPLEX = 5
    BOOL = 6


_CODE_FOR_KIND = {"b": _DLCode.BOOL, "i": _DLCode.INT, "u": _DLCode.UINT, "f": _DLCode.FLOAT, "c": _DLCode.COMPLEX}


@dataclass(frozen=True)
class ElementType:
    """One element of a typed view: its DLPack code, its size, and its array-interface typestr."""

    name: str
    itemsize: int
    code: int
    typestr: str | None  # None where the array interface has no spelling (bfloat16)

    @property
    def bits(self) -> int:
        return 8 * self.itemsize


BFLOAT16 = ElementType("bfloat16", 2, _DLCode.BFLOAT, None)


def element_type(dtype: Any, call: str = "as_array") -> ElementType:
    """A numpy dtype-like, ``"bfloat16"``, or a torch dtype, as an ElementType."""
    if isinstance(dtype, ElementType):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):  # torch.float32 -> "float32", without importing torch
        dtype = text.removeprefix("torch.")
    if dtype in ("bfloat16", "bf16"):
        return BFLOAT16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and dt.name == "bfloat16":  # ml_dtypes' numpy extension type
        return BFLOAT16
    code = _CODE_FOR_KIND.get(dt.kind) if dt is not None and dt.fields is None and dt.subdtype is None else None
    if dt is None or code is None:
        raise InvalidArgument(
            f"{dtype!r} is not an element type a typed view can hold",
            call=call,
            hint="use a numeric numpy dtype (bool, int, uint, float, complex) or 'bfloat16'",
        )
    return ElementType(dt.name, dt.itemsize, code, dt.str)


# --------------------------------------------------------------------------------------
# Typed views
# --------------------------------------------------------------------------------------


class TypedView:
    """A dense row-major array of ``dtype`` and ``shape`` over the start of a BufferView.

    Made by ``buffer.as_array`` / ``view.as_array``; exports DLPack everywhere and the CUDA
    array interface on CUDA devices. ``stream`` is the producer stream (see the module doc).
    """

    def __init__(
        self, view: BufferView, dtype: ElementType, shape: tuple[int, ...], stream: ProducerStream | None
    ) -> None:
        self.view = view
        self.dtype = dtype
        self.shape = shape
        self.stream = stream

    @property
    def device(self) -> Device:
        return self.view.buffer.device

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def address(self) -> int:
        return self.view.address

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of the CUDA array interface (numba, CuPy, torch.as_tensor read it)."""
        device_type, _ = self.device.dlpack_device
        if device_type is not DLDeviceType.CUDA:
            raise AttributeError(f"the CUDA array interface exists on CUDA devices only, not {self.device.label}")
        if self.dtype.typestr is None:
            raise AttributeError(f"the CUDA array interface has no typestr for {self.dtype.name}; use DLPack")
        self._check_open("__cuda_array_interface__")
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": self.dtype.typestr,
            "data": (self.address if self.nbytes else 0, False),
            "strides": None,  # row-major
            "stream": None if self.stream is None else _cai_stream(self.stream.handle),
        }

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        return self.device.dlpack_device

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule aliasing these bytes; keeps the buffer alive until the consumer frees it.

        A consumer that passes ``max_version`` (1, x) or later gets a writable DLPack 1.0 tensor
        ("dltensor_versioned"); one that passes none gets the unversioned "dltensor", which some
        consumers (numpy) treat as read-only.
        """
        self._check_open("__dlpack__")
        here = self.__dlpack_device__()
        if copy:
            raise BufferError("typed views export their own bytes; copying on export is not supported")
        if dl_device is not None and tuple(dl_device) != tuple(here):
            raise BufferError(f"the bytes live on DLPack device {tuple(here)}, not {tuple(dl_device)}")
        pointer = self.view.buffer._dlpack_pointer()
        _order_consumer(self, here[0], stream)
        versioned = max_version is not None and max_version[0] >= DLPACK_VERSION[0]
        return _capsule(self, here, pointer, versioned)

    def _check_open(self, call: str) -> None:
        if self.view.buffer.closed:
            raise UseAfterClose(f"{self.view.buffer!r} is closed", call=call, device=self.device.label)

    def __repr__(self) -> str:
        return f"TypedView({self.dtype.name}{list(self.shape)} at {self.view.offset} of {self.view.buffer!r})"


def typed_view(
    view: BufferView,
    dtype: Any,
    shape: int | Sequence[int] | None,
    stream: ProducerStream | None,
    call: str,
) -> TypedView:
    """Validate and build a typed view (every failure is an InvalidArgument naming the call)."""
    buffer, label = view.buffer, view.buffer.device.label
    if buffer.closed:
        raise UseAfterClose(f"{buffer!r} is closed", call=call, device=label)
    element = element_type(dtype, call)
    dims = _shape(shape, view.nbytes, element, call, label)
    needed = math.prod(dims) * element.itemsize
    if needed > view.nbytes:
        raise InvalidArgument(
            f"{element.name}{list(dims)} needs {needed} bytes; the view holds {view.nbytes}",
            call=call,
            device=label,
            hint="allocate more, or ask for a smaller shape",
        )
    if view.address % element.itemsize:
        raise InvalidArgument(
            f"{element.name} elements need {element.itemsize}-byte alignment; the view starts at offset "
            f"{view.offset} (address 0x{view.address:x})",
            call=call,
            device=label,
            hint=f"start the view at a multiple of {element.itemsize}",
        )
    if stream is not None and (not isinstance(stream, ProducerStream) or stream.device is not buffer.device):
        raise InvalidArgument(
            f"the producer stream must be a Stream of {label}, got {stream!r}",
            call=call,
            device=label,
        )
    return TypedView(view, element, dims, stream)


def _shape(
    shape: int | Sequence[int] | None, nbytes: int, element: ElementType, call: str, label: str
) -> tuple[int, ...]:
    if shape is None:
        if nbytes % element.itemsize:
            raise InvalidArgument(
                f"{nbytes} bytes are not a whole number of {element.name} elements",
                call=call,
                device=label,
                hint="pass a shape",
            )
        return (nbytes // element.itemsize,)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise InvalidArgument(f"a shape is a sequence of non-negative ints, got {shape!r}", call=call, device=label)
    return tuple(int(d) for d in dims)


def _cai_stream(handle: int) -> int:
    # The interface reserves 0; a stream handle of 0 is the legacy default stream, spelled 1.
    return 1 if handle == 0 else handle


# --------------------------------------------------------------------------------------
# Ordering the consumer after the producer
# --------------------------------------------------------------------------------------

_NO_SYNC = -1  # DLPack: the consumer asks the producer not to synchronize
_DEFAULT_STREAM = {DLDeviceType.CUDA: 1, DLDeviceType.ROCM: 0}  # what stream=None means, per DLPack


def _order_consumer(array: TypedView, device_type: DLDeviceType, stream: int | None) -> None:
    producer = array.stream
    if device_type is DLDeviceType.CPU:
        if stream is not None and stream != _NO_SYNC:
            raise BufferError(f"a CPU consumer passes no stream, got {stream!r}")
        if producer is not None and stream is None:
            producer.synchronize()  # the host reads next: the bytes must have landed
        return
    if stream == _NO_SYNC or producer is None:
        return
    consumer = _DEFAULT_STREAM[device_type] if stream is None else stream
    if not isinstance(consumer, int) or (device_type is DLDeviceType.CUDA and consumer == 0):
        raise BufferError(f"{consumer!r} is not a stream a DLPack consumer may pass for {device_type.name}")
    if consumer == producer.handle:
        return
    device = array.device
    event = device.event()
    wrapped = device.stream_from_handle(consumer)
    try:
        producer.record(event)
        wrapped.wait(event)
    finally:
        wrapped.close()  # not owned: the consumer's stream lives on
        event.close()  # destroying an event with a pending wait is allowed; the wait still holds


# --------------------------------------------------------------------------------------
# DLPack capsules (dlpack.h: DLManagedTensor, and DLManagedTensorVersioned from DLPack 1.0)
# --------------------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _DELETER),
        ("flags", ctypes.c_uint64),  # 0: writable, not a copy
        ("dl_tensor", _DLTensor),
    ]


DLPACK_VERSION = (1, 0)
# Consumers rename a capsule "used_..." once they own its tensor; one still named so was never consumed.
_LEGACY_NAME = b"dltensor"
_VERSIONED_NAME = b"dltensor_versioned"


@dataclass
class _Export:
    """What one capsule's tensor points into; dropped when the consumer (or the capsule) deletes it."""

    managed: _DLManagedTensor | _DLManagedTensorVersioned
    shape: ctypes.Array[ctypes.c_int64]
    strides: ctypes.Array[ctypes.c_int64]
    array: TypedView  # holds the buffer, so it is not collected while the consumer reads it


_exports: dict[int, _Export] = {}
_exports_lock = threading.Lock()


def live_exports() -> int:
    """How many exported DLPack tensors no consumer has freed yet."""
    with _exports_lock:
        return len(_exports)


def _delete(managed: int | None) -> None:
    with _exports_lock:
        _exports.pop(managed or 0, None)


_deleter = _DELETER(_delete)

# Private function objects: setting argtypes on ctypes.pythonapi's would change them for everyone.
_capi = ctypes.PyDLL(None, handle=ctypes.pythonapi._handle)
_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # the capsule as a raw pointer: it is being freed
_capsule_new = _capi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _DESTRUCTOR]
_capsule_is_valid = _capi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = _capi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


def _destroy_capsule(capsule: int | None) -> None:
    for name in (_LEGACY_NAME, _VERSIONED_NAME):
        if capsule and _capsule_is_valid(capsule, name):
            _delete(_capsule_pointer(capsule, name))


_destructor = _DESTRUCTOR(_destroy_capsule)


def _capsule(array: TypedView, device: tuple[DLDeviceType, int], pointer: int, versioned: bool) -> Any:
    ndim = len(array.shape)
    shape = (ctypes.c_int64 * max(ndim, 1))(*array.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*_row_major_strides(array.shape))
    managed: _DLManagedTensor | _DLManagedTensorVersioned
    if versioned:
        managed = _DLManagedTensorVersioned()
        managed.version = _DLPackVersion(*DLPACK_VERSION)
        managed.flags = 0
    else:
        managed = _DLManagedTensor()
    tensor = managed.dl_tensor
    # data is the allocation's start and byte_offset the view's, as dlpack.h asks of device pointers.
    tensor.data = pointer or None
    tensor.device = _DLDevice(int(device[0]), int(device[1]))
    tensor.ndim = ndim
    tensor.dtype = _DLDataType(array.dtype.code, array.dtype.bits, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = array.view.offset if pointer else 0
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _exports_lock:
        _exports[address] = _Export(managed, shape, strides, array)
    try:
        return _capsule_new(address, _VERSIONED_NAME if versioned else _LEGACY_NAME, _destructor)
    except BaseException:
        _delete(address)
        raise


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return strides[::-1]


# --------------------------------------------------------------------------------------
# Foreign streams and events
# --------------------------------------------------------------------------------------


def type_name(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_int(obj: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(obj, (int, np.integer)) and not isinstance(obj, bool)


def stream_handle(obj: Any, device: Device, *, foreign: bool) -> int:
    """The native handle behind ``obj``, an int or (``foreign``) another library's stream: ``__cuda_stream__``
    objects, torch streams (``cuda_stream``), CuPy streams (``ptr``). Device.stream_from takes its own first.
    """
    call = "Device.stream_from"
    if _is_int(obj):
        return int(obj)
    if foreign:
        protocol = getattr(obj, "__cuda_stream__", None)
        if callable(protocol):
            answer = protocol()
            if not (isinstance(answer, tuple) and len(answer) == 2 and answer[0] == 0 and _is_int(answer[1])):
                raise InvalidArgument(
                    f"{type_name(obj)}.__cuda_stream__() returned {answer!r}, not (0, handle)",
                    call=call,
                    device=device.label,
                )
            return int(answer[1])
        for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            value = getattr(obj, attribute, None)
            if _is_int(value):
                return int(value)
    raise _refusal("stream", obj, device, call, foreign)


def event_handle(obj: Any, device: Device, *, foreign: bool) -> int:
    """The native handle behind ``obj``: an int or (``foreign``) a torch or CuPy event.

    Device.event_from refuses its own events first.
    """
    call = "Device.event_from"
    if _is_int(obj):
        return int(obj)
    if foreign:
        for attribute in ("cuda_event", "ptr"):  # torch.cuda.Event, cupy.cuda.Event
            value = getattr(obj, attribute, None)
            if _is_int(value):
                if not value:
                    raise InvalidArgument(
                        f"the {type_name(obj)} has no native event yet",
                        call=call,
                        device=device.label,
                        hint="torch creates its event on the first record(): record it before wrapping",
                    )
                return int(value)
    raise _refusal("event", obj, device, call, foreign)


def _refusal(what: str, obj: object, device: Device, call: str, foreign: bool) -> InvalidArgument:
    if foreign:
        hint = f"pass an int handle, an object with __cuda_stream__, or a torch or CuPy {what}"
    else:
        hint = f"the {device.backend.name} backend has no native {what}s of other libraries"
    return InvalidArgument(f"cannot wrap {type_name(obj)} as a {what}", call=call, device=device.label, hint=hint)


__all__ = [
    "BFLOAT16",
    "DLPACK_VERSION",
    "DLDeviceType",
    "ElementType",
    "ProducerStream",
    "TypedView",
    "element_type",
    "event_handle",
    "live_exports",
    "stream_handle",
    "type_name",
    "typed_view",
]
