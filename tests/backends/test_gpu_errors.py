"""The shared CUDA/HIP implementation over a fake vendor table, and the vendor probes, without a GPU.

The fake keeps "device" memory in host buffers and runs copies when a stream is synchronized,
so the bytes, the error paths and the release of every native handle can be checked here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import gc
import logging
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

import expertstream
from expertstream.backends import _gpu, _image_cache, cuda, hip
from expertstream.backends._gpu import GpuBackend
from expertstream.backends._gpu_api import (
    ApiTable,
    Call,
    CopyKind,
    DeviceAttr,
    DeviceInfo,
    ErrorTable,
    Problem,
    decode_text,
    invoke,
)
from expertstream.backends.base import HostMemory, Vendor
from expertstream.errors import BackendUnavailable, DeviceError, InvalidArgument, KernelCompileError, OutOfDeviceMemory


class FakeError(enum.IntEnum):
    fakeSuccess = 0
    fakeErrorInvalidValue = 1
    fakeErrorMemoryAllocation = 2
    fakeErrorNoDevice = 100
    fakeErrorInvalidHandle = 400
    fakeErrorNotFound = 500
    fakeErrorNotReady = 600
    fakeErrorPeerAccessAlreadyEnabled = 704
    fakeErrorLaunchFailure = 719


class FakeRtcError(enum.IntEnum):
    FAKERTC_SUCCESS = 0
    FAKERTC_ERROR_COMPILATION = 6


ERRORS = ErrorTable.by_name(
    FakeError,
    {
        "fakeErrorInvalidValue": Problem.INVALID_VALUE,
        "fakeErrorMemoryAllocation": Problem.OUT_OF_MEMORY,
        "fakeErrorNoDevice": Problem.NO_DEVICE,
        "fakeErrorInvalidHandle": Problem.INVALID_HANDLE,
        "fakeErrorNotFound": Problem.NOT_FOUND,
        "fakeErrorNotReady": Problem.NOT_READY,
        "fakeErrorPeerAccessAlreadyEnabled": Problem.PEER_ALREADY_ENABLED,
    },
)
RTC_ERRORS = ErrorTable.by_name(FakeRtcError, {"FAKERTC_ERROR_COMPILATION": Problem.COMPILATION})
OK = FakeError.fakeSuccess
READ_ONLY_FLAG = 8
FREE_BYTES = 123_456


class FakeGpu:
    """A vendor runtime in host memory. ``fail[name] = code`` makes that call return ``code``."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.fail: dict[str, Any] = {}
        self.calls: dict[str, int] = {}
        self.memory: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.pinned: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.registered: dict[int, int] = {}
        self.streams: dict[int, list[Callable[[], object]]] = {}
        self.events: set[int] = set()
        self.programs: set[int] = set()
        self.modules: set[int] = set()
        self.launches: list[tuple[Any, ...]] = []
        self.chained: list[tuple[Any, ...]] = []  # launches chained to the kernel before them
        self.chains = False  # whether the fake arch has chained launches
        self.shared_allowed: list[tuple[Any, int]] = []  # (function, bytes) a kernel was let launch with
        self.refuse_read_only = False
        self.stack_limits: list[int] = []  # per-thread stack limits set, in order
        self.compile_error: str | None = None
        self._next = 0x1000

    def _handle(self) -> int:
        self._next += 0x10
        return self._next

    def live(self) -> dict[str, int]:
        return {
            name: len(getattr(self, name))
            for name in ("memory", "pinned", "registered", "streams", "events", "programs", "modules")
        }

    def _flush(self, stream: int) -> None:
        for op in self.streams.get(stream, []):
            op()
        self.streams[stream] = []

    # -- calls (each returns the vendor tuple) --
    def device_props(self, index: int) -> tuple[Any, ...]:
        return OK, types.SimpleNamespace(name=f"Fake GPU {index}".encode() + b"\0\0", total=1 << 30, arch="fk_1")

    def attribute(self, attr: DeviceAttr, index: int) -> tuple[Any, ...]:
        return OK, {
            DeviceAttr.ASYNC_ENGINE_COUNT: 2,
            DeviceAttr.HOST_REGISTER: 1,
            DeviceAttr.HOST_REGISTER_READ_ONLY: 1,
            DeviceAttr.MAX_SHARED_PER_BLOCK: 100 * 1024,
        }[attr]

    def malloc(self, n: int) -> tuple[Any, ...]:
        buf = ctypes.create_string_buffer(n)
        self.memory[ctypes.addressof(buf)] = buf
        return OK, ctypes.addressof(buf)

    def free(self, pointer: int) -> tuple[Any, ...]:
        return (OK,) if self.memory.pop(pointer, None) is not None else (FakeError.fakeErrorInvalidValue,)

    def host_alloc(self, n: int) -> tuple[Any, ...]:
        buf = ctypes.create_string_buffer(n)
        self.pinned[ctypes.addressof(buf)] = buf
        return OK, ctypes.addressof(buf)

    def host_free(self, pointer: int) -> tuple[Any, ...]:
        return (OK,) if self.pinned.pop(pointer, None) is not None else (FakeError.fakeErrorInvalidValue,)

    def host_register(self, pointer: int, n: int, flags: int) -> tuple[Any, ...]:
        if self.refuse_read_only and flags & READ_ONLY_FLAG:
            return (FakeError.fakeErrorInvalidValue,)
        self.registered[pointer] = n
        return (OK,)

    def host_unregister(self, pointer: int) -> tuple[Any, ...]:
        return (OK,) if self.registered.pop(pointer, None) is not None else (FakeError.fakeErrorInvalidValue,)

    def host_device_pointer(self, pointer: int) -> tuple[Any, ...]:
        mapped = pointer in self.pinned or pointer in self.registered
        return (OK, pointer) if mapped else (FakeError.fakeErrorInvalidValue, None)

    def stream_create(self) -> tuple[Any, ...]:
        handle = self._handle()
        self.streams[handle] = []
        return OK, handle

    def stream_destroy(self, stream: int) -> tuple[Any, ...]:
        return (OK,) if self.streams.pop(stream, None) is not None else (FakeError.fakeErrorInvalidHandle,)

    def stream_synchronize(self, stream: int) -> tuple[Any, ...]:
        self._flush(stream)
        return (OK,)

    def stream_query(self, stream: int) -> tuple[Any, ...]:
        return (FakeError.fakeErrorNotReady,) if self.streams.get(stream) else (OK,)

    def event_create(self, timing: bool) -> tuple[Any, ...]:
        handle = self._handle()
        self.events.add(handle)
        return OK, handle

    def event_destroy(self, event: int) -> tuple[Any, ...]:
        self.events.discard(event)
        return (OK,)

    def device_synchronize(self) -> tuple[Any, ...]:
        for stream in self.streams:
            self._flush(stream)
        return (OK,)

    def memcpy_async(self, dst: int, src: int, n: int, kind: CopyKind, stream: int) -> tuple[Any, ...]:
        self.streams[stream].append(lambda: ctypes.memmove(dst, src, n))
        return (OK,)

    def memset_async(self, dst: int, value: int, n: int, stream: int) -> tuple[Any, ...]:
        self.streams[stream].append(lambda: ctypes.memset(dst, value, n))
        return (OK,)

    def program_create(self, source: bytes, name: bytes) -> tuple[Any, ...]:
        handle = self._handle()
        self.programs.add(handle)
        return OK, handle

    def program_compile(self, program: int, options: list[bytes]) -> tuple[Any, ...]:
        return (FakeRtcError.FAKERTC_ERROR_COMPILATION,) if self.compile_error else (FakeRtcError.FAKERTC_SUCCESS,)

    def program_destroy(self, program: int) -> tuple[Any, ...]:
        self.programs.discard(program)
        return (FakeRtcError.FAKERTC_SUCCESS,)

    def module_load(self, image: bytes) -> tuple[Any, ...]:
        handle = self._handle()
        self.modules.add(handle)
        return OK, handle

    def module_get_function(self, module: int, name: bytes) -> tuple[Any, ...]:
        known = name.startswith(b"es_") or name == b"expertstream_gather_rows"  # the test's kernels, the backend's own
        return (OK, (module, name)) if known else (FakeError.fakeErrorNotFound, None)

    def module_unload(self, module: int) -> tuple[Any, ...]:
        self.modules.discard(module)
        return (OK,)

    def launch(self, *args: Any) -> tuple[Any, ...]:
        self.launches.append(args)
        return (OK,)

    def launch_chained(self, *args: Any) -> tuple[Any, ...]:
        self.chained.append(args)
        return (OK,)

    def table(self) -> ApiTable:
        def call(name: str, fn: Callable[..., Any], errors: ErrorTable = ERRORS) -> Call:
            def run(*args: Any) -> Any:
                self.calls[name] = self.calls.get(name, 0) + 1
                if name in self.fail:
                    return (self.fail[name], None)
                return fn(*args)

            return Call(name, run, errors)

        ok = lambda *_: (OK,)  # noqa: E731
        return ApiTable(
            backend_name="fake",
            bindings_version="0",
            init=call("fakeInit", ok),
            device_count=call("fakeGetDeviceCount", lambda: (OK, self.devices)),
            set_device=call("fakeSetDevice", ok),
            device_props=call("fakeGetDeviceProperties", self.device_props),
            device_attribute=call("fakeDeviceGetAttribute", self.attribute),
            read_props=lambda p: DeviceInfo(decode_text(p.name), p.total, p.arch),
            register_flags=lambda _p, read_only: 1 | READ_ONLY_FLAG if read_only else 0,
            mem_info=call("fakeMemGetInfo", lambda: (OK, FREE_BYTES, 1 << 30)),
            can_access_peer=call("fakeDeviceCanAccessPeer", lambda i, j: (OK, 1)),
            enable_peer_access=call("fakeDeviceEnablePeerAccess", ok),
            device_synchronize=call("fakeDeviceSynchronize", self.device_synchronize),
            driver_version=call("fakeDriverGetVersion", lambda: (OK, 1)),
            malloc=call("fakeMalloc", self.malloc),
            free=call("fakeFree", self.free),
            host_alloc=call("fakeHostAlloc", self.host_alloc),
            host_free=call("fakeFreeHost", self.host_free),
            host_register=call("fakeHostRegister", self.host_register),
            host_unregister=call("fakeHostUnregister", self.host_unregister),
            host_device_pointer=call("fakeHostGetDevicePointer", self.host_device_pointer),
            stream_create=call("fakeStreamCreate", self.stream_create),
            stream_destroy=call("fakeStreamDestroy", self.stream_destroy),
            stream_synchronize=call("fakeStreamSynchronize", self.stream_synchronize),
            stream_query=call("fakeStreamQuery", self.stream_query),
            stream_wait_event=call("fakeStreamWaitEvent", ok),
            stream_begin_capture=call("fakeStreamBeginCapture", ok),
            stream_end_capture=call("fakeStreamEndCapture", lambda s: (OK, self._handle())),
            graph_instantiate=call("fakeGraphInstantiate", lambda g: (OK, self._handle())),
            graph_launch=call("fakeGraphLaunch", ok),
            graph_exec_destroy=call("fakeGraphExecDestroy", ok),
            graph_destroy=call("fakeGraphDestroy", ok),
            event_create=call("fakeEventCreate", self.event_create),
            event_destroy=call("fakeEventDestroy", self.event_destroy),
            event_record=call("fakeEventRecord", ok),
            event_synchronize=call("fakeEventSynchronize", lambda e: self.device_synchronize()),
            event_query=call("fakeEventQuery", ok),
            event_elapsed=call("fakeEventElapsedTime", lambda a, b: (OK, 1.5)),
            memcpy_async=call("fakeMemcpyAsync", self.memcpy_async),
            memcpy_peer_async=call(
                "fakeMemcpyPeerAsync",
                lambda d, di, s, si, n, st: self.memcpy_async(d, s, n, CopyKind.DEVICE_TO_DEVICE, st),
            ),
            memset_async=call("fakeMemsetAsync", self.memset_async),
            compile_options=lambda arch: [f"--arch={arch}".encode()],
            matrix_cores=lambda arch: False,
            int8_matrix_cores=lambda arch: False,
            mma_fragments=lambda arch: False,
            compiler_version=call("fakertcVersion", lambda: (FakeRtcError.FAKERTC_SUCCESS, 1, 2), RTC_ERRORS),
            program_create=call("fakertcCreateProgram", self.program_create, RTC_ERRORS),
            program_compile=call("fakertcCompileProgram", self.program_compile, RTC_ERRORS),
            program_log=call(
                "fakertcGetProgramLog",
                lambda p: (FakeRtcError.FAKERTC_SUCCESS, self.compile_error),
                RTC_ERRORS,
            ),
            program_code=call("fakertcGetCode", lambda p: (FakeRtcError.FAKERTC_SUCCESS, b"image"), RTC_ERRORS),
            program_destroy=call("fakertcDestroyProgram", self.program_destroy, RTC_ERRORS),
            module_load=call("fakeModuleLoadData", self.module_load),
            module_get_function=call("fakeModuleGetFunction", self.module_get_function),
            module_unload=call("fakeModuleUnload", self.module_unload),
            launch=call("fakeModuleLaunchKernel", self.launch),
            launch_chained=call("fakeLaunchKernelEx", self.launch_chained),
            allow_shared=call("fakeFuncSetAttribute", lambda f, n: (self.shared_allowed.append((f, n)), (OK,))[1]),
            chained_launches=lambda arch: self.chains,
            profiler_start=call("fakeProfilerStart", ok),
            profiler_stop=call("fakeProfilerStop", ok),
            set_stack_limit=call("fakeDeviceSetLimit", lambda n: (self.stack_limits.append(n), (OK,))[1]),
        )


