"""The HIP backend: hip-python's runtime and hipRTC calls in the shared GPU table.

Importing this module imports neither hip-python nor libamdhip64.so; probe() and open() do.
The library is searched where hip-python itself looks, in its order, so a probe failure can
say where it looked.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from ._gpu import GpuBackend, GpuVendor
from ._gpu_api import (
    ApiTable,
    Call,
    CopyKind,
    DeviceAttr,
    DeviceInfo,
    ErrorTable,
    Problem,
    decode_text,
    package_version,
    sized_output,
)
from .base import Vendor

AUTO_ORDER = 20  # auto-detection tries cuda, then hip, then the simulator
LIBRARY = "libamdhip64.so"
INSTALL_HINT = "pip install 'expertstream[hip]' and install ROCm (or set ROCM_PATH to it)"

# hipHostRegisterReadOnly in HIP's headers. hip-python does not name it, and on AMD devices that
# do not report read-only registration the same bit means coarse-grained memory, so it is only
# set where the device says it supports read-only registration.
_HOST_REGISTER_READ_ONLY = 0x08

_RUNTIME_PROBLEMS = {
    "hipErrorInvalidValue": Problem.INVALID_VALUE,
    "hipErrorOutOfMemory": Problem.OUT_OF_MEMORY,
    "hipErrorNotInitialized": Problem.NOT_INITIALIZED,
    "hipErrorDeinitialized": Problem.SHUTTING_DOWN,
    "hipErrorInsufficientDriver": Problem.DRIVER_TOO_OLD,
    "hipErrorNoDevice": Problem.NO_DEVICE,
    "hipErrorInvalidDevice": Problem.INVALID_DEVICE,
    "hipErrorInvalidHandle": Problem.INVALID_HANDLE,
    "hipErrorNotFound": Problem.NOT_FOUND,
    "hipErrorNotReady": Problem.NOT_READY,
    "hipErrorIllegalAddress": Problem.ILLEGAL_ADDRESS,
    "hipErrorPeerAccessUnsupported": Problem.PEER_UNSUPPORTED,
    "hipErrorPeerAccessAlreadyEnabled": Problem.PEER_ALREADY_ENABLED,
    "hipErrorHostMemoryAlreadyRegistered": Problem.ALREADY_REGISTERED,
    "hipErrorHostMemoryNotRegistered": Problem.NOT_REGISTERED,
}
_HIPRTC_PROBLEMS = {
    "HIPRTC_ERROR_INVALID_INPUT": Problem.INVALID_VALUE,
    "HIPRTC_ERROR_INVALID_OPTION": Problem.INVALID_OPTION,
    "HIPRTC_ERROR_COMPILATION": Problem.COMPILATION,
}
# HIP has no read-only-registration attribute: read-only registration is attempted wherever
# registration works, and the shared code falls back (one warning) if the device refuses it.
_ATTRIBUTES = {
    DeviceAttr.ASYNC_ENGINE_COUNT: "hipDeviceAttributeAsyncEngineCount",
    DeviceAttr.HOST_REGISTER: "hipDeviceAttributeHostRegisterSupported",
    DeviceAttr.HOST_REGISTER_READ_ONLY: "hipDeviceAttributeHostRegisterSupported",
    DeviceAttr.MAX_SHARED_PER_BLOCK: "hipDeviceAttributeMaxSharedMemoryPerBlock",
}
_COPY_KINDS = {
    CopyKind.HOST_TO_DEVICE: "hipMemcpyHostToDevice",
    CopyKind.DEVICE_TO_HOST: "hipMemcpyDeviceToHost",
    CopyKind.DEVICE_TO_DEVICE: "hipMemcpyDeviceToDevice",
}


class HipBackend(GpuBackend):
    name = "hip"
    vendor = Vendor.AMD


def _missing() -> str | None:
    try:
        importlib.import_module("hip")
    except ImportError:
        return "hip-python is not installed (pip install 'expertstream[hip]')"
    found, places = find_library(LIBRARY)
    if found is None:
        return f"{LIBRARY} not found; looked in: " + "; ".join(places)
    return None


def find_library(filename: str) -> tuple[str | None, list[str]]:
    """Where hip-python will load ``filename`` from, and the places looked at, in its order:
    its own package, rocm_sdk, $ROCM_PATH/lib (else $ROCM_HOME, else /opt/rocm), the loader path.
    """
    places: list[str] = []
    spec = importlib.util.find_spec("rocm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        places.append(f"hip-python's package ({root})")
        hit = next((p for p in Path(root).rglob(filename) if p.is_file()), None)
        if hit:
            return str(hit), places
    hit_sdk = _rocm_sdk_library(filename, places)
    if hit_sdk:
        return hit_sdk, places
    variable = next((v for v in ("ROCM_PATH", "ROCM_HOME") if os.environ.get(v)), None)
    root_dir = os.environ[variable] if variable else "/opt/rocm"
    candidate = Path(root_dir) / "lib" / filename
    places.append(f"{candidate} ({'$' + variable if variable else 'default; ROCM_PATH and ROCM_HOME unset'})")
    if candidate.is_file():
        return str(candidate), places
    places.append("the dynamic loader's path (LD_LIBRARY_PATH, ld.so.cache)")
    try:
        ctypes.CDLL(filename)
    except OSError:
        return None, places
    return filename, places


def _rocm_sdk_library(filename: str, places: list[str]) -> str | None:
    try:
        from rocm_sdk import find_libraries
    except ImportError:
        places.append("rocm_sdk (not installed)")
        return None
    places.append("rocm_sdk")
    shortname = filename.removeprefix("lib").removesuffix(".so")
    try:
        found = find_libraries(shortname)
    except Exception:  # rocm_sdk raises its own errors for a library it does not carry
        return None
    return str(found[0]) if found else None


def compile_options(arch: str) -> list[bytes]:
    """The options hipRTC gets for ``arch`` (a bare target such as 'gfx942').

    ``-std=c++17`` keeps the source in the dialect NVRTC compiles it in (hipRTC's default is
    C++14). The nox session kernels_amd compiles the kernel source with exactly these options
    for gfx90a, gfx942, gfx1100, gfx1201 and gfx1030 (docs/results/kernels-amd-compile.md).
    """
    return [f"--offload-arch={arch}".encode(), b"-std=c++17"]


def _arch(gcn_arch_name: Any) -> str:
    # 'gfx942:sramecc+:xnack-' -> 'gfx942': hipRTC wants the bare target for --offload-arch.
    return decode_text(gcn_arch_name).split(":", 1)[0]


# MFMA with bf16 inputs (CDNA2, CDNA3) and WMMA (RDNA3, RDNA3.5, RDNA4): the targets mma.cu's
# matrix step has a path for (bf16 for mul_mat_id, f16 for attention's prefill).
_MATRIX_CORE_ARCHS = re.compile(r"gfx(90a|94[0-2]|110[0-3]|115[0-2]|120[01])")


def _has_bf16_matrix_cores(arch: str) -> bool:
    return _MATRIX_CORE_ARCHS.fullmatch(arch) is not None


def _table() -> ApiTable:
    from hip import hip, hiprtc

    errors = ErrorTable.by_name(hip.hipError_t, _RUNTIME_PROBLEMS)
    rtc_errors = ErrorTable.by_name(hiprtc.hiprtcResult, _HIPRTC_PROBLEMS)
    attributes = {attr: getattr(hip.hipDeviceAttribute_t, name) for attr, name in _ATTRIBUTES.items()}
    kinds = {kind: getattr(hip.hipMemcpyKind, name) for kind, name in _COPY_KINDS.items()}

    def rt(name: str, fn: Any = None) -> Call:
        return Call(name, fn or getattr(hip, name), errors)

    def rtc(name: str, fn: Any = None) -> Call:
        return Call(name, fn or getattr(hiprtc, name), rtc_errors)

    # hipRTC writes into a writable buffer of the size it reported.
    program_log = sized_output(hiprtc.hiprtcGetProgramLogSize, hiprtc.hiprtcGetProgramLog, bytearray, decode_text)
    program_code = sized_output(hiprtc.hiprtcGetCodeSize, hiprtc.hiprtcGetCode, bytearray, bytes)

    def launch(
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: int,
        values: tuple[Any, ...],
        types: tuple[Any, ...],
    ) -> Any:
        # Arguments go through `extra` as ctypes values: hip-python packs their bytes with the
        # right alignment (kernelParams would pass a c_void_p's own address instead of its value).
        extra = tuple(ctype(value) for value, ctype in zip(values, types, strict=True)) or None
        gx, gy, gz = grid
        bx, by, bz = block
        return hip.hipModuleLaunchKernel(function, gx, gy, gz, bx, by, bz, shared_mem, stream, None, extra)

    def register_flags(props: Any, read_only: bool) -> int:
        if not read_only:
            return int(hip.hipHostRegisterDefault)  # mapped and portable
        ro_bit = _HOST_REGISTER_READ_ONLY if props.hostRegisterReadOnlySupported else 0
        return int(hip.hipHostRegisterPortable) | int(hip.hipHostRegisterMapped) | ro_bit

    return ApiTable(
        backend_name="hip",
        bindings_version=package_version("hip-python"),
        init=rt("hipInit", lambda: hip.hipInit(0)),
        device_count=rt("hipGetDeviceCount"),
        set_device=rt("hipSetDevice"),
        device_props=rt("hipGetDeviceProperties"),
        device_attribute=rt(
            "hipDeviceGetAttribute", lambda attr, index: hip.hipDeviceGetAttribute(attributes[attr], index)
        ),
        read_props=lambda p: DeviceInfo(decode_text(p.name), int(p.totalGlobalMem), _arch(p.gcnArchName)),
        register_flags=register_flags,
        mem_info=rt("hipMemGetInfo"),
        can_access_peer=rt("hipDeviceCanAccessPeer"),
        enable_peer_access=rt("hipDeviceEnablePeerAccess", lambda peer: hip.hipDeviceEnablePeerAccess(peer, 0)),
        device_synchronize=rt("hipDeviceSynchronize"),
        driver_version=rt("hipDriverGetVersion"),
        malloc=rt("hipMalloc"),
        free=rt("hipFree"),
        host_alloc=rt(
            "hipHostMalloc", lambda n: hip.hipHostMalloc(n, hip.hipHostMallocPortable | hip.hipHostMallocMapped)
        ),
        host_free=rt("hipHostFree"),
        host_register=rt("hipHostRegister"),
        host_unregister=rt("hipHostUnregister"),
        host_device_pointer=rt("hipHostGetDevicePointer", lambda pointer: hip.hipHostGetDevicePointer(pointer, 0)),
        stream_create=rt("hipStreamCreateWithFlags", lambda: hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking)),
        stream_destroy=rt("hipStreamDestroy"),
        stream_synchronize=rt("hipStreamSynchronize"),
        stream_query=rt("hipStreamQuery"),
        stream_wait_event=rt("hipStreamWaitEvent", lambda s, e: hip.hipStreamWaitEvent(s, e, 0)),
        stream_begin_capture=rt(
            "hipStreamBeginCapture",
            lambda s: hip.hipStreamBeginCapture(s, hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal),
        ),
        stream_end_capture=rt("hipStreamEndCapture"),
        graph_instantiate=rt("hipGraphInstantiateWithFlags", lambda graph: hip.hipGraphInstantiateWithFlags(graph, 0)),
        graph_launch=rt("hipGraphLaunch"),
        graph_exec_destroy=rt("hipGraphExecDestroy"),
        graph_destroy=rt("hipGraphDestroy"),
        event_create=rt(
            "hipEventCreateWithFlags",
            lambda timing: hip.hipEventCreateWithFlags(hip.hipEventDefault if timing else hip.hipEventDisableTiming),
        ),
        event_destroy=rt("hipEventDestroy"),
        event_record=rt("hipEventRecord"),
        event_synchronize=rt("hipEventSynchronize"),
        event_query=rt("hipEventQuery"),
        event_elapsed=rt("hipEventElapsedTime"),
        memcpy_async=rt("hipMemcpyAsync", lambda dst, src, n, kind, s: hip.hipMemcpyAsync(dst, src, n, kinds[kind], s)),
        memcpy_peer_async=rt("hipMemcpyPeerAsync"),
        memset_async=rt("hipMemsetAsync"),
        compile_options=compile_options,
        matrix_cores=_has_bf16_matrix_cores,
        # int8.cu has no MFMA/WMMA i8 step yet: AMD devices take the bf16 path for every type.
        int8_matrix_cores=lambda arch: False,
        mma_fragments=lambda arch: False,
        compiler_version=rtc("hiprtcVersion"),
        program_create=rtc(
            "hiprtcCreateProgram", lambda src, name: hiprtc.hiprtcCreateProgram(src, name, 0, None, None)
        ),
        program_compile=rtc(
            "hiprtcCompileProgram",
            lambda program, options: hiprtc.hiprtcCompileProgram(program, len(options), options),
        ),
        program_log=rtc("hiprtcGetProgramLog", program_log),
        program_code=rtc("hiprtcGetCode", program_code),
        # hiprtcDestroyProgram takes a pointer to the handle; passing the handle itself crashes.
        program_destroy=rtc("hiprtcDestroyProgram", lambda program: hiprtc.hiprtcDestroyProgram(program.createRef())),
        module_load=rt("hipModuleLoadData"),
        module_get_function=rt("hipModuleGetFunction"),
        module_unload=rt("hipModuleUnload"),
        launch=rt("hipModuleLaunchKernel", launch),
    )


VENDOR = GpuVendor("HIP", HipBackend, INSTALL_HINT, _missing, _table)
probe = VENDOR.probe
open = VENDOR.open
