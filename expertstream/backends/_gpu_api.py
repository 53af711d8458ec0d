"""The vendor call table the CUDA and HIP backends fill, and how vendor error codes read.

cuda-python and hip-python expose the same shape of API: every call returns a tuple whose
first item is an int-like error code. A vendor module (cuda.py, hip.py) fills an ``ApiTable``
with its calls, each adapted to one argument order, and maps its error codes to the
``Problem`` they mean. ``invoke`` runs a call and turns a failure into the typed exception
of base.py, whose message names the call, the device, the code and a hint.
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import (
    BackendError,
    BackendUnavailable,
    DeviceError,
    InvalidArgument,
    KernelCompileError,
    OutOfDeviceMemory,
)

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# Error codes
# --------------------------------------------------------------------------------------


class Problem(enum.Enum):
    """What a vendor error code means, whatever its number; the value is the message text."""

    OUT_OF_MEMORY = "out of memory"
    INVALID_VALUE = "invalid argument"
    INVALID_DEVICE = "invalid device"
    INVALID_HANDLE = "invalid or destroyed handle"
    NOT_FOUND = "name not found"
    NOT_READY = "not ready"
    NO_DEVICE = "no device"
    DRIVER_TOO_OLD = "driver too old"
    NOT_INITIALIZED = "runtime not initialized"
    ILLEGAL_ADDRESS = "illegal memory access"
    ALREADY_REGISTERED = "host memory already registered"
    NOT_REGISTERED = "host memory not registered"
    PEER_ALREADY_ENABLED = "peer access already enabled"
    PEER_UNSUPPORTED = "peer access not supported"
    SHUTTING_DOWN = "runtime shutting down"
    COMPILATION = "compilation failed"
    INVALID_OPTION = "invalid compiler option"
    UNKNOWN = "failed"


_EXCEPTION_FOR: Mapping[Problem, type[BackendError]] = {
    Problem.OUT_OF_MEMORY: OutOfDeviceMemory,
    Problem.INVALID_VALUE: InvalidArgument,
    Problem.INVALID_DEVICE: InvalidArgument,
    Problem.NOT_FOUND: InvalidArgument,
    Problem.NO_DEVICE: BackendUnavailable,
    Problem.DRIVER_TOO_OLD: BackendUnavailable,
    Problem.COMPILATION: KernelCompileError,
    Problem.INVALID_OPTION: KernelCompileError,
}

HINTS: Mapping[Problem, str] = {
    Problem.OUT_OF_MEMORY: "free device memory or ask for less (fewer or smaller slots)",
    Problem.INVALID_VALUE: "check the sizes, pointers and flags of the call",
    Problem.INVALID_DEVICE: "use a device index below the device count",
    Problem.INVALID_HANDLE: "the stream, event or module was destroyed or belongs to another device",
    Problem.NOT_FOUND: 'kernel names must match an extern "C" __global__ function of the source',
    Problem.NO_DEVICE: "check that the driver sees a GPU and the *_VISIBLE_DEVICES variables",
    Problem.DRIVER_TOO_OLD: "install a driver at least as new as the runtime the bindings were built for",
    Problem.NOT_INITIALIZED: "the runtime failed to start; check the driver installation",
    Problem.ILLEGAL_ADDRESS: "a kernel or copy touched memory outside its buffer; restart the process",
    Problem.ALREADY_REGISTERED: "this host range is registered already; unregister it first",
    Problem.NOT_REGISTERED: "only registered host memory can be unregistered",
    Problem.PEER_UNSUPPORTED: "these devices cannot reach each other; stage the data through host memory",
    Problem.SHUTTING_DOWN: "the process is exiting",
    Problem.COMPILATION: "fix the kernel source; the log names the line",
    Problem.INVALID_OPTION: "the compiler rejected an option (is the architecture supported?)",
}
_DEFAULT_HINT = "if it persists the device may be in a bad state; restart the process"


@dataclass(frozen=True)
class ErrorTable:
    """One family of vendor return codes (runtime/driver, or run-time compiler)."""

    problems: Mapping[int, Problem]  # codes not listed read as Problem.UNKNOWN

    @classmethod
    def by_name(cls, codes: Any, problems: Mapping[str, Problem]) -> ErrorTable:
        """Build from the names of a vendor's error enum, so the numbers come from the bindings."""
        return cls({int(getattr(codes, name)): problem for name, problem in problems.items()})

    def problem(self, code: int) -> Problem:
        return self.problems.get(code, Problem.UNKNOWN)


