"""The kernel source (the .cu files of expertstream/kernels, as one) compiles with NVRTC, without
warnings, for the architectures the CUDA backend targets: sm_80 and sm_90 take mma.cu's
tensor-core step, sm_75 its generic one.

NVRTC needs no GPU, so this runs wherever cuda-bindings is installed; elsewhere it is
skipped with the reason. hipRTC compiles the same source on the HIP backend's own run.
"""

from __future__ import annotations

import pytest

from expertstream.backends._gpu_api import decode_text, sized_output
from expertstream.kernels import kernel_source, type_kernels
from expertstream.kernels.layout import FORMATS

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")


def _log(program: object) -> str:
    # The CUDA backend's own fetch: NVRTC writes into a fresh buffer. (A buffer of `b" " * size` was the
    # interpreter's shared b" " for an empty log, size 1, and NVRTC overwrote it for the whole process.)
    err, text = sized_output(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, bytes, decode_text)(program)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    return text.strip()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_75"])
def test_kernel_source_compiles_cleanly(arch: str) -> None:
    err, program = nvrtc.nvrtcCreateProgram(kernel_source().encode(), b"kernels.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        names = [name for fmt in FORMATS.values() for name in type_kernels(fmt)]
        for name in names:
            (err,) = nvrtc.nvrtcAddNameExpression(program, name.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        options = [f"--gpu-architecture={arch}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        log = _log(program)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log
        assert log == "", f"warnings:\n{log}"
        for name in names:
            err, lowered = nvrtc.nvrtcGetLoweredName(program, name.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS and lowered == name.encode(), (name, err, lowered)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
