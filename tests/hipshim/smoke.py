"""Exercise hip-python directly through the HIP-to-CUDA shim, one check per HIP feature we use.

Run with ROCM_PATH pointing at a build of tests/hipshim/build.sh on a machine with an NVIDIA
GPU. Each check prints one line; the exit status is the number of failed checks (0 = all
passed). Where cuda-python is installed, device properties are compared with CUDA's own.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hip import hip, hiprtc

log = logging.getLogger("hipshim.smoke")

E = hip.hipError_t
KERNEL = b"""
extern "C" __global__ void axpy(float* y, const float* x, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


class CheckFailed(AssertionError):
    """A HIP call returned something other than what the check expects."""


def ok(result: Any) -> Any:
    """Unpack a hip-python tuple, raising unless its error is success."""
    err, *values = result
    if int(err) != 0:
        raise CheckFailed(f"expected success, got {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def expect(result: Any, code: Any) -> None:
    err = result[0]
    if err != code:
        raise CheckFailed(f"expected {code!r}, got {err!r}")


def text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def same(name: str, got: Any, want: Any) -> None:
    if got != want:
        raise CheckFailed(f"{name}: got {got!r}, want {want!r}")


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


def check_init_and_devices() -> str:
    ok(hip.hipInit(0))
    driver = ok(hip.hipDriverGetVersion())
    runtime = ok(hip.hipRuntimeGetVersion())
    count = ok(hip.hipGetDeviceCount())
    if count < 1 or driver <= 0 or runtime <= 0:
        raise CheckFailed(f"count={count} driver={driver} runtime={runtime}")
    ok(hip.hipSetDevice(0))
    same("hipGetDevice", ok(hip.hipGetDevice()), 0)
    same("hipDeviceGet", ok(hip.hipDeviceGet(0)), 0)
    expect(hip.hipSetDevice(count), E.hipErrorInvalidDevice)
    return f"{count} device(s), driver {driver}, runtime {runtime}"


def cuda_properties() -> Any | None:
    """CUDA's own view of device 0, when cuda-python is installed."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    err, props = cudart.cudaGetDeviceProperties(0)
    return props if int(err) == 0 else None


def check_properties() -> str:
    props = ok(hip.hipGetDeviceProperties(0))
    arch = text(props.gcnArchName)
    same("gcnArchName", arch, f"sm_{props.major}{props.minor}")
    same("warpSize", props.warpSize, 32)
    same("canMapHostMemory", props.canMapHostMemory, 1)
    same("unifiedAddressing", props.unifiedAddressing, 1)
    reference = cuda_properties()
    if reference is not None:
        same("name", text(props.name), text(reference.name).rstrip("\x00"))
        for field in ("totalGlobalMem", "sharedMemPerBlock", "major", "minor", "multiProcessorCount",
                      "l2CacheSize", "pciBusID", "asyncEngineCount", "maxThreadsPerBlock"):
            same(field, getattr(props, field), getattr(reference, field))
    free, total = ok(hip.hipMemGetInfo())
    same("hipMemGetInfo total", total, props.totalGlobalMem)
    if not 0 < free <= total:
        raise CheckFailed(f"free {free} not in (0, {total}]")
    compared = "compared with CUDA" if reference is not None else "cuda-python absent, not compared"
    return f"{text(props.name)} {arch}, {props.totalGlobalMem >> 20} MiB ({compared})"


def check_attributes() -> str:
    props = ok(hip.hipGetDeviceProperties(0))
    attr = hip.hipDeviceAttribute_t
    pairs = {
        attr.hipDeviceAttributeComputeCapabilityMajor: props.major,
        attr.hipDeviceAttributeComputeCapabilityMinor: props.minor,
        attr.hipDeviceAttributeMultiprocessorCount: props.multiProcessorCount,
        attr.hipDeviceAttributeAsyncEngineCount: props.asyncEngineCount,
        attr.hipDeviceAttributeWarpSize: props.warpSize,
        attr.hipDeviceAttributeL2CacheSize: props.l2CacheSize,
        attr.hipDeviceAttributeHostRegisterSupported: props.hostRegisterSupported,
        attr.hipDeviceAttributeCanMapHostMemory: props.canMapHostMemory,
    }
    for key, want in pairs.items():
        same(f"attribute {key!r}", ok(hip.hipDeviceGetAttribute(key, 0)), want)
    expect(hip.hipDeviceGetAttribute(attr.hipDeviceAttributeIsLargeBar, 0), E.hipErrorInvalidValue)
    same("hipDeviceCanAccessPeer(0, 0)", ok(hip.hipDeviceCanAccessPeer(0, 0)), 0)
    return f"{len(pairs)} attributes agree with the properties"


def check_memcpy() -> str:
    n = 1 << 20
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    back = np.zeros(n, dtype=np.uint8)
    dev = ok(hip.hipMalloc(n))
    try:
        ok(hip.hipMemcpy(dev, src, n, hip.hipMemcpyKind.hipMemcpyHostToDevice))
        ok(hip.hipMemcpy(back, dev, n, hip.hipMemcpyKind.hipMemcpyDeviceToHost))
        same("sync round trip", back.tobytes(), src.tobytes())
        stream = ok(hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking))
        other = ok(hip.hipMalloc(n))
        back[:] = 0
        ok(hip.hipMemcpyAsync(other, dev, n, hip.hipMemcpyKind.hipMemcpyDeviceToDevice, stream))
        ok(hip.hipMemsetAsync(int(other) + 16, 0xAB, 16, stream))
        ok(hip.hipMemsetD8Async(int(other) + 64, 0xCD, 8, stream))
        ok(hip.hipMemcpyAsync(back, other, n, hip.hipMemcpyKind.hipMemcpyDeviceToHost, stream))
        ok(hip.hipStreamSynchronize(stream))
        want = src.copy()
        want[16:32] = 0xAB
        want[64:72] = 0xCD
        same("async copy + memsets", back.tobytes(), want.tobytes())
        back[:] = 0
        ok(hip.hipMemcpy(other, dev, n, hip.hipMemcpyKind.hipMemcpyDeviceToDeviceNoCU))
        ok(hip.hipMemcpy(back, other, n, hip.hipMemcpyKind.hipMemcpyDeviceToHost))
        same("DeviceToDeviceNoCU copy", back.tobytes(), src.tobytes())
        ok(hip.hipFree(other))
        ok(hip.hipStreamDestroy(stream))
    finally:
        ok(hip.hipFree(dev))
    expect(hip.hipMalloc(1 << 60), E.hipErrorOutOfMemory)
    expect(hip.hipGetLastError(), E.hipErrorOutOfMemory)
    return f"{n} bytes both ways, sync and async, memset and memsetD8"


def check_pinned_and_registered() -> str:
    n = 1 << 16
    pinned = ok(hip.hipHostMalloc(n, hip.hipHostMallocPortable))
    view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(pinned)))
    view[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    dev = ok(hip.hipMalloc(n))
    registered = np.zeros(n, dtype=np.uint8)
    try:
        attrs = ok(hip.hipPointerGetAttributes(pinned))
        same("pinned memory type", int(attrs.type), int(hip.hipMemoryType.hipMemoryTypeHost))
        attrs = ok(hip.hipPointerGetAttributes(dev))
        same("device memory type", int(attrs.type), int(hip.hipMemoryType.hipMemoryTypeDevice))
        same("device of device memory", attrs.device, 0)
        ok(hip.hipHostRegister(registered, n, hip.hipHostRegisterDefault))
        expect(hip.hipHostRegister(registered, n, hip.hipHostRegisterDefault),
               E.hipErrorHostMemoryAlreadyRegistered)
        ok(hip.hipMemcpyAsync(dev, pinned, n, hip.hipMemcpyKind.hipMemcpyHostToDevice, None))
        ok(hip.hipMemcpyAsync(registered, dev, n, hip.hipMemcpyKind.hipMemcpyDeviceToHost, None))
        ok(hip.hipDeviceSynchronize())
        same("pinned -> device -> registered", registered.tobytes(), view.tobytes())
        ok(hip.hipHostUnregister(registered))
        expect(hip.hipHostUnregister(registered), E.hipErrorHostMemoryNotRegistered)
        expect(hip.hipGetLastError(), E.hipErrorHostMemoryNotRegistered)
    finally:
        ok(hip.hipFree(dev))
        ok(hip.hipHostFree(pinned))
    return "hipHostMalloc, hipHostRegister/Unregister, hipPointerGetAttributes"


def check_streams_and_events() -> str:
    a = ok(hip.hipStreamCreate())
    b = ok(hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking))
    start = ok(hip.hipEventCreate())
    stop = ok(hip.hipEventCreateWithFlags(0))
    fence = ok(hip.hipEventCreateWithFlags(hip.hipEventDisableTiming))
    n = 64 << 20
    dev = ok(hip.hipMalloc(n))
    try:
        ok(hip.hipEventRecord(start, a))
        ok(hip.hipMemsetAsync(dev, 1, n, a))
        ok(hip.hipEventRecord(stop, a))
        ok(hip.hipEventRecord(fence, a))
        ok(hip.hipStreamWaitEvent(b, fence, 0))
        ok(hip.hipMemsetAsync(dev, 2, 16, b))  # ordered after stream a's memset
        ok(hip.hipStreamSynchronize(b))
        ok(hip.hipEventSynchronize(stop))
        same("hipEventQuery after sync", ok(hip.hipEventQuery(fence)), None)
        same("hipStreamQuery after sync", ok(hip.hipStreamQuery(a)), None)
        ms = ok(hip.hipEventElapsedTime(start, stop))
        if not ms >= 0.0:
            raise CheckFailed(f"elapsed {ms} ms")
        expect(hip.hipEventElapsedTime(start, fence), E.hipErrorInvalidHandle)
        expect(hip.hipGetLastError(), E.hipErrorInvalidHandle)
        head = np.zeros(32, dtype=np.uint8)
        ok(hip.hipMemcpy(head, dev, 32, hip.hipMemcpyKind.hipMemcpyDeviceToHost))
        same("cross-stream order", head.tobytes(), bytes([2] * 16 + [1] * 16))
    finally:
        ok(hip.hipFree(dev))
        for event in (start, stop, fence):
            ok(hip.hipEventDestroy(event))
        for stream in (a, b):
            ok(hip.hipStreamDestroy(stream))
    return f"two streams, wait on event, elapsed {ms:.3f} ms for a {n >> 20} MiB memset"


def compile_kernel(source: bytes, options: list[bytes]) -> tuple[Any, bytes, str]:
    """(hiprtc result of the compile, code, log)."""
    prog = ok(hiprtc.hiprtcCreateProgram(source, b"kernel.cu", 0, None, None))
    try:
        (result,) = hiprtc.hiprtcCompileProgram(prog, len(options), options)
        size = ok(hiprtc.hiprtcGetProgramLogSize(prog))
        log_buf = bytearray(size)
        ok(hiprtc.hiprtcGetProgramLog(prog, log_buf))
        code = b""
        if result == hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            code_buf = bytearray(ok(hiprtc.hiprtcGetCodeSize(prog)))
            ok(hiprtc.hiprtcGetCode(prog, code_buf))
            code = bytes(code_buf)
        return result, code, log_buf.rstrip(b"\x00").decode(errors="replace")
    finally:
        ok(hiprtc.hiprtcDestroyProgram(prog.createRef()))


def check_hiprtc_and_launch() -> str:
    arch = text(ok(hip.hipGetDeviceProperties(0)).gcnArchName)
    result, code, _ = compile_kernel(KERNEL, [f"--offload-arch={arch}".encode(), b"-DUNUSED=1"])
    same("hiprtcCompileProgram", result, hiprtc.hiprtcResult.HIPRTC_SUCCESS)
    module = ok(hip.hipModuleLoadData(code))
    n = 1000
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 1.0, dtype=np.float32)
    dx, dy = ok(hip.hipMalloc(x.nbytes)), ok(hip.hipMalloc(y.nbytes))
    try:
        function = ok(hip.hipModuleGetFunction(module, b"axpy"))
        expect(hip.hipModuleGetFunction(module, b"no_such_kernel"), E.hipErrorNotFound)
        expect(hip.hipGetLastError(), E.hipErrorNotFound)
        ok(hip.hipMemcpy(dx, x, x.nbytes, hip.hipMemcpyKind.hipMemcpyHostToDevice))
        ok(hip.hipMemcpy(dy, y, y.nbytes, hip.hipMemcpyKind.hipMemcpyHostToDevice))
        extra = (int(dy), int(dx), ctypes.c_float(2.0), ctypes.c_int(n))
        ok(hip.hipModuleLaunchKernel(function, (n + 255) // 256, 1, 1, 256, 1, 1, 0, None, None, extra))
        ok(hip.hipDeviceSynchronize())
        out = np.empty_like(y)
        ok(hip.hipMemcpy(out, dy, out.nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToHost))
        same("axpy result", out.tobytes(), (2.0 * x + 1.0).astype(np.float32).tobytes())
    finally:
        ok(hip.hipFree(dx))
        ok(hip.hipFree(dy))
        ok(hip.hipModuleUnload(module))
    result, _, log_text = compile_kernel(b'extern "C" __global__ void f() { undefined_name = 1; }', [])
    same("bad source", result, hiprtc.hiprtcResult.HIPRTC_ERROR_COMPILATION)
    if "undefined_name" not in log_text:
        raise CheckFailed(f"compile log does not name the error: {log_text!r}")
    result, _, log_text = compile_kernel(KERNEL, [b"--offload-arch=gfx942"])
    same("AMD target", result, hiprtc.hiprtcResult.HIPRTC_ERROR_INVALID_OPTION)
    if "gfx942" not in log_text:
        raise CheckFailed(f"log does not name the rejected target: {log_text!r}")
    major, minor = ok(hiprtc.hiprtcVersion())
    return f"compiled for {arch} ({len(code)} bytes), launched with extra=, hiprtc {major}.{minor}"


def check_error_reporting() -> str:
    hip.hipGetLastError()  # start clean whatever an earlier check left
    expect(hip.hipSetDevice(10_000), E.hipErrorInvalidDevice)
    same("hipPeekAtLastError", hip.hipPeekAtLastError()[0], E.hipErrorInvalidDevice)
    same("hipGetLastError", hip.hipGetLastError()[0], E.hipErrorInvalidDevice)
    same("hipGetLastError after reset", hip.hipGetLastError()[0], E.hipSuccess)
    same("hipGetErrorName", text(ok(hip.hipGetErrorName(E.hipErrorInvalidDevice))), "hipErrorInvalidDevice")
    message = text(ok(hip.hipGetErrorString(E.hipErrorOutOfMemory)))
    if "memory" not in message:
        raise CheckFailed(f"hipGetErrorString(OutOfMemory) = {message!r}")
    name = text(ok(hiprtc.hiprtcGetErrorString(hiprtc.hiprtcResult.HIPRTC_ERROR_COMPILATION)))
    if "COMPILATION" not in name:
        raise CheckFailed(f"hiprtcGetErrorString = {name!r}")
    return "last error kept and reset, names and strings"


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    name: str
    passed: bool
    detail: str


CHECKS: tuple[Callable[[], str], ...] = (
    check_init_and_devices,
    check_properties,
    check_attributes,
    check_memcpy,
    check_pinned_and_registered,
    check_streams_and_events,
    check_hiprtc_and_launch,
    check_error_reporting,
)


def run(check: Callable[[], str]) -> Outcome:
    name = check.__name__.removeprefix("check_")
    try:
        return Outcome(name, True, check())
    except Exception as exc:  # a smoke run reports every failure and carries on
        log.debug("%s", traceback.format_exc())
        return Outcome(name, False, f"{type(exc).__name__}: {exc}")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    outcomes = [run(check) for check in CHECKS]
    for outcome in outcomes:
        log.info("%-22s %s  %s", outcome.name, "PASS" if outcome.passed else "FAIL", outcome.detail)
    failed = sum(not o.passed for o in outcomes)
    log.info("%d passed, %d failed", len(outcomes) - failed, failed)
    return failed


if __name__ == "__main__":
    sys.exit(main())
