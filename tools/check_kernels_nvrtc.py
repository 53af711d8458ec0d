"""Compile the MoE kernel source (and Stream.gather_h2d's kernel) with NVRTC for one GPU architecture,
without a GPU: catches source errors.

python3 tools/check_kernels_nvrtc.py [--arch sm_90]
"""

from __future__ import annotations

import argparse
import sys

from cuda.bindings import nvrtc

from expertstream.backends._gpu import gather_source
from expertstream.kernels import kernel_source


def _check(result: tuple, call: str) -> object:
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {err}")
    return rest[0] if rest else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    program = _check(
        nvrtc.nvrtcCreateProgram((kernel_source() + "\n" + gather_source()).encode(), b"kernels.cu", 0, [], []),
        "create",
    )
    options = [f"--gpu-architecture={args.arch}".encode(), b"-std=c++17"]
    (compiled,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    size = _check(nvrtc.nvrtcGetProgramLogSize(program), "log size")
    log = b" " * int(size)  # type: ignore[call-overload]
    _check(nvrtc.nvrtcGetProgramLog(program, log), "log")
    text = log.decode(errors="replace").strip("\x00 \n")
    if text:
        print(text)
    if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        print(f"the kernel source does not compile for {args.arch}", file=sys.stderr)
        return 1
    print(f"the kernel source compiles for {args.arch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
