"""The CUDA and HIP backends, written once over the vendor call table of _gpu_api.

Everything but the vendor calls lives here: setting the device current, keeping copy sources
alive while the device reads them, caching compiled kernels, and releasing native handles
exactly once (on close(), when the owner is garbage collected, or at interpreter exit, in the
order streams, events, device memory, host memory, modules).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import hashlib
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, ClassVar, TypeVar

import numpy as np

from .._env import switch
from ..errors import (
    BackendError,
    BackendUnavailable,
    DeviceError,
    InvalidArgument,
    KernelCompileError,
    OutOfDeviceMemory,
)
from . import _image_cache
from ._gpu_api import HINTS, ApiTable, Call, CopyKind, DeviceAttr, Problem, invoke, poll, unusable_reason
from .base import (
    UNASKED_SHARED_BYTES,
    Backend,
    BufferView,
    Capabilities,
    Device,
    DeviceBuffer,
    Event,
    Graph,
    HostBuffer,
    HostMemory,
    Kernel,
    RowGather,
    Stream,
    Usage,
    Vendor,
)
from .dlpack import DLDeviceType

log = logging.getLogger(__name__)
_T = TypeVar("_T", "GpuEvent", "GpuKernel", "GpuStream")

# A stream holding this many unreleased copy sources asks the device whether it is done, so
# that a producer that never synchronizes does not accumulate references forever.
_PRUNE_PENDING_AT = 256

GATHER_KERNEL = "expertstream_gather_rows"
_GATHER_CHUNK_BYTES = 32768  # gather.cu's GATHER_CHUNK_BYTES: the bytes of a row one block copies
_GATHER_THREADS = 256
_MAX_GRID_ROWS = 65535  # a grid's y extent


def gather_source() -> str:
    """The CUDA-C source of Stream.gather_h2d's kernel (gather.cu), as NVRTC and hipRTC compile it."""
    return resources.files(__package__).joinpath("gather.cu").read_text(encoding="ascii")


def _native(obj: Any, cls: type[_T], call: str, device: GpuDevice) -> _T:
    """``obj`` as this backend's own class, or InvalidArgument (an event or kernel of another backend)."""
    if not isinstance(obj, cls) or obj.device.backend is not device.backend:
        raise InvalidArgument(
            f"{obj!r} does not belong to the {device.backend.name} backend of {device.label}",
            call=call,
            device=device.label,
        )
    return obj


Steps = Sequence[tuple[Call, tuple[Any, ...]]]


def _release_quietly(steps: Steps, device: str, *_keep_alive: Any) -> None:
    """Release a native handle where an error cannot be raised (garbage collection, exit).

    ``_keep_alive`` holds memory that must outlive the release (a registered host array).
    """
    for call, args in steps:
        try:
            invoke(call, *args, device=device)
        except Exception as exc:  # a dying driver at exit, or a context already gone
            log.debug("%s on %s during release: %s", call.name, device, exc)


def _finalizer(owner: object, steps: Steps, device: str, *keep_alive: Any) -> weakref.finalize:
    """Release ``steps`` when ``owner`` is collected; at exit _release_at_exit goes first, in order."""
    release = weakref.finalize(owner, _release_quietly, steps, device, *keep_alive)
    release.atexit = False
    return release


# --------------------------------------------------------------------------------------
# Memory, events, kernels
# --------------------------------------------------------------------------------------


class GpuBuffer(DeviceBuffer):
    def __init__(self, device: GpuDevice, nbytes: int, alloc_size: int, usage: Usage, pointer: int) -> None:
        super().__init__(device, nbytes, alloc_size, usage)
        self._device = device
        self._pointer = pointer
        steps = [(device.api.free, (pointer,))] if pointer else []
        self._release = _finalizer(self, steps, device.label)

    @property
    def address(self) -> int:
        return self._pointer

    def _free(self) -> None:
        if self._release.detach() is not None and self._pointer:
            self._device.activate()
            invoke(self._device.api.free, self._pointer, device=self._device.label)