class FakeBackend(GpuBackend):
    name = "fake"
    vendor = Vendor.NVIDIA


@pytest.fixture
def fake() -> FakeGpu:
    return FakeGpu()


@pytest.fixture
def backend(fake: FakeGpu) -> Any:
    with FakeBackend(fake.table()) as be:
        yield be


# -- error tuples become typed exceptions ------------------------------------------------


@pytest.mark.parametrize(
    ("code", "exc_type", "text"),
    [
        (FakeError.fakeErrorMemoryAllocation, OutOfDeviceMemory, "out of memory"),
        (FakeError.fakeErrorInvalidValue, InvalidArgument, "invalid argument"),
        (FakeError.fakeErrorNoDevice, BackendUnavailable, "no device"),
        (FakeError.fakeErrorInvalidHandle, DeviceError, "invalid or destroyed handle"),
        (FakeError.fakeErrorLaunchFailure, DeviceError, "failed"),
    ],
)
def test_error_code_becomes_typed_exception_naming_call_code_device_and_hint(
    code: FakeError, exc_type: type[Exception], text: str
) -> None:
    failing = Call("fakeThing", lambda *_: (code, None), ERRORS)
    with pytest.raises(exc_type) as info:
        invoke(failing, 1, device="fake:0")
    message = str(info.value)
    assert f"fakeThing on fake:0: {text}" in message
    assert f"[{code.name} ({int(code)})]" in message
    assert info.value.hint  # type: ignore[attr-defined]
    assert message.endswith(info.value.hint)  # type: ignore[attr-defined]


