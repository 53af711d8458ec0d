"""The CUDA backend: cuda-python's runtime, driver and NVRTC calls in the shared GPU table.

Importing this module imports neither cuda-python nor the driver; probe() and open() do.
"""

from __future__ import annotations

import ctypes
import importlib
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

AUTO_ORDER = 10  # auto-detection tries cuda, then hip, then the simulator
DRIVER_LIBRARY = "libcuda.so.1"
INSTALL_HINT = "pip install 'expertstream[cuda]'"

# Driver-API results (CUresult) share these numbers with the runtime's, so one table reads both.
_RUNTIME_PROBLEMS = {
    "cudaErrorInvalidValue": Problem.INVALID_VALUE,
    "cudaErrorMemoryAllocation": Problem.OUT_OF_MEMORY,
    "cudaErrorInitializationError": Problem.NOT_INITIALIZED,
    "cudaErrorCudartUnloading": Problem.SHUTTING_DOWN,
    "cudaErrorInsufficientDriver": Problem.DRIVER_TOO_OLD,
    "cudaErrorNoDevice": Problem.NO_DEVICE,
    "cudaErrorInvalidDevice": Problem.INVALID_DEVICE,
    "cudaErrorInvalidResourceHandle": Problem.INVALID_HANDLE,
    "cudaErrorSymbolNotFound": Problem.NOT_FOUND,
    "cudaErrorNotReady": Problem.NOT_READY,
    "cudaErrorIllegalAddress": Problem.ILLEGAL_ADDRESS,
    "cudaErrorPeerAccessUnsupported": Problem.PEER_UNSUPPORTED,
    "cudaErrorPeerAccessAlreadyEnabled": Problem.PEER_ALREADY_ENABLED,
    "cudaErrorHostMemoryAlreadyRegistered": Problem.ALREADY_REGISTERED,
    "cudaErrorHostMemoryNotRegistered": Problem.NOT_REGISTERED,
}
_NVRTC_PROBLEMS = {
    "NVRTC_ERROR_INVALID_INPUT": Problem.INVALID_VALUE,
    "NVRTC_ERROR_INVALID_OPTION": Problem.INVALID_OPTION,
    "NVRTC_ERROR_COMPILATION": Problem.COMPILATION,
}
_ATTRIBUTES = {
    DeviceAttr.ASYNC_ENGINE_COUNT: "cudaDevAttrAsyncEngineCount",
    DeviceAttr.HOST_REGISTER: "cudaDevAttrHostRegisterSupported",
    DeviceAttr.HOST_REGISTER_READ_ONLY: "cudaDevAttrHostRegisterReadOnlySupported",
    DeviceAttr.MAX_SHARED_PER_BLOCK: "cudaDevAttrMaxSharedMemoryPerBlockOptin",
}
_COPY_KINDS = {
    CopyKind.HOST_TO_DEVICE: "cudaMemcpyHostToDevice",
    CopyKind.DEVICE_TO_HOST: "cudaMemcpyDeviceToHost",
    CopyKind.DEVICE_TO_DEVICE: "cudaMemcpyDeviceToDevice",
}


class CudaBackend(GpuBackend):
    name = "cuda"
    vendor = Vendor.NVIDIA


def _missing() -> str | None:
    try:
        importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        return f"cuda-python is not installed ({INSTALL_HINT})"
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return f"{DRIVER_LIBRARY} not found: no NVIDIA driver"
    return None


def _has_bf16_mma(arch: str) -> bool:
    """mma.sync with bf16 inputs exists from compute capability 8.0 ('sm_80') on."""
    return int(arch.removeprefix("sm_")) >= 80


# CUDA 12.3: from this driver on, stream capture records a chained launch's dependency as a graph edge
# of its own kind (programmatic), so decode's captured steps keep the overlap. Below it chained
# launches are only taken when asked for.
CHAINED_DEFAULT_DRIVER = 12030