class GpuEvent(Event):
    def __init__(self, device: GpuDevice, timing: bool, handle: int, *, owned: bool = True) -> None:
        super().__init__(device, timing, owned=owned)
        self._device = device
        self.handle = handle
        self._recorded: tuple[GpuStream, int] | None = None  # stream and its pending sequence number
        steps = [(device.api.event_destroy, (handle,))] if owned else []
        self._release = _finalizer(self, steps, device.label)

    def query(self) -> bool:
        self._check_open("Event.query")
        done = poll(self._device.api.event_query, self.handle, device=self._device.label)
        if done:
            self._completed()
        return done

    def synchronize(self) -> None:
        self._check_open("Event.synchronize")
        invoke(self._device.api.event_synchronize, self.handle, device=self._device.label)
        self._completed()

    def _elapsed_ms(self, end: Event) -> float:
        end = _native(end, GpuEvent, "Event.elapsed_ms", self._device)
        end.synchronize()
        return float(invoke(self._device.api.event_elapsed, self.handle, end.handle, device=self._device.label))

    def _completed(self) -> None:
        if self._recorded is not None:
            stream, seq = self._recorded
            stream._release_through(seq)

    def _destroy(self) -> None:
        if self._release.detach() is not None:
            invoke(self._device.api.event_destroy, self.handle, device=self._device.label)
        self._recorded = None


class GpuKernel(Kernel):
    def __init__(self, device: GpuDevice, name: str, function: Any, launch: Call) -> None:
        super().__init__(device, name)
        self.function = function
        # how it is launched: chained to the kernel before it where it waits for it (compile's
        # ``chained``) and the device chains launches, else on its own
        self.launch = launch
        self.shared_allowed = UNASKED_SHARED_BYTES  # dynamic shared memory it may launch with now

    def allow_shared(self, nbytes: int) -> None:
        """Let this kernel launch with nbytes (more than shared_allowed) of dynamic shared memory,
        asking the vendor where it must be asked."""
        device = self.device
        assert isinstance(device, GpuDevice)
        if device.api.allow_shared is not None:
            device.activate()
            invoke(device.api.allow_shared, self.function, nbytes, device=device.label)
        self.shared_allowed = nbytes


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------


class GpuGraph(Graph):
    """An instantiated graph; it holds the host arrays its captured copies read."""

    def __init__(self, device: GpuDevice, calls: int, executable: Any, steps: Steps, keep: list[Any]) -> None:
        super().__init__(device, calls)
        self._device = device
        self._executable = executable
        self._steps = steps
        self._keep = keep
        self._release = _finalizer(self, steps, device.label, *keep)

    def _launch(self, stream: Stream) -> None:
        stream = _native(stream, GpuStream, "Graph.launch", self._device)
        stream._enqueue(self._device.api.graph_launch, self._executable, stream.handle)

    def _destroy(self) -> None:
        if self._release.detach() is not None:
            # Launches may still run, reading the host arrays this graph keeps: wait for them first.
            self._device.activate()
            invoke(self._device.api.device_synchronize, device=self._device.label)
            for call, args in self._steps:
                invoke(call, *args, device=self._device.label)
        self._keep = []