def test_success_returns_outputs_not_the_tuple() -> None:
    assert invoke(Call("fakeNone", lambda: (OK,), ERRORS)) is None
    assert invoke(Call("fakeOne", lambda: (OK, 7), ERRORS)) == 7
    assert invoke(Call("fakeTwo", lambda: (OK, 7, 8), ERRORS)) == (7, 8)


def test_missing_library_raises_backend_unavailable_naming_it() -> None:
    def missing() -> Any:
        raise RuntimeError("failed to dlopen 'libhiprtc.so'")

    with pytest.raises(BackendUnavailable, match=r"fakertcCreateProgram.*libhiprtc\.so"):
        invoke(Call("fakertcCreateProgram", missing, RTC_ERRORS), device="fake:0")


def test_code_unknown_to_the_bindings_raises_device_error() -> None:
    def unknown() -> Any:
        raise ValueError("12345 is not a valid hipError_t")

    with pytest.raises(DeviceError, match=r"fakeQuery on fake:0: returned an unknown code: 12345"):
        invoke(Call("fakeQuery", unknown, ERRORS), device="fake:0")


def test_allocation_failure_names_bytes_asked_and_free(backend: Any, fake: FakeGpu) -> None:
    fake.fail["fakeMalloc"] = FakeError.fakeErrorMemoryAllocation
    with pytest.raises(OutOfDeviceMemory) as info:
        backend.device(0).alloc(4096)
    message = str(info.value)
    assert "fakeMalloc on fake:0" in message
    assert "cannot allocate 4096 bytes" in message
    assert f"{FREE_BYTES} bytes free" in message
    assert "fakeErrorMemoryAllocation (2)" in message


def test_failed_stream_creation_is_a_device_error_and_leaks_nothing(backend: Any, fake: FakeGpu) -> None:
    fake.fail["fakeStreamCreate"] = FakeError.fakeErrorLaunchFailure
    with pytest.raises(DeviceError, match="fakeStreamCreate on fake:0"):
        backend.device(0).stream()
    assert fake.live()["streams"] == 0


def test_backend_without_devices_is_unavailable(fake: FakeGpu) -> None:
    fake.devices = 0
    with pytest.raises(BackendUnavailable, match="no fake device"):
        FakeBackend(fake.table())


def test_unknown_backend_option_is_rejected(fake: FakeGpu) -> None:
    with pytest.raises(InvalidArgument, match=r"takes only chained_launches and stack_limit.*profile"):
        FakeBackend(fake.table(), profile="cuda-h200")


# -- behaviour of the shared implementation --------------------------------------------------


def test_bytes_round_trip_through_device_and_pinned_memory(backend: Any) -> None:
    dev = backend.device(0)
    data = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    buf = dev.upload(data)
    assert np.array_equal(buf.read(), data)
    pinned = dev.alloc_pinned(1000)
    assert pinned.kind is HostMemory.PINNED
    stream = dev.stream()
    stream.copy_d2h(pinned, 0, buf, 0, 1000)
    stream.synchronize()
    assert np.array_equal(pinned.array, data)