def _has_chained_launches(arch: str) -> bool:
    """Programmatic dependent launch (griddepcontrol, which every kernel opens with) exists from 9.0 on."""
    return int(arch.removeprefix("sm_")) >= 90


def _table() -> ApiTable:
    from cuda.bindings import driver, nvrtc, runtime

    errors = ErrorTable.by_name(runtime.cudaError_t, _RUNTIME_PROBLEMS)
    rtc_errors = ErrorTable.by_name(nvrtc.nvrtcResult, _NVRTC_PROBLEMS)
    attributes = {attr: getattr(runtime.cudaDeviceAttr, name) for attr, name in _ATTRIBUTES.items()}
    kinds = {kind: getattr(runtime.cudaMemcpyKind, name) for kind, name in _COPY_KINDS.items()}

    def rt(name: str) -> Call:
        return Call(name, getattr(runtime, name), errors)

    def drv(name: str, fn: Any = None) -> Call:
        return Call(name, fn or getattr(driver, name), errors)

    def rtc(name: str, fn: Any = None) -> Call:
        return Call(name, fn or getattr(nvrtc, name), rtc_errors)

    # NVRTC writes into a bytes object of the size it reported: a fresh one (bytes(n), n >= 1, is never
    # an object the interpreter shares).
    program_log = sized_output(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, bytes, decode_text)
    program_code = sized_output(nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, bytes, bytes)

    def launch(
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: int,
        values: tuple[Any, ...],
        types: tuple[Any, ...],
    ) -> Any:
        params = (values, types) if values else 0
        gx, gy, gz = grid
        bx, by, bz = block
        return driver.cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared_mem, stream, params, 0)

    chain = driver.CUlaunchAttribute()
    chain.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    chain.value.programmaticStreamSerializationAllowed = 1

    def launch_chained(
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        values: tuple[Any, ...],
        types: tuple[Any, ...],
    ) -> Any:
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared_mem
        config.hStream = stream
        config.attrs = [chain]
        config.numAttrs = 1
        return driver.cuLaunchKernelEx(config, function, (values, types) if values else 0, 0)

    return ApiTable(
        backend_name="cuda",
        bindings_version=package_version("cuda-bindings"),
        init=drv("cuInit", lambda: driver.cuInit(0)),
        device_count=rt("cudaGetDeviceCount"),
        set_device=rt("cudaSetDevice"),
        device_props=rt("cudaGetDeviceProperties"),
        device_attribute=Call(
            "cudaDeviceGetAttribute",
            lambda attr, index: runtime.cudaDeviceGetAttribute(attributes[attr], index),
            errors,
        ),
        read_props=lambda p: DeviceInfo(decode_text(p.name), int(p.totalGlobalMem), f"sm_{p.major}{p.minor}"),
        # Default registers mapped and portable (unified addressing); read-only asks for both by name.
        register_flags=lambda _props, read_only: (
            runtime.cudaHostRegisterPortable | runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterReadOnly
            if read_only
            else runtime.cudaHostRegisterDefault
        ),
        mem_info=rt("cudaMemGetInfo"),
        can_access_peer=rt("cudaDeviceCanAccessPeer"),
        enable_peer_access=Call(
            "cudaDeviceEnablePeerAccess", lambda peer: runtime.cudaDeviceEnablePeerAccess(peer, 0), errors
        ),
        device_synchronize=rt("cudaDeviceSynchronize"),
        set_stack_limit=Call(
            "cudaDeviceSetLimit",
            lambda nbytes: runtime.cudaDeviceSetLimit(runtime.cudaLimit.cudaLimitStackSize, nbytes),
            errors,
        ),
        driver_version=rt("cudaDriverGetVersion"),
        malloc=rt("cudaMalloc"),
        free=rt("cudaFree"),
        host_alloc=Call("cudaHostAlloc", lambda n: runtime.cudaHostAlloc(n, runtime.cudaHostAllocPortable), errors),
        host_free=rt("cudaFreeHost"),
        host_register=rt("cudaHostRegister"),
        host_unregister=rt("cudaHostUnregister"),
        host_device_pointer=Call(
            "cudaHostGetDevicePointer", lambda pointer: runtime.cudaHostGetDevicePointer(pointer, 0), errors
        ),
        stream_create=Call(
            "cudaStreamCreateWithFlags",
            lambda: runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking),
            errors,
        ),
        stream_destroy=rt("cudaStreamDestroy"),
        stream_synchronize=rt("cudaStreamSynchronize"),
        stream_query=rt("cudaStreamQuery"),
        stream_wait_event=Call("cudaStreamWaitEvent", lambda s, e: runtime.cudaStreamWaitEvent(s, e, 0), errors),
        stream_begin_capture=Call(
            "cudaStreamBeginCapture",
            lambda s: runtime.cudaStreamBeginCapture(s, runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
            errors,
        ),
        stream_end_capture=rt("cudaStreamEndCapture"),
        graph_instantiate=Call("cudaGraphInstantiate", lambda graph: runtime.cudaGraphInstantiate(graph, 0), errors),
        graph_launch=rt("cudaGraphLaunch"),
        graph_exec_destroy=rt("cudaGraphExecDestroy"),
        graph_destroy=rt("cudaGraphDestroy"),
        event_create=Call(
            "cudaEventCreateWithFlags",
            lambda timing: runtime.cudaEventCreateWithFlags(
                runtime.cudaEventDefault if timing else runtime.cudaEventDisableTiming
            ),
            errors,
        ),
        event_destroy=rt("cudaEventDestroy"),
        event_record=rt("cudaEventRecord"),
        event_synchronize=rt("cudaEventSynchronize"),
        event_query=rt("cudaEventQuery"),
        event_elapsed=rt("cudaEventElapsedTime"),
        memcpy_async=Call(
            "cudaMemcpyAsync",
            lambda dst, src, n, kind, s: runtime.cudaMemcpyAsync(dst, src, n, kinds[kind], s),
            errors,
        ),
        memcpy_peer_async=rt("cudaMemcpyPeerAsync"),
        memset_async=rt("cudaMemsetAsync"),
        compile_options=lambda arch: [f"--gpu-architecture={arch}".encode()],
        matrix_cores=_has_bf16_mma,
        int8_matrix_cores=_has_bf16_mma,  # mma.sync m16n8k32 s8 exists from sm_80 on, as bf16 does
        mma_fragments=_has_bf16_mma,
        compiler_version=rtc("nvrtcVersion"),
        program_create=rtc("nvrtcCreateProgram", lambda src, name: nvrtc.nvrtcCreateProgram(src, name, 0, [], [])),
        program_compile=rtc(
            "nvrtcCompileProgram",
            lambda program, options: nvrtc.nvrtcCompileProgram(program, len(options), options),
        ),
        program_log=rtc("nvrtcGetProgramLog", program_log),
        program_code=rtc("nvrtcGetCUBIN", program_code),
        program_destroy=rtc("nvrtcDestroyProgram"),
        module_load=drv("cuModuleLoadData"),
        module_get_function=drv("cuModuleGetFunction"),
        module_unload=drv("cuModuleUnload"),
        launch=drv("cuLaunchKernel", launch),
        allow_shared=drv(
            "cuFuncSetAttribute",
            lambda function, nbytes: driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes
            ),
        ),
        launch_chained=drv("cuLaunchKernelEx", launch_chained),
        chained_launches=_has_chained_launches,
        chained_default_driver=CHAINED_DEFAULT_DRIVER,
        profiler_start=rt("cudaProfilerStart"),
        profiler_stop=rt("cudaProfilerStop"),
    )


VENDOR = GpuVendor("CUDA", CudaBackend, INSTALL_HINT, _missing, _table)
probe = VENDOR.probe
open = VENDOR.open