class GpuStream(Stream):
    def __init__(self, device: GpuDevice, handle: int, *, owned: bool) -> None:
        super().__init__(device, owned=owned)
        self._device = device
        self._api = device.api
        self._handle = handle
        # Host arrays of copies the device may still be reading or writing, with the sequence
        # number current when each was enqueued; released when a sync shows them done.
        self._pending: deque[tuple[int, Any]] = deque()
        self._seq = 0
        self._lock = threading.Lock()
        self._captured: list[Any] = []  # while capturing: the host arrays the graph's copies read
        self._captured_calls = 0
        steps = [(self._api.stream_synchronize, (handle,)), (self._api.stream_destroy, (handle,))]
        self._release = _finalizer(self, steps if owned else [], device.label)

    @property
    def handle(self) -> int:
        return self._handle

    def _enqueue(self, call: Call, *args: Any, node: bool = True) -> None:
        """``node``: whether a capture makes the call a node of its graph (an event's record or
        wait only orders the nodes, so it is not counted in ``Graph.operations``)."""
        self._device.activate()
        invoke(call, *args, device=self._device.label)
        if self.capturing and node:
            self._origin()._captured_calls += 1

    def _origin(self) -> GpuStream:
        """The stream whose capture this one's work goes into (itself, or the one it forked from)."""
        origin = self.capture_origin
        assert isinstance(origin, GpuStream)
        return origin

    def _keep(self, host: HostBuffer) -> None:
        if self.capturing:  # the graph keeps it for as long as it can be launched
            self._origin()._captured.append(host.array)
            return
        with self._lock:
            self._seq += 1
            self._pending.append((self._seq, host.array))
            crowded = len(self._pending) > _PRUNE_PENDING_AT
        if crowded:
            self.query()

    def _release_through(self, seq: int) -> None:
        with self._lock:
            while self._pending and self._pending[0][0] <= seq:
                self._pending.popleft()

    def _release_all(self) -> None:
        self._release_through(self._seq)

    def _copy_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, src_offset: int, n: int) -> None:
        self._enqueue(
            self._api.memcpy_async,
            dst.address + dst_offset,
            src.address + src_offset,
            n,
            CopyKind.HOST_TO_DEVICE,
            self._handle,
        )
        self._keep(src)

    def _copy_d2h(self, dst: HostBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, n: int) -> None:
        self._enqueue(
            self._api.memcpy_async,
            dst.address + dst_offset,
            src.address + src_offset,
            n,
            CopyKind.DEVICE_TO_HOST,
            self._handle,
        )
        self._keep(dst)

    def _copy_d2d(self, dst: DeviceBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, n: int) -> None:
        dst_addr, src_addr = dst.address + dst_offset, src.address + src_offset
        if dst.device is src.device:
            self._enqueue(self._api.memcpy_async, dst_addr, src_addr, n, CopyKind.DEVICE_TO_DEVICE, self._handle)
        else:
            self._enqueue(
                self._api.memcpy_peer_async,
                dst_addr,
                dst.device.index,
                src_addr,
                src.device.index,
                n,
                self._handle,
            )

    def _memset(self, dst: DeviceBuffer, offset: int, n: int, value: int) -> None:
        self._enqueue(self._api.memset_async, dst.address + offset, value, n, self._handle)

    def _gather_h2d(self, dst: DeviceBuffer, dst_offset: int, src: HostBuffer, rows: RowGather) -> None:
        device = self._device
        kernel = device.gather_kernel()
        mapped = device.host_device_address(src) + rows.src_offset
        overrun = 0 if rows.packed else rows.overrun
        chunks = -(-min(rows.row_nbytes + overrun, rows.nbytes) // _GATHER_CHUNK_BYTES)
        for first in range(0, rows.n_ids, _MAX_GRID_ROWS):
            count = min(_MAX_GRID_ROWS, rows.n_ids - first)
            values, types = pack_kernel_args(
                (
                    np.uint64(dst.address + dst_offset),
                    np.uint64(mapped),
                    rows.ids,
                    np.int32(first),
                    np.uint64(rows.nbytes),
                    np.uint64(rows.row_nbytes),
                    np.uint64(rows.overrun),
                    np.uint64(0) if rows.report is None else rows.report,
                    np.int32(rows.tag),
                    np.uint64(0) if rows.skip is None else rows.skip,
                    np.int32(rows.n_skip),
                    np.int32(rows.packed),
                    np.uint64(0) if rows.slots is None else rows.slots,
                )
            )
            grid = (chunks, count, 1)
            self._enqueue(kernel.launch, kernel.function, grid, (_GATHER_THREADS, 1, 1), 0, self._handle, values, types)
        self._keep(src)

    def _begin_capture(self) -> None:
        self._captured, self._captured_calls = [], 0
        self._enqueue(self._api.stream_begin_capture, self._handle)

    def _end_capture(self, keep: bool) -> Graph | None:
        device = self._device
        device.activate()
        graph = invoke(self._api.stream_end_capture, self._handle, device=device.label)
        destroy_graph = (self._api.graph_destroy, (graph,))
        if not keep:
            _release_quietly([destroy_graph], device.label)
            return None
        try:
            executable = invoke(self._api.graph_instantiate, graph, device=device.label)
        except BaseException:
            _release_quietly([destroy_graph], device.label)
            raise
        steps = [(self._api.graph_exec_destroy, (executable,)), destroy_graph]
        return GpuGraph(device, self._captured_calls, executable, steps, self._captured)

    def _record(self, event: Event) -> None:
        event = _native(event, GpuEvent, "Stream.record", self._device)
        self._enqueue(self._api.event_record, event.handle, self._handle, node=False)
        with self._lock:
            event._recorded = (self, self._seq)

    def _wait(self, event: Event) -> None:
        event = _native(event, GpuEvent, "Stream.wait", self._device)
        self._enqueue(self._api.stream_wait_event, self._handle, event.handle, node=False)

    def _launch(
        self,
        kernel: Kernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int,
    ) -> None:
        kernel = _native(kernel, GpuKernel, "Stream.launch", self._device)
        if shared_mem > kernel.shared_allowed:
            kernel.allow_shared(shared_mem)
        values, types = pack_kernel_args(args)
        self._enqueue(kernel.launch, kernel.function, grid, block, shared_mem, self._handle, values, types)

    def synchronize(self) -> None:
        self._check_open("Stream.synchronize")
        invoke(self._api.stream_synchronize, self._handle, device=self._device.label)
        self._release_all()

    def query(self) -> bool:
        self._check_open("Stream.query")
        with self._lock:
            seq = self._seq
        done = poll(self._api.stream_query, self._handle, device=self._device.label)
        if done:
            self._release_through(seq)
        return done

    def _destroy(self) -> None:
        # Destroying returns at once while work may still run: wait, so the sources we hold
        # are not dropped while the device reads them.
        if self._release.detach() is not None:
            invoke(self._api.stream_synchronize, self._handle, device=self._device.label)
            invoke(self._api.stream_destroy, self._handle, device=self._device.label)
        self._release_all()


# --------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------


@dataclass
class _Live:
    """What a device has handed out and must release at close, in release order."""

    streams: weakref.WeakSet[GpuStream] = dataclasses.field(default_factory=weakref.WeakSet)
    events: weakref.WeakSet[GpuEvent] = dataclasses.field(default_factory=weakref.WeakSet)
    buffers: weakref.WeakSet[GpuBuffer] = dataclasses.field(default_factory=weakref.WeakSet)
    # pinned or registered host memory, each with the release that frees or unregisters it
    host: weakref.WeakKeyDictionary[HostBuffer, weakref.finalize] = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary
    )

    def in_release_order(self) -> list[Any]:
        return [*self.streams, *self.events, *self.buffers, *self.host.keys()]