def test_device_description_and_interop(backend: Any) -> None:
    dev = backend.device(0)
    assert (dev.name, dev.arch, dev.total_memory) == ("Fake GPU 0", "fk_1", 1 << 30)
    assert dev.free_memory() == FREE_BYTES
    caps = dev.capabilities
    assert caps.async_copies and caps.host_register and caps.host_register_read_only
    buf = dev.alloc(64)
    iface = buf.__cuda_array_interface__
    assert iface == {
        "version": 3,
        "shape": (64,),
        "typestr": "|u1",
        "data": (buf.address, False),
        "strides": None,
        "stream": None,
    }


def test_dlpack_orders_another_consumer_stream_after_the_producer(backend: Any, fake: FakeGpu) -> None:
    dev = backend.device(0)
    buf, producer, consumer = dev.alloc(64), dev.stream(), dev.stream()
    typed = buf.view(16).as_array(np.float32, (2, 4), stream=producer)
    assert typed.__cuda_array_interface__["stream"] == producer.handle
    assert producer.__cuda_stream__() == (0, producer.handle)
    events_before = len(fake.events)
    with mock.patch.object(dev, "event", wraps=dev.event) as make_event:
        for stream, orders in ((producer.handle, False), (-1, False), (consumer.handle, True), (None, True)):
            make_event.reset_mock()
            typed.__dlpack__(stream=stream)  # the capsule, never consumed, deletes its tensor
            assert make_event.called is orders, stream
    assert len(fake.events) == events_before  # the ordering events were destroyed again
    with pytest.raises(BufferError):
        typed.__dlpack__(stream=0)  # reserved on CUDA
    unowned = dev.stream_from(types.SimpleNamespace(cuda_stream=consumer.handle))
    unowned.close()
    consumer.synchronize()  # closing the wrapper did not destroy the stream
    assert len(fake.streams) >= 2


def test_stream_query_reports_not_ready_as_false(backend: Any) -> None:
    dev = backend.device(0)
    buf = dev.alloc(16)
    stream = dev.stream()
    stream.memset(buf, 0, 16, 7)
    assert stream.query() is False
    stream.synchronize()
    assert stream.query() is True
    assert buf.read().tolist() == [7] * 16


def test_copy_source_stays_alive_until_the_stream_is_done(backend: Any) -> None:
    dev = backend.device(0)
    buf = dev.alloc(4096)
    stream = dev.stream()
    source = np.full(4096, 42, dtype=np.uint8)
    alive = weakref.ref(source)
    stream.copy_h2d(buf, 0, dev.wrap_host(source), 0, 4096)
    del source
    gc.collect()
    assert alive() is not None, "the array was dropped while its copy was still queued"
    stream.synchronize()
    gc.collect()
    assert alive() is None
    assert buf.read().tolist() == [42] * 4096


def test_a_graph_counts_its_work_not_the_events_that_order_it(backend: Any) -> None:
    """A forked capture's records and waits become edges of the graph, not operations of it."""
    dev = backend.device(0)
    buf = dev.alloc(16)
    origin, side = dev.stream(), dev.stream()
    fork, join = dev.event(), dev.event()
    origin.begin_capture()
    origin.memset(buf, 0, 8, 1)
    origin.record(fork)
    side.wait(fork)
    side.memset(buf, 8, 8, 2)
    side.record(join)
    origin.wait(join)
    origin.memset(buf, 0, 4, 3)
    graph = origin.end_capture()
    assert graph is not None and graph.operations == 3


def test_event_completion_releases_sources_recorded_before_it(backend: Any) -> None:
    dev = backend.device(0)
    buf = dev.alloc(8)
    stream = dev.stream()
    event = dev.event()
    first = np.ones(8, dtype=np.uint8)
    second = np.ones(8, dtype=np.uint8)
    first_ref, second_ref = weakref.ref(first), weakref.ref(second)
    stream.copy_h2d(buf, 0, dev.wrap_host(first), 0, 8)
    stream.record(event)
    stream.copy_h2d(buf, 0, dev.wrap_host(second), 0, 8)
    del first, second
    event.synchronize()
    gc.collect()
    assert first_ref() is None
    assert second_ref() is not None


def test_peer_access_already_enabled_counts_as_success() -> None:
    fake = FakeGpu(devices=2)
    fake.fail["fakeDeviceEnablePeerAccess"] = FakeError.fakeErrorPeerAccessAlreadyEnabled
    with FakeBackend(fake.table()) as be:
        d0, d1 = be.device(0), be.device(1)
        d0.enable_peer_access(d1)
        assert d0.capabilities.peer_access == frozenset({1})
        assert d0.can_access_peer(d1)


def test_event_of_another_backend_is_refused(backend: Any, fake: FakeGpu) -> None:
    with FakeBackend(fake.table()) as other:
        foreign = other.device(0).event()
        stream = backend.device(0).stream()
        with pytest.raises(InvalidArgument, match=r"Stream.wait on fake:0: .* does not belong"):
            stream.wait(foreign)


def test_kernel_launch_passes_addresses_and_typed_scalars(backend: Any, fake: FakeGpu) -> None:
    dev = backend.device(0)
    kernel = dev.compile('extern "C" __global__ void es_fill(char* p, int n) {}', "es_fill")
    buf = dev.alloc(32)
    stream = dev.stream()
    stream.launch(kernel, 2, (64, 1), [buf.view(8), np.int32(24)])
    _function, grid, block, shared, handle, values, ctypes_types = fake.launches[-1]
    assert (grid, block, shared, handle) == ((2, 1, 1), (64, 1, 1), 0, stream.handle)
    assert values == (buf.address + 8, 24)
    assert ctypes_types == (ctypes.c_void_p, ctypes.c_int32)


