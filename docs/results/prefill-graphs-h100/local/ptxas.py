"""Registers, spills and shared memory of the MXFP4 direct-decode kernels, compiled by NVRTC for sm_90."""

from cuda.bindings import nvrtc

from expertstream.kernels import kernel_source
from expertstream.kernels.program import module_types

source = kernel_source(module_types("moe_mul_mat_id_direct_mxfp4_m64")).encode()
_, program = nvrtc.nvrtcCreateProgram(source, b"k.cu", 0, [], [])
options = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v", b"-default-device", b"--std=c++17"]
(result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
_, size = nvrtc.nvrtcGetProgramLogSize(program)
log = b" " * size
nvrtc.nvrtcGetProgramLog(program, log)
print("compile", result)
lines = log.decode(errors="replace").splitlines()
for i, line in enumerate(lines):
    if "direct_mxfp4" in line:
        print("\n".join(lines[i : i + 4]))