@dataclass(frozen=True)
class Call:
    """One vendor function: the name messages show, the callable, and how to read its codes."""

    name: str
    fn: Callable[..., Any]  # returns the vendor's tuple: (error code, *outputs)
    errors: ErrorTable


def code_text(err: Any) -> str:
    """'cudaErrorMemoryAllocation (2)' for an enum member, 'code 2' for a bare int."""
    name = getattr(err, "name", None)
    return f"{name} ({int(err)})" if name else f"code {int(err)}"


def error_for(call: Call, err: Any, device: str | None, detail: str = "") -> BackendError:
    """The typed exception for a failed call: names the call, device, code and a hint."""
    problem = call.errors.problem(int(err))
    cls = _EXCEPTION_FOR.get(problem, DeviceError)
    message = f"{problem.value}: {detail}" if detail else problem.value
    return cls(message, call=call.name, device=device, code=code_text(err), hint=HINTS.get(problem, _DEFAULT_HINT))


def _run(call: Call, args: tuple[Any, ...], device: str | None) -> tuple[Any, tuple[Any, ...]]:
    """Call the vendor function; return (error code, outputs). Exceptions become typed errors."""
    try:
        result = call.fn(*args)
    except RuntimeError as exc:  # both bindings raise this (or a subclass) for a missing library or symbol
        raise BackendUnavailable(
            f"a library the bindings need could not be loaded: {exc}",
            call=call.name,
            device=device,
            hint="install the vendor runtime (and for kernels its run-time compiler)",
        ) from None
    except ValueError as exc:  # hip-python raises this for a code its enum does not know
        raise DeviceError(f"returned an unknown code: {exc}", call=call.name, device=device) from None
    return result[0], tuple(result[1:])


def invoke(call: Call, *args: Any, device: str | None = None, accept: Collection[Problem] = ()) -> Any:
    """Run a vendor call; return its output (None, one value, or a tuple) or raise.

    ``accept`` lists problems that count as success (peer access already enabled).
    """
    err, outputs = _run(call, args, device)
    if int(err) != 0 and call.errors.problem(int(err)) not in accept:
        raise error_for(call, err, device)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


def poll(call: Call, *args: Any, device: str | None = None) -> bool:
    """Run a query call: True when done, False when the vendor says 'not ready'."""
    err, _ = _run(call, args, device)
    if int(err) == 0:
        return True
    if call.errors.problem(int(err)) is Problem.NOT_READY:
        return False
    raise error_for(call, err, device)


def unusable_reason(device_count: Call, what: str) -> str | None:
    """Why no device of a backend can be used, from its device-count call (None: usable)."""
    try:
        err, outputs = _run(device_count, (), None)
    except BackendError as exc:
        return str(exc)
    problem = device_count.errors.problem(int(err))
    if problem is Problem.NO_DEVICE or (int(err) == 0 and not outputs[0]):
        return f"no {what} device"
    if int(err):
        return f"{device_count.name} failed: {problem.value} [{code_text(err)}]"
    return None


def decode_text(value: Any) -> str:
    """A C string from the bindings (bytes with trailing NULs, or str) as str."""
    return value.decode(errors="replace").rstrip("\0") if isinstance(value, (bytes, bytearray)) else str(value)


def sized_output(
    get_size: Callable[[Any], tuple[Any, int]],
    get: Callable[[Any, Any], tuple[Any]],
    new_buffer: Callable[[int], Any],
    finish: Callable[[Any], Any],
) -> Callable[[Any], tuple[Any, ...]]:
    """A getter for a compiler output (log or code): ask its size, then fetch it into a buffer."""

    def fetch(program: Any) -> tuple[Any, ...]:
        err, size = get_size(program)
        if int(err):
            return (err, None)
        buffer = new_buffer(size)
        (err,) = get(program, buffer)
        return (err, finish(buffer))

    return fetch


def package_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------------------
# The vendor table
# --------------------------------------------------------------------------------------


class CopyKind(enum.Enum):
    HOST_TO_DEVICE = "h2d"
    DEVICE_TO_HOST = "d2h"
    DEVICE_TO_DEVICE = "d2d"


class DeviceAttr(enum.Enum):
    ASYNC_ENGINE_COUNT = "async_engine_count"
    HOST_REGISTER = "host_register"
    HOST_REGISTER_READ_ONLY = "host_register_read_only"  # a vendor may map this to "worth attempting"
    MAX_SHARED_PER_BLOCK = "max_shared_per_block"  # the most a block may use, opted into where asked


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    total_memory: int
    arch: str