def test_a_kernel_is_let_use_more_shared_memory_once_and_never_past_the_device(backend: Any, fake: FakeGpu) -> None:
    dev = backend.device(0)
    assert dev.capabilities.max_shared_bytes == 100 * 1024
    kernel = dev.compile('extern "C" __global__ void es_fill(char* p, int n) {}', "es_fill")
    stream = dev.stream()
    stream.launch(kernel, 1, 32, [], shared_mem=48 * 1024)  # every kernel may: nothing asked
    assert fake.shared_allowed == []
    for nbytes in (80 * 1024, 64 * 1024, 80 * 1024):
        stream.launch(kernel, 1, 32, [], shared_mem=nbytes)
    assert fake.shared_allowed == [(kernel.function, 80 * 1024)]
    assert [launch[3] for launch in fake.launches] == [48 * 1024, 80 * 1024, 64 * 1024, 80 * 1024]
    with pytest.raises(InvalidArgument, match=r"102401 bytes of shared memory a block; this device allows 102400"):
        stream.launch(kernel, 1, 32, [], shared_mem=100 * 1024 + 1)
    assert len(fake.launches) == 4


@pytest.mark.parametrize(
    ("arch_chains", "asked", "chained"), [(True, True, True), (True, False, False), (False, True, False)]
)
def test_kernels_launch_chained_where_the_arch_has_it_unless_asked_not_to(
    fake: FakeGpu, arch_chains: bool, asked: bool, chained: bool
) -> None:
    fake.chains = arch_chains
    with FakeBackend(fake.table(), chained_launches=asked) as be:
        dev = be.device(0)
        assert dev.capabilities.chained_launches is chained
        assert be.describe()["devices"][0]["capabilities"]["chained_launches"] is chained
        source = 'extern "C" __global__ void es_fill(char* p, int n) {}'
        kernel = dev.compile(source, "es_fill", chained=True)  # it waits for the kernels before it
        alone = dev.compile(source, "es_fill")  # it does not: never chained
        buf = dev.alloc(32)
        stream = dev.stream()
        stream.launch(kernel, 2, (64, 1), [buf.view(8), np.int32(24)])
        went, other = (fake.chained, fake.launches) if chained else (fake.launches, fake.chained)
        assert len(went) == 1 and not other
        stream.launch(alone, 2, (64, 1), [buf.view(8), np.int32(24)])
        assert len(fake.launches) == (1 if chained else 2) and len(fake.chained) == int(chained)
        assert went[0][1:] == (
            (2, 1, 1),
            (64, 1, 1),
            0,
            stream.handle,
            (buf.address + 8, 24),
            (ctypes.c_void_p, ctypes.c_int32),
        )