class GpuDevice(Device):
    foreign_handles = True

    def __init__(self, backend: GpuBackend, index: int, chained_launches: bool, stack_limit: int | None) -> None:
        super().__init__(backend, index, "")
        self.api = backend.api
        props = invoke(self.api.device_props, index, device=self.label)
        self._info = self.api.read_props(props)
        self.name = self._info.name
        # How kernels that wait for the kernels before them (compile's ``chained``: formats.cu's
        # KERNEL_PROLOGUE) launch: chained where the device has it and the backend was not asked
        # otherwise. Every other kernel launches on its own.
        self._launch_chained = (
            self.api.launch_chained if chained_launches and self.api.chained_launches(self.arch) else None
        )
        self._register_flags = {ro: self.api.register_flags(props, ro) for ro in (False, True)}
        self._async_engines = self._attribute(DeviceAttr.ASYNC_ENGINE_COUNT)
        self._can_register = bool(self._attribute(DeviceAttr.HOST_REGISTER))
        self._can_register_ro = bool(self._attribute(DeviceAttr.HOST_REGISTER_READ_ONLY))
        self._max_shared = self._attribute(DeviceAttr.MAX_SHARED_PER_BLOCK)
        self._peers: set[GpuDevice] = set()  # devices, not indices: another backend's device 0 is not ours
        self._live = _Live()
        self._modules: dict[str, Any] = {}  # source hash -> loaded module
        self._kernels: dict[tuple[str, str, bool], GpuKernel] = {}  # by (source hash, name, chained)
        self._compile_lock = threading.Lock()
        self._gather: GpuKernel | None = None  # gather.cu's kernel, once compiled
        # the per-thread stack limit to give the context when it is first made current (None: the
        # context's, left as it is); stack_limit is the one set then, None where none was
        self._stack_request = stack_limit
        self._context_ready = False
        self._context_lock = threading.Lock()
        self.stack_limit: int | None = None

    def _attribute(self, attr: DeviceAttr) -> int:
        return int(invoke(self.api.device_attribute, attr, self.index, device=self.label))

    def activate(self) -> None:
        """Make this device current for the calling thread (each thread has its own). The first time,
        its context gets the stack limit the backend was opened with."""
        invoke(self.api.set_device, self.index, device=self.label)
        if not self._context_ready:
            with self._context_lock:  # one thread sets it; the others wait until it is set
                if not self._context_ready:
                    self._set_stack_limit()
                    self._context_ready = True

    def _set_stack_limit(self) -> None:
        request, call = self._stack_request, self.api.set_stack_limit
        if request is None or call is None:
            return
        try:
            invoke(call, request, device=self.label)
        except BackendError as exc:
            log.warning(
                "%s: the per-thread stack limit stays the driver's, not %d bytes (%s): its context reserves "
                "more device memory for every thread it can hold",
                self.label,
                request,
                exc,
            )
            return
        self.stack_limit = request

    # -- properties ---------------------------------------------------------------------
    @property
    def total_memory(self) -> int:
        return self._info.total_memory

    def free_memory(self) -> int:
        self.activate()
        free, _total = invoke(self.api.mem_info, device=self.label)
        return int(free)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            async_copies=self._async_engines > 0,
            events=True,
            host_register=self._can_register,
            host_register_read_only=self._can_register and self._can_register_ro,
            peer_access=frozenset(peer.index for peer in self._peers),
            matrix_cores=self.api.matrix_cores(self.arch),
            int8_matrix_cores=self.api.int8_matrix_cores(self.arch),
            mma_fragments=self.api.mma_fragments(self.arch),
            chained_launches=self._launch_chained is not None,
            max_shared_bytes=self._max_shared,
        )

    @property
    def arch(self) -> str:
        return self._info.arch

    @property
    def dlpack_device(self) -> tuple[DLDeviceType, int]:
        return (DLDeviceType.CUDA if self.backend.vendor is Vendor.NVIDIA else DLDeviceType.ROCM, self.index)

    # -- device memory ------------------------------------------------------------------
    def _alloc(self, nbytes: int, alloc_size: int, usage: Usage) -> DeviceBuffer:
        pointer = 0
        if alloc_size:
            self.activate()
            try:
                pointer = int(invoke(self.api.malloc, alloc_size, device=self.label))
            except OutOfDeviceMemory as exc:
                raise exc.with_detail(f"cannot allocate {alloc_size} bytes; {self._free_text()}") from None
        buf = GpuBuffer(self, nbytes, alloc_size, usage, pointer)
        self._live.buffers.add(buf)
        return buf

    def _free_text(self) -> str:
        try:
            return f"{self.free_memory()} bytes free of {self.total_memory}"
        except BackendError:
            return "free memory unknown"

    # -- streams and events -------------------------------------------------------------
    def stream(self) -> Stream:
        self.activate()
        stream = GpuStream(self, int(invoke(self.api.stream_create, device=self.label)), owned=True)
        self._live.streams.add(stream)
        return stream

    def stream_from_handle(self, handle: int) -> Stream:
        if not isinstance(handle, int) or isinstance(handle, bool):
            raise InvalidArgument(
                f"a stream handle is an int, got {type(handle).__name__}",
                call="Device.stream_from_handle",
                device=self.label,
            )
        stream = GpuStream(self, handle, owned=False)
        self._live.streams.add(stream)
        return stream

    def event_from_handle(self, handle: int, timing: bool = False) -> Event:
        if not isinstance(handle, int) or isinstance(handle, bool) or handle == 0:
            raise InvalidArgument(
                f"an event handle is a non-zero int, got {handle!r}",
                call="Device.event_from_handle",
                device=self.label,
            )
        event = GpuEvent(self, timing, handle, owned=False)
        self._live.events.add(event)
        return event

    def event(self, timing: bool = False) -> Event:
        self.activate()
        event = GpuEvent(self, timing, int(invoke(self.api.event_create, timing, device=self.label)))
        self._live.events.add(event)
        return event

    def synchronize(self) -> None:
        self.activate()
        invoke(self.api.device_synchronize, device=self.label)
        for stream in list(self._live.streams):
            stream._release_all()

    def enable_peer_access(self, other: Device) -> None:
        if other is self or other in self._peers:
            return
        if not isinstance(other, GpuDevice) or other.backend is not self.backend:
            raise InvalidArgument(
                f"{other.label} belongs to another backend",
                call="Device.enable_peer_access",
                device=self.label,
            )
        if not invoke(self.api.can_access_peer, self.index, other.index, device=self.label):
            raise InvalidArgument(
                f"{self.label} cannot access {other.label}'s memory",
                call="Device.enable_peer_access",
                device=self.label,
                hint="stage the data through host memory",
            )
        self.activate()
        invoke(self.api.enable_peer_access, other.index, device=self.label, accept={Problem.PEER_ALREADY_ENABLED})
        self._peers.add(other)

    # -- kernels ------------------------------------------------------------------------
    def compile(self, source: str, name: str, twin: object | None = None, chained: bool = False) -> Kernel:
        key = hashlib.sha256(source.encode()).hexdigest()
        with self._compile_lock:  # two threads asking for one kernel load its module once
            kernel = self._kernels.get((key, name, chained))
            if kernel is None:
                kernel = self._load_kernel(source, key, name, chained)
                self._kernels[(key, name, chained)] = kernel
        return kernel

    def _load_kernel(self, source: str, key: str, name: str, chained: bool) -> GpuKernel:
        self.activate()
        module = self._modules.get(key)
        loaded_here = module is None
        if module is None:
            module = invoke(self.api.module_load, _compiled_image(self, source, key, name), device=self.label)
        try:
            function = invoke(self.api.module_get_function, module, name.encode(), device=self.label)
        except BackendError:
            if loaded_here:  # nothing else uses it: do not leak it
                _release_quietly([(self.api.module_unload, (module,))], self.label)
            raise
        self._modules[key] = module
        return GpuKernel(self, name, function, (chained and self._launch_chained) or self.api.launch)

    def gather_kernel(self) -> GpuKernel:
        """gather.cu's kernel, compiled on first use (and cached like every kernel)."""
        kernel = self._gather
        if kernel is None:
            compiled = self.compile(gather_source(), GATHER_KERNEL, chained=True)
            assert isinstance(compiled, GpuKernel)
            kernel = self._gather = compiled
        return kernel

    # -- host memory --------------------------------------------------------------------
    def host_device_address(self, host: HostBuffer) -> int:
        """The address kernels on this device read page-locked ``host`` at."""
        self.activate()
        try:
            return int(invoke(self.api.host_device_pointer, host.address, device=self.label))
        except BackendError as exc:
            raise DeviceError(
                f"{host.kind.value} host memory of {host.nbytes} bytes is not mapped for this device",
                call=exc.call,
                device=self.label,
                code=exc.code,
                hint="copy with copy_h2d instead (the scheduler's decode path reads the ids back then)",
            ) from None

    def alloc_pinned(self, nbytes: int) -> HostBuffer:
        if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidArgument(
                f"cannot allocate {nbytes!r} pinned bytes", call="Device.alloc_pinned", device=self.label
            )
        nbytes = int(nbytes)
        if nbytes == 0:
            return HostBuffer(self, np.empty(0, dtype=np.uint8), HostMemory.PINNED)
        self.activate()
        pointer = int(invoke(self.api.host_alloc, nbytes, device=self.label))
        steps = [(self.api.host_free, (pointer,))]
        try:
            raw = (ctypes.c_uint8 * nbytes).from_address(pointer)
            # Tied to the ctypes object every numpy view of it keeps alive: a view that outlives
            # the HostBuffer never points at freed memory unless close() was called.
            release = _finalizer(raw, steps, self.label)
            host = HostBuffer(self, np.ctypeslib.as_array(raw), HostMemory.PINNED, pinned_handle=pointer)
        except BaseException:
            _release_quietly(steps, self.label)
            raise
        self._live.host[host] = release
        return host

    def _host_free_pinned(self, host: HostBuffer) -> None:
        if self._take_release(host) and host._pinned_handle:
            invoke(self.api.host_free, host._pinned_handle, device=self.label)

    def _host_register(self, host: HostBuffer, read_only: bool) -> None:
        flags = self._register_flags[read_only]
        self.activate()
        try:
            invoke(self.api.host_register, host.address, host.nbytes, flags, device=self.label)
        except BackendError as exc:
            if not read_only:
                raise
            self._refuse_read_only(host, flags, exc)
        # The array rides along with the release so the memory outlives its registration.
        self._live.host[host] = _finalizer(host, [(self.api.host_unregister, (host.address,))], self.label, host.array)

    def _refuse_read_only(self, host: HostBuffer, flags: int, exc: BackendError) -> None:
        # Some platforms advertise registration but refuse a read-only mapping: say so once,
        # then report the capability as absent so callers stage through pinned memory instead.
        self._can_register_ro = False
        log.info(
            "%s refused read-only host registration of %d bytes (%s, flags 0x%x); read-only memory "
            "will not be registered on this device",
            self.label,
            host.nbytes,
            exc.code,
            flags,
        )
        raise DeviceError(
            f"read-only host registration of {host.nbytes} bytes was refused",
            call=exc.call,
            device=self.label,
            code=exc.code,
            hint="copy the data into pinned memory (alloc_pinned) or use a staging ring",
        ) from None

    def _host_unregister(self, host: HostBuffer) -> None:
        if self._take_release(host):
            self.activate()
            invoke(self.api.host_unregister, host.address, device=self.label)

    def _take_release(self, host: HostBuffer) -> bool:
        """True if the caller now owns the release of ``host`` (nothing released it yet)."""
        release = self._live.host.pop(host, None)
        return release is not None and release.detach() is not None

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Release everything this device handed out: streams, events, buffers, host memory, modules."""
        super().close()
        for obj in self._live.in_release_order():
            obj.close()
        self._unload_modules(quiet=False)

    def _release_at_exit(self) -> None:
        for obj in self._live.in_release_order():
            try:
                obj.close()
            except Exception as exc:  # the driver may already be going away
                log.debug("releasing %r on %s at exit: %s", obj, self.label, exc)
        self._unload_modules(quiet=True)

    def _unload_modules(self, quiet: bool) -> None:
        modules = list(self._modules.values())
        self._modules.clear()
        self._kernels.clear()
        self._gather = None
        for module in modules:
            if quiet:
                _release_quietly([(self.api.module_unload, (module,))], self.label)
            else:
                invoke(self.api.module_unload, module, device=self.label)


# Compiled images are shared by every device of one architecture and every backend opened
# in the process: compiling is the slow part, loading per device is cheap. Across processes
# the on-disk cache (_image_cache) keeps them.
_images: dict[tuple[str, str, str], bytes] = {}
_images_lock = threading.Lock()


def _compiled_image(device: GpuDevice, source: str, key: str, name: str) -> bytes:
    api = device.api
    cache_key = (api.backend_name, device.arch, key)
    with _images_lock:
        image = _images.get(cache_key)
    if image is not None:
        return image
    options = api.compile_options(device.arch)
    disk, disk_key = _disk_entry(device, key, options)
    image = disk.load(disk_key) if disk is not None else None
    if image is None:
        image = _compile(device, source, name, options)
        if disk is not None:
            disk.store(disk_key, image)
    with _images_lock:
        _images[cache_key] = image
    return image


def _disk_entry(device: GpuDevice, key: str, options: list[bytes]) -> tuple[_image_cache.ImageCache | None, str]:
    """The on-disk cache and the entry for this source, or (None, "") when off or versions are unknown."""
    disk = _image_cache.open_cache()
    if disk is None:
        return None, ""
    api = device.api
    try:
        compiler = invoke(api.compiler_version, device=device.label)
        driver = invoke(api.driver_version, device=device.label)
    except BackendError as exc:
        log.debug("kernel cache off for %s: versions unknown (%s)", device.label, exc)
        return None, ""
    parts = (api.backend_name, api.bindings_version, str(driver), str(compiler), device.arch, key)
    return disk, _image_cache.image_key(*parts, *(o.decode(errors="replace") for o in options))


def _compile(device: GpuDevice, source: str, name: str, options: list[bytes]) -> bytes:
    api = device.api
    program = invoke(api.program_create, source.encode(), f"{name}.cu".encode(), device=device.label)
    try:
        try:
            invoke(api.program_compile, program, options, device=device.label)
        except KernelCompileError as exc:
            compiler_log = _program_log(device, program)
            raise exc.with_detail(f"{name} did not compile for {device.arch}:\n{compiler_log}") from None
        return bytes(invoke(api.program_code, program, device=device.label))
    finally:
        _release_quietly([(api.program_destroy, (program,))], device.label)


def _program_log(device: GpuDevice, program: Any) -> str:
    try:
        return str(invoke(device.api.program_log, program, device=device.label)).strip()
    except BackendError as exc:
        return f"(no compiler log: {exc})"


# --------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------

_open_backends: weakref.WeakSet[GpuBackend] = weakref.WeakSet()


class GpuBackend(Backend):
    """A vendor runtime and its devices; cuda.py and hip.py subclass it with their table."""

    name: ClassVar[str]
    vendor: ClassVar[Vendor]

    def __init__(
        self,
        api: ApiTable,
        *,
        chained_launches: bool | None = None,
        stack_limit: int | str | None = None,
        **options: Any,
    ) -> None:
        """``chained_launches``: launch each kernel chained to the one before it in its stream, where
        the device can (Capabilities.chained_launches); False launches every kernel on its own. None
        reads $EXPERTSTREAM_CHAINED_LAUNCHES (0 or 1); unset, chained from the vendor's
        ``chained_default_driver`` on (CUDA 12.3; decode 3% faster on an H100, docs/results/
        decode-round5.md), each on its own below it.

        ``stack_limit``: the per-thread stack limit, in bytes, each device's context gets when it is
        first made current, where the vendor's table can set it (CUDA); "driver" leaves the context's
        limit as it is (the driver's, unless something in the process set another).
        None reads $EXPERTSTREAM_STACK_LIMIT (the same values); unset, STACK_LIMIT_BYTES."""
        super().__init__()
        if options:
            raise InvalidArgument(
                f"the {self.name} backend takes only chained_launches and stack_limit, got {sorted(options)}",
                call=f"expertstream.backend({self.name!r})",
                hint="open it as expertstream.backend(name) or with chained_launches=False",
            )
        stack_bytes, asked = _stack_limit(self.name, stack_limit)
        if api.set_stack_limit is None and asked and stack_bytes is not None:
            log.warning("the %s backend leaves the stack limit to its runtime: stack_limit is CUDA's", self.name)
        self.api = api
        invoke(api.init, device=None)
        if chained_launches is None:
            driver = int(invoke(api.driver_version))
            on_by_default = api.chained_default_driver > 0 and driver >= api.chained_default_driver
            chained_launches = _chained_from_environment(self.name, on_by_default)
        count = int(invoke(api.device_count))
        if count == 0:
            raise BackendUnavailable(
                f"no {self.name} device", call=api.device_count.name, hint=HINTS[Problem.NO_DEVICE]
            )
        self._devices = [GpuDevice(self, i, chained_launches, stack_bytes) for i in range(count)]
        self.closed = False
        _open_backends.add(self)

    @property
    def devices(self) -> Sequence[Device]:
        return self._devices

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _open_backends.discard(self)
            super().close()

    @contextmanager
    def profiler_range(self) -> Iterator[None]:
        start, stop = self.api.profiler_start, self.api.profiler_stop
        if start is None or stop is None:
            yield
            return
        invoke(start)
        try:
            yield
        finally:
            invoke(stop)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["driver_version"] = int(invoke(self.api.driver_version))
        out["bindings_version"] = self.api.bindings_version
        for entry, device in zip(out["devices"], self._devices, strict=True):
            entry["stack_limit"] = device.stack_limit  # bytes a thread set at first use; None: none set
        return out


CHAINED_LAUNCHES_VAR = "EXPERTSTREAM_CHAINED_LAUNCHES"
STACK_LIMIT_VAR = "EXPERTSTREAM_STACK_LIMIT"
# The per-thread stack limit a device's context gets (CUDA): the driver reserves that much local memory
# for every thread the device can hold, 264 MiB on an H100 (132 x 2048 threads) at CUDA's default of
# 1024 bytes, and raises the limit itself for a kernel whose frame needs more. The largest frame of the
# kernel source is 176 bytes (ptxas -v for sm_90, every type); at 256 bytes a generating process on an
# H100 held 198 MiB less (docs/results/device-memory.md).
STACK_LIMIT_BYTES = 256


def _stack_limit(backend_name: str, asked: int | str | None) -> tuple[int | None, bool]:
    """Bytes of stack a thread to set (None: leave the context's limit, "driver"), and whether the
    option or the environment asked for it (else the default)."""
    source, value = ("stack_limit", asked) if asked is not None else (STACK_LIMIT_VAR, os.environ.get(STACK_LIMIT_VAR))
    if isinstance(value, str):
        value = value.strip() or None  # an empty variable is an unset one
    if value is None:
        return STACK_LIMIT_BYTES, False
    if value == "driver":
        return None, True
    try:
        nbytes = int(value)
    except (TypeError, ValueError):
        nbytes = -1
    if isinstance(value, bool) or nbytes <= 0:
        raise InvalidArgument(
            f"{source} must be a positive number of bytes or 'driver', got {value!r}",
            call=f"expertstream.backend({backend_name!r})",
            hint=f"for example {STACK_LIMIT_BYTES} (the default), or 'driver' to keep the driver's own limit",
        )
    return nbytes, True


def _chained_from_environment(backend_name: str, default: bool) -> bool:
    hint = f"set {CHAINED_LAUNCHES_VAR}=1 to chain kernel launches, 0 to launch each on its own"
    return switch(CHAINED_LAUNCHES_VAR, f"expertstream.backend({backend_name!r})", hint, default)


@atexit.register
def _release_at_exit() -> None:
    """Streams, events and memory go before the runtime tears the context down."""
    for backend in list(_open_backends):
        backend.closed = True
        for device in backend._devices:
            device._release_at_exit()
    _open_backends.clear()


_SCALAR_TYPES: dict[np.dtype[Any], Any] = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}


def pack_kernel_args(args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Values and ctypes types for a kernel launch, shared by the CUDA and HIP backends."""
    values: list[Any] = []
    types: list[Any] = []
    for arg in args:
        if isinstance(arg, (DeviceBuffer, BufferView)):
            values.append(arg.address)
            types.append(ctypes.c_void_p)
        else:
            ctype = _SCALAR_TYPES.get(np.asarray(arg).dtype)
            if ctype is None:
                raise InvalidArgument(f"unsupported kernel scalar type {np.asarray(arg).dtype}")
            values.append(arg.item())
            types.append(ctype)
    return tuple(values), tuple(types)


@dataclass(frozen=True)
class GpuVendor:
    """What a vendor module adds to the shared implementation: how to find it and its table.

    ``missing()`` says why the vendor's bindings or library cannot be loaded (None if they
    can); ``table()`` builds the call table, importing the bindings.
    """

    name: str  # "CUDA"
    backend_class: type[GpuBackend]
    install_hint: str
    missing: Callable[[], str | None]
    table: Callable[[], ApiTable]

    def probe(self) -> str | None:
        """None if a device of this vendor can be used here, else why not."""
        return self.missing() or unusable_reason(self.table().device_count, self.name)

    def open(self, **options: Any) -> GpuBackend:
        reason = self.probe()
        if reason is not None:
            raise BackendUnavailable(reason, call=f"{self.backend_class.name}.open", hint=self.install_hint)
        return self.backend_class(self.table(), **options)


__all__ = ["GpuBackend", "GpuBuffer", "GpuDevice", "GpuEvent", "GpuKernel", "GpuStream", "GpuVendor"]