@dataclass(frozen=True)
class ApiTable:
    """A vendor's calls in one shape. Handles of streams and events travel as ints."""

    backend_name: str
    bindings_version: str
    # devices
    init: Call  # ()
    device_count: Call  # () -> int
    set_device: Call  # (index)
    device_props: Call  # (index) -> the vendor's properties object
    device_attribute: Call  # (DeviceAttr, index) -> int
    read_props: Callable[[Any], DeviceInfo]
    register_flags: Callable[[Any, bool], int]  # (properties, read_only) -> host-register flags
    mem_info: Call  # () -> (free, total) of the current device
    can_access_peer: Call  # (index, peer) -> int
    enable_peer_access: Call  # (peer) from the current device
    device_synchronize: Call  # ()
    driver_version: Call  # () -> int
    # memory
    malloc: Call  # (nbytes) -> pointer
    free: Call  # (pointer)
    host_alloc: Call  # (nbytes) -> pointer to portable page-locked memory
    host_free: Call  # (pointer)
    host_register: Call  # (pointer, nbytes, flags)
    host_unregister: Call  # (pointer)
    host_device_pointer: Call  # (pointer) -> the device's address of mapped page-locked host memory
    # streams and events
    stream_create: Call  # () -> non-blocking stream handle
    stream_destroy: Call  # (stream)
    stream_synchronize: Call  # (stream)
    stream_query: Call  # (stream)
    stream_wait_event: Call  # (stream, event)
    stream_begin_capture: Call  # (stream): thread-local capture mode
    stream_end_capture: Call  # (stream) -> graph
    graph_instantiate: Call  # (graph) -> executable graph
    graph_launch: Call  # (executable, stream)
    graph_exec_destroy: Call  # (executable)
    graph_destroy: Call  # (graph)
    event_create: Call  # (timing: bool) -> event handle
    event_destroy: Call  # (event)
    event_record: Call  # (event, stream)
    event_synchronize: Call  # (event)
    event_query: Call  # (event)
    event_elapsed: Call  # (start, end) -> milliseconds
    # copies
    memcpy_async: Call  # (dst, src, nbytes, CopyKind, stream)
    memcpy_peer_async: Call  # (dst, dst_index, src, src_index, nbytes, stream)
    memset_async: Call  # (pointer, value, nbytes, stream)
    # kernels
    compile_options: Callable[[str], list[bytes]]  # arch -> compiler options
    compiler_version: Call  # () -> (major, minor) of NVRTC or hipRTC
    matrix_cores: Callable[[str], bool]  # arch -> whether it has the bf16/f16 matrix instructions kernels use
    int8_matrix_cores: Callable[[str], bool]  # arch -> whether it has the int8 ones int8.cu uses
    mma_fragments: Callable[[str], bool]  # arch -> whether direct.cu's mma.sync fragment layout applies
    program_create: Call  # (source bytes, name bytes) -> program
    program_compile: Call  # (program, options)
    program_log: Call  # (program) -> str
    program_code: Call  # (program) -> bytes
    program_destroy: Call  # (program)
    module_load: Call  # (image bytes) -> module
    module_get_function: Call  # (module, name bytes) -> function
    module_unload: Call  # (module)
    launch: Call  # (function, grid, block, shared_mem, stream, values, ctypes types)
    # (function, bytes): lets the function launch with that much dynamic shared memory, beyond the
    # 48 KB every kernel may take; None where a vendor grants up to its limit without asking
    allow_shared: Call | None = None
    # a launch chained to the kernel before it in the stream (programmatic dependent launch), with
    # launch's arguments; None where the vendor has none
    launch_chained: Call | None = None
    chained_launches: Callable[[str], bool] = lambda arch: False  # arch -> whether launch_chained works there
    # the driver_version from which kernels launch chained unless asked not to (below it: only when asked)
    chained_default_driver: int = 0
    # (bytes): the per-thread stack limit of the current device's context, whose local memory the driver
    # reserves for every thread the device can hold; the driver raises it for a kernel that needs more
    # (None: the vendor's limit is left as it is)
    set_stack_limit: Call | None = None
    # profiling: the range a profiler started with profiling off records (None: the vendor has none)
    profiler_start: Call | None = None  # ()
    profiler_stop: Call | None = None  # ()


__all__ = [
    "HINTS",
    "ApiTable",
    "Call",
    "CopyKind",
    "DeviceAttr",
    "DeviceInfo",
    "ErrorTable",
    "Problem",
    "decode_text",
    "invoke",
    "package_version",
    "poll",
    "unusable_reason",
]