def test_chained_launches_follow_the_environment_and_a_bad_value_is_named(
    fake: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.chains = True
    for value, chained in (("0", False), ("1", True), ("", False)):
        monkeypatch.setenv("EXPERTSTREAM_CHAINED_LAUNCHES", value)
        with FakeBackend(fake.table()) as be:
            assert be.device(0).capabilities.chained_launches is chained
    monkeypatch.setenv("EXPERTSTREAM_CHAINED_LAUNCHES", "0")
    with FakeBackend(fake.table(), chained_launches=True) as be:  # an explicit option wins
        assert be.device(0).capabilities.chained_launches
    monkeypatch.delenv("EXPERTSTREAM_CHAINED_LAUNCHES")
    with FakeBackend(fake.table()) as be:  # the fake's driver (1) is below any default
        assert not be.device(0).capabilities.chained_launches
    for driver, chained in ((12029, False), (12030, True), (13000, True)):
        table = dataclasses.replace(
            fake.table(), chained_default_driver=12030, driver_version=Call("v", lambda d=driver: (OK, d), ERRORS)
        )
        with FakeBackend(table) as be:  # unset: on from the vendor's default driver
            assert be.device(0).capabilities.chained_launches is chained
        monkeypatch.setenv("EXPERTSTREAM_CHAINED_LAUNCHES", "0")
        with FakeBackend(table) as be:
            assert not be.device(0).capabilities.chained_launches
        monkeypatch.delenv("EXPERTSTREAM_CHAINED_LAUNCHES")
    monkeypatch.setenv("EXPERTSTREAM_CHAINED_LAUNCHES", "off")
    with pytest.raises(InvalidArgument, match=r"EXPERTSTREAM_CHAINED_LAUNCHES='off' is neither 0 nor 1"):
        FakeBackend(fake.table())


def test_a_device_gets_the_stack_limit_once_when_first_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXPERTSTREAM_STACK_LIMIT", raising=False)
    fake = FakeGpu(devices=2)
    with FakeBackend(fake.table()) as be:
        assert fake.stack_limits == []  # opening makes no context on a device nothing uses
        be.device(0).alloc(64).close()
        be.device(0).alloc(64).close()
        assert fake.stack_limits == [_gpu.STACK_LIMIT_BYTES]
        devices = be.describe()["devices"]  # describing asks each device its free memory: both used now
        assert [d["stack_limit"] for d in devices] == [_gpu.STACK_LIMIT_BYTES] * 2
        assert fake.stack_limits == [_gpu.STACK_LIMIT_BYTES] * 2


@pytest.mark.parametrize(
    ("option", "environment", "expected"),
    [
        (512, None, 512),
        ("driver", None, None),
        (None, "1024", 1024),
        (None, " driver ", None),
        (300, "driver", 300),
        (None, "", _gpu.STACK_LIMIT_BYTES),  # an empty variable is an unset one
    ],
)
def test_the_stack_limit_follows_the_option_then_the_environment(
    monkeypatch: pytest.MonkeyPatch, option: int | str | None, environment: str | None, expected: int | None
) -> None:
    if environment is None:
        monkeypatch.delenv("EXPERTSTREAM_STACK_LIMIT", raising=False)
    else:
        monkeypatch.setenv("EXPERTSTREAM_STACK_LIMIT", environment)
    fake = FakeGpu()
    with FakeBackend(fake.table(), stack_limit=option) as be:
        be.device(0).alloc(64).close()
        assert fake.stack_limits == ([] if expected is None else [expected])
        assert be.device(0).stack_limit == expected


@pytest.mark.parametrize("value", [0, -5, "abc", "256B", True])
def test_a_stack_limit_that_is_not_a_positive_byte_count_is_named(fake: FakeGpu, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"stack_limit must be a positive number of bytes or 'driver'"):
        FakeBackend(fake.table(), stack_limit=value)


def test_a_stack_limit_from_the_environment_that_is_not_one_names_the_variable(
    fake: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPERTSTREAM_STACK_LIMIT", "1k")
    with pytest.raises(InvalidArgument, match=r"EXPERTSTREAM_STACK_LIMIT must be a positive number of bytes"):
        FakeBackend(fake.table())


def test_a_refused_stack_limit_is_said_once_and_the_device_works_on(
    fake: FakeGpu, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXPERTSTREAM_STACK_LIMIT", raising=False)
    fake.fail["fakeDeviceSetLimit"] = FakeError.fakeErrorInvalidValue
    with caplog.at_level(logging.WARNING), FakeBackend(fake.table()) as be:
        for _ in range(3):
            be.device(0).alloc(64).close()
        assert be.device(0).stack_limit is None
        assert be.describe()["devices"][0]["stack_limit"] is None
    said = [r for r in caplog.records if "stack limit" in r.getMessage()]
    assert len(said) == 1 and "stays the driver's, not 256 bytes" in said[0].getMessage()


def test_a_vendor_without_a_stack_limit_call_is_left_as_it_is_and_an_asked_limit_says_so(
    fake: FakeGpu, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXPERTSTREAM_STACK_LIMIT", raising=False)
    table = dataclasses.replace(fake.table(), set_stack_limit=None)
    with caplog.at_level(logging.WARNING):
        with FakeBackend(table) as be:  # not asked: nothing to say
            be.device(0).alloc(64).close()
            assert be.device(0).stack_limit is None
        assert not [r for r in caplog.records if "stack limit" in r.getMessage()]
        with FakeBackend(table, stack_limit=512) as be:
            be.device(0).alloc(64).close()
            assert be.device(0).stack_limit is None and fake.stack_limits == []
    said = [r.getMessage() for r in caplog.records if "stack limit" in r.getMessage()]
    assert said == ["the fake backend leaves the stack limit to its runtime: stack_limit is CUDA's"]


def test_gather_launches_over_the_mapped_address_and_says_when_memory_is_not_mapped(
    backend: Any, fake: FakeGpu
) -> None:
    dev = backend.device(0)
    host = dev.alloc_pinned(3 * 40_000 + 16)
    dst, ids, stream = dev.alloc(3 * 40_000 + 64), dev.alloc(8), dev.stream()
    stream.gather_h2d(dst, 64, host, 16, 3 * 40_000, ids.view(), 2, 40_000, overrun=100, report=ids.view(0, 8), tag=5)
    function, grid, block, shared, handle, values, _ = fake.launches[-1]
    assert function[1] == b"expertstream_gather_rows" and (block, shared, handle) == ((256, 1, 1), 0, stream.handle)
    assert grid == (2, 2, 1), "40,100 bytes a row: two 32 KiB chunks; one block row per id"
    expected = (dst.address + 64, host.address + 16, ids.address, 0, 3 * 40_000, 40_000, 100, ids.address, 5, 0, 0)
    assert values == (*expected, 0, 0), "not packed, no slot ids"
    stream.gather_h2d(dst, 64, host, 16, 3 * 40_000, ids.view(), 2, 40_000, skip=ids.view(4, 4), n_skip=1)
    assert fake.launches[-1][5][-4:-2] == (ids.address + 4, 1), "the skipped ids' address and count"
    stream.gather_h2d(dst, 64, host, 16, 3 * 40_000, ids.view(), 2, 40_000, overrun=100, packed=True, slots=ids.view())
    _, grid, *_, values, _ = fake.launches[-1]
    assert grid == (2, 2, 1) and values[-2:] == (1, ids.address), "packed, its slot ids' address"
    stream.gather_h2d(dst, 64, host, 16, 3 * 32_768, ids.view(), 2, 32_768, overrun=100, packed=True)
    assert fake.launches[-1][1] == (1, 2, 1), "a packed row's chunks leave out the bytes past it"
    fake.fail["fakeHostGetDevicePointer"] = FakeError.fakeErrorInvalidValue
    with pytest.raises(DeviceError, match="not mapped for this device") as err:
        stream.gather_h2d(dst, 0, host, 0, 3 * 40_000, ids.view(), 2, 40_000)
    assert err.value.call == "fakeHostGetDevicePointer" and "copy_h2d" in (err.value.hint or "")


def test_compiled_image_is_cached_per_arch_and_source(backend: Any, fake: FakeGpu) -> None:
    source = 'extern "C" __global__ void es_cached_a() {}\nextern "C" __global__ void es_cached_b() {}'
    dev = backend.device(0)
    a = dev.compile(source, "es_cached_a")
    assert dev.compile(source, "es_cached_a") is a
    assert dev.compile(source, "es_cached_a", twin=object()) is a  # a twin is the simulator's; GPUs compile
    dev.compile(source, "es_cached_b")
    assert fake.calls["fakertcCreateProgram"] == 1
    assert fake.calls["fakeModuleLoadData"] == 1
    with FakeBackend(fake.table()) as other:  # a new device object of the same arch loads, not compiles
        other.device(0).compile(source, "es_cached_a")
    assert fake.calls["fakertcCreateProgram"] == 1
    assert fake.calls["fakeModuleLoadData"] == 2


@pytest.fixture
def disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty on-disk kernel cache of this test; images compiled earlier in the process are forgotten."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv(_image_cache.CACHE_ENV, str(folder))
    monkeypatch.setattr(_gpu, "_images", {})
    return folder


def _new_process(fake: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> GpuBackend:
    """A backend as a fresh process opens it: nothing compiled in memory."""
    monkeypatch.setattr(_gpu, "_images", {})
    return FakeBackend(fake.table())


def test_a_new_process_loads_the_image_an_earlier_one_compiled(
    fake: FakeGpu, disk_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = 'extern "C" __global__ void es_disk() {}'
    with FakeBackend(fake.table()) as first:
        first.device(0).compile(source, "es_disk")
    assert fake.calls["fakertcCreateProgram"] == 1 and len(list(disk_cache.glob("*.bin"))) == 1
    assert not list(disk_cache.glob("*.tmp"))  # written through a temporary file, renamed into place
    with _new_process(fake, monkeypatch) as second:
        second.device(0).compile(source, "es_disk")
    assert fake.calls["fakertcCreateProgram"] == 1  # loaded, not compiled
    assert fake.calls["fakeModuleLoadData"] == 2


@pytest.mark.parametrize(
    "change",
    ["source", "compiler", "driver", "options", "bindings"],
)
def test_anything_that_decides_the_image_gives_another_entry(
    fake: FakeGpu, disk_cache: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    source = 'extern "C" __global__ void es_keyed() {}'
    with FakeBackend(fake.table()) as first:
        first.device(0).compile(source, "es_keyed")
    table = fake.table()
    if change == "source":
        source += "\n// another source"
    elif change == "compiler":
        table = dataclasses.replace(
            table, compiler_version=Call("v", lambda: (FakeRtcError.FAKERTC_SUCCESS, 1, 3), RTC_ERRORS)
        )
    elif change == "driver":
        table = dataclasses.replace(table, driver_version=Call("v", lambda: (OK, 2), ERRORS))
    elif change == "options":
        table = dataclasses.replace(table, compile_options=lambda arch: [f"--arch={arch}".encode(), b"-O2"])
    else:
        table = dataclasses.replace(table, bindings_version="1")
    monkeypatch.setattr(_gpu, "_images", {})
    with FakeBackend(table) as second:
        second.device(0).compile(source, "es_keyed")
    assert fake.calls["fakertcCreateProgram"] == 2
    assert len(list(disk_cache.glob("*.bin"))) == 2


def test_a_damaged_entry_is_compiled_again_and_replaced(
    fake: FakeGpu, disk_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    source = 'extern "C" __global__ void es_damaged() {}'
    with FakeBackend(fake.table()) as first:
        first.device(0).compile(source, "es_damaged")
    (entry,) = disk_cache.glob("*.bin")
    good = entry.read_bytes()
    for damaged in (good[:-1] + b"X", good[:10], b""):
        entry.write_bytes(damaged)
        with (
            caplog.at_level(logging.DEBUG, logger="expertstream.backends._image_cache"),
            _new_process(fake, monkeypatch) as again,
        ):
            again.device(0).compile(source, "es_damaged")
        assert "damaged" in caplog.text
        assert entry.read_bytes() == good  # the new compile replaced it
        caplog.clear()
    assert fake.calls["fakertcCreateProgram"] == 4


def test_an_unreadable_entry_or_unwritable_folder_only_costs_a_compile(
    fake: FakeGpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(_image_cache.CACHE_ENV, str(blocked / "kernels"))
    source = 'extern "C" __global__ void es_unwritable() {}'
    for _ in range(2):
        with _new_process(fake, monkeypatch) as be:
            be.device(0).compile(source, "es_unwritable")
    assert fake.calls["fakertcCreateProgram"] == 2


def test_the_cache_is_off_with_0_and_follows_xdg_cache_home(
    fake: FakeGpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_image_cache.CACHE_ENV, "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = 'extern "C" __global__ void es_off() {}'
    for _ in range(2):
        with _new_process(fake, monkeypatch) as be:
            be.device(0).compile(source, "es_off")
    assert fake.calls["fakertcCreateProgram"] == 2 and not list(tmp_path.rglob("*.bin"))
    assert _image_cache.cache_folder({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "expertstream" / "kernels"
    assert _image_cache.cache_folder({"HOME": "/h"}) == Path("~/.cache/expertstream/kernels").expanduser()
    assert _image_cache.cache_folder({_image_cache.CACHE_ENV: str(tmp_path / "x")}) == tmp_path / "x"


def test_compile_error_carries_the_log_and_destroys_the_program(backend: Any, fake: FakeGpu) -> None:
    fake.compile_error = "moe.cu(3): error: identifier 'x' is undefined"
    with pytest.raises(KernelCompileError) as info:
        backend.device(0).compile('extern "C" __global__ void es_bad() { x; }', "es_bad")
    message = str(info.value)
    assert "es_bad did not compile for fk_1" in message
    assert "identifier 'x' is undefined" in message
    assert "FAKERTC_ERROR_COMPILATION (6)" in message
    assert fake.live()["programs"] == 0


def test_unknown_kernel_name_raises_and_unloads_the_module(backend: Any, fake: FakeGpu) -> None:
    with pytest.raises(InvalidArgument, match=r"fakeModuleGetFunction on fake:0: name not found"):
        backend.device(0).compile('extern "C" __global__ void es_k() {}', "missing_kernel")
    assert fake.live()["modules"] == 0


def test_refused_read_only_registration_raises_and_logs_once(
    backend: Any, fake: FakeGpu, caplog: pytest.LogCaptureFixture
) -> None:
    fake.refuse_read_only = True
    dev = backend.device(0)
    data = np.ones(4096, dtype=np.uint8)
    data.flags.writeable = False
    host = dev.wrap_host(data)
    # The error tells the caller; the log line (INFO: the feature that falls back warns) says it once.
    with caplog.at_level(logging.INFO, logger=_gpu.__name__), pytest.raises(DeviceError) as info:
        host.register()
    assert "read-only host registration of 4096 bytes was refused" in str(info.value)
    assert "pinned memory" in str(info.value)
    assert host.kind is HostMemory.PAGEABLE
    assert not dev.capabilities.host_register_read_only
    with pytest.raises(DeviceError, match="not supported"):
        host.register()
    assert fake.calls["fakeHostRegister"] == 1
    lines = [r for r in caplog.records if r.name == _gpu.__name__]
    assert len(lines) == 1 and "fake:0" in lines[0].getMessage() and "4096" in lines[0].getMessage()


def test_close_releases_every_native_handle(fake: FakeGpu) -> None:
    be = FakeBackend(fake.table())
    dev = be.device(0)
    registered = dev.wrap_host(np.zeros(512, dtype=np.uint8))
    registered.register()
    held: list[Any] = [
        dev.stream(),
        dev.event(timing=True),
        dev.alloc(128),
        dev.alloc_pinned(256),
        registered,
        dev.compile('extern "C" __global__ void es_k() {}', "es_k"),
    ]
    assert all(fake.live()[k] for k in ("memory", "pinned", "registered", "streams", "events", "modules"))
    be.close()
    assert fake.live() == dict.fromkeys(fake.live(), 0)
    assert all(obj.closed for obj in held[:5])


def test_dropped_objects_are_released_by_garbage_collection(backend: Any, fake: FakeGpu) -> None:
    dev = backend.device(0)
    before = fake.live()
    buf, event = dev.alloc(128), dev.event()
    pinned = dev.alloc_pinned(64)
    view = pinned.array[:8]
    del buf, event, pinned
    gc.collect()
    assert fake.live()["memory"] == before["memory"]
    assert fake.live()["events"] == before["events"]
    assert fake.live()["pinned"] == 1, "pinned memory freed while a numpy view of it is alive"
    del view
    gc.collect()
    assert fake.live()["pinned"] == 0


def test_release_at_exit_ignores_a_dying_driver(fake: FakeGpu) -> None:
    be = FakeBackend(fake.table())
    dev = be.device(0)
    dev.alloc(64)
    dev.stream()
    fake.fail["fakeFree"] = FakeError.fakeErrorLaunchFailure
    _gpu._release_at_exit()
    assert fake.calls["fakeFree"] == 1
    assert fake.live()["streams"] == 0
    assert be.closed


# -- probes and the registry -------------------------------------------------------------------


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError


# Every name the CUDA backend's error table looks up, with the numbers the probe tests use.
_CUDA_CODES = {
    **{name: 1000 + i for i, name in enumerate(cuda._RUNTIME_PROBLEMS)},
    "cudaSuccess": 0,
    "cudaErrorInsufficientDriver": 35,
    "cudaErrorNoDevice": 100,
}
CudaError = enum.IntEnum("CudaError", _CUDA_CODES)  # type: ignore[misc]


def _fake_cuda_bindings(monkeypatch: pytest.MonkeyPatch, device_count: tuple[Any, ...]) -> None:
    runtime = mock.MagicMock(name="runtime")
    runtime.cudaError_t = CudaError
    runtime.cudaGetDeviceCount = lambda: device_count
    package = types.ModuleType("cuda.bindings")
    for name, module in (("runtime", runtime), ("driver", mock.MagicMock()), ("nvrtc", mock.MagicMock())):
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"cuda.bindings.{name}", module)
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: None)  # the driver library "loads"


def test_cuda_probe_without_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "cuda.bindings.runtime")
    assert cuda.probe() == "cuda-python is not installed (pip install 'expertstream[cuda]')"


def test_explicit_cuda_backend_raises_unavailable_naming_the_missing_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide(monkeypatch, "cuda.bindings.runtime")
    with pytest.raises(BackendUnavailable) as info:
        expertstream.backend("cuda")
    assert "cuda-python is not installed" in str(info.value)
    assert "expertstream.backend('cuda')" in str(info.value)


def test_cuda_probe_without_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda_bindings(monkeypatch, (0, 1))

    def no_driver(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert cuda.probe() == "libcuda.so.1 not found: no NVIDIA driver"


@pytest.mark.parametrize(
    ("device_count", "reason"),
    [
        ((100, 0), "no CUDA device"),
        ((0, 0), "no CUDA device"),
        ((35, 0), "cudaGetDeviceCount failed: driver too old [cudaErrorInsufficientDriver (35)]"),
        ((0, 2), None),
    ],
)
def test_cuda_probe_counts_devices(
    monkeypatch: pytest.MonkeyPatch, device_count: tuple[int, int], reason: str | None
) -> None:
    _fake_cuda_bindings(monkeypatch, (CudaError(device_count[0]), device_count[1]))
    assert cuda.probe() == reason


def test_hip_probe_without_hip_python(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "hip")
    assert hip.probe() == "hip-python is not installed (pip install 'expertstream[hip]')"
    with pytest.raises(BackendUnavailable, match="hip-python is not installed"):
        expertstream.backend("hip")


def _no_rocm_sdk_and_no_loader_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "rocm_sdk")

    def not_on_loader_path(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", not_on_loader_path)


def test_hip_probe_names_every_place_it_looked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "hip", types.ModuleType("hip"))
    _no_rocm_sdk_and_no_loader_hit(monkeypatch)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    reason = hip.probe()
    assert reason is not None and reason.startswith("libamdhip64.so not found; looked in: ")
    places = [
        "rocm_sdk (not installed)",
        f"{tmp_path / 'lib' / 'libamdhip64.so'} ($ROCM_PATH)",
        "the dynamic loader's path",
    ]
    positions = [reason.index(place) for place in places]
    assert positions == sorted(positions)


def test_hip_library_search_falls_back_to_rocm_home_then_opt_rocm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_rocm_sdk_and_no_loader_hit(monkeypatch)
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setenv("ROCM_HOME", str(tmp_path))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libamdhip64.so").write_bytes(b"")
    found, places = hip.find_library("libamdhip64.so")
    assert found == str(tmp_path / "lib" / "libamdhip64.so")
    assert places[-1].endswith("($ROCM_HOME)")
    monkeypatch.delenv("ROCM_HOME")
    found, places = hip.find_library("libamdhip64.so")
    assert any(p.startswith("/opt/rocm/lib/libamdhip64.so (default") for p in places)
    if not Path("/opt/rocm/lib/libamdhip64.so").exists():
        assert found is None


def test_profiler_range_starts_and_stops_the_vendor_profiler_even_when_the_work_fails(
    fake: FakeGpu, backend: Any
) -> None:
    with backend.profiler_range():
        assert (fake.calls.get("fakeProfilerStart"), fake.calls.get("fakeProfilerStop")) == (1, None)
    with pytest.raises(RuntimeError), backend.profiler_range():
        raise RuntimeError("the work inside failed")
    assert (fake.calls["fakeProfilerStart"], fake.calls["fakeProfilerStop"]) == (2, 2)


def test_profiler_range_without_vendor_calls_runs_the_work_as_it_would() -> None:
    fake = FakeGpu()
    table = dataclasses.replace(fake.table(), profiler_start=None, profiler_stop=None)
    ran = []
    with FakeBackend(table) as plain, plain.profiler_range():
        ran.append(True)
    assert ran == [True]
