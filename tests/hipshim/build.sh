#!/usr/bin/env bash
# Build the HIP-to-CUDA shim: OUTDIR/lib/libamdhip64.so (HIP runtime over the CUDA runtime and
# driver) and OUTDIR/lib/libhiprtc.so (hipRTC over NVRTC). hip-python loads them through
# ROCM_PATH=OUTDIR. Needs a C compiler, the CUDA headers and libraries, and NVRTC (from the
# toolkit or the nvidia-cuda-nvrtc wheel). CUDA_HOME picks the toolkit; HIPSHIM_LIBCUDA names
# the driver library to link against when neither a toolkit stub nor the driver is found.
set -euo pipefail

usage="usage: $0 OUTDIR"
out=${1:?$usage}
here=$(cd "$(dirname "$0")" && pwd)
cc=${CC:-gcc}
python=${PYTHON:-python3}

die() { echo "build.sh: $*" >&2; exit 1; }

nvcc_home() {
    local nvcc
    nvcc=$(command -v nvcc 2>/dev/null) || return 0
    dirname "$(dirname "$(readlink -f "$nvcc")")"
}

# The first of $CUDA_HOME, $CUDA_PATH, nvcc's toolkit and /usr/local/cuda that has cuda.h.
cuda_home=
for candidate in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$(nvcc_home)" /usr/local/cuda; do
    if [[ -n $candidate && -f $candidate/include/cuda.h ]]; then
        cuda_home=$candidate
        break
    fi
done
[[ -n $cuda_home ]] || die "no CUDA toolkit with include/cuda.h found; set CUDA_HOME"

# Wheels (torch's nvidia-* dependencies) keep headers and libraries under nvidia/<name>/.
wheel_dirs=$("$python" - <<'PY' 2>/dev/null || true
import os
try:
    import nvidia
except ImportError:
    raise SystemExit
for root in nvidia.__path__:
    for sub in ("cu13", "cuda_nvrtc", "cuda_runtime"):
        if os.path.isdir(os.path.join(root, sub)):
            print(os.path.join(root, sub))
PY
)

# first_match PATTERN DIR...: the first file matching PATTERN in the first DIR that has one.
first_match() {
    local pattern=$1 dir f
    shift
    for dir in "$@"; do
        for f in "$dir"/$pattern; do
            [[ -f $f ]] && { echo "$f"; return 0; }
        done
    done
    return 1
}

toolkit_include=("$cuda_home/include")
toolkit_lib=("$cuda_home/lib64" "$cuda_home/lib" "$cuda_home/targets/x86_64-linux/lib")
wheel_include=()
wheel_lib=()
for d in $wheel_dirs; do
    wheel_include+=("$d/include")
    wheel_lib+=("$d/lib")
done

cuda_h=$cuda_home/include/cuda.h
cudart=$(first_match 'libcudart.so*' "${toolkit_lib[@]}" "${wheel_lib[@]}") || die "libcudart not found"
nvrtc_h=$(first_match nvrtc.h "${toolkit_include[@]}" "${wheel_include[@]}") || die "nvrtc.h not found"
nvrtc=$(first_match 'libnvrtc.so*' "${toolkit_lib[@]}" "${wheel_lib[@]}") || die "libnvrtc not found"

# Link against the toolkit's stub when there is one; at run time the loader finds the driver's
# libcuda.so.1 (never put the stub directory on the rpath).
libcuda=${HIPSHIM_LIBCUDA:-}
if [[ -z $libcuda ]]; then
    libcuda=$(first_match libcuda.so "${toolkit_lib[@]/%//stubs}") ||
        libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')
fi
[[ -n $libcuda && -f $libcuda ]] || die "libcuda not found; install the driver or set HIPSHIM_LIBCUDA"

mkdir -p "$out/lib"
cflags=(-std=c11 -O2 -fPIC -fvisibility=hidden -Wall -Wextra -I"$(dirname "$cuda_h")" -I"$(dirname "$nvrtc_h")")
ldflags=(-shared -Wl,-z,defs)

"$cc" "${cflags[@]}" "${ldflags[@]}" -o "$out/lib/libamdhip64.so" \
    "$here/errors.c" "$here/device.c" "$here/memory.c" "$here/stream_event.c" "$here/module.c" \
    "$cudart" "$libcuda" -Wl,-rpath,"$(dirname "$cudart")"

# NVRTC dlopens libnvrtc-builtins by bare name and has no search path of its own; the loader
# then falls back to the DT_RPATH of the objects that loaded it, so use the old tag here
# (RUNPATH would not be consulted for that dlopen).
"$cc" "${cflags[@]}" "${ldflags[@]}" -o "$out/lib/libhiprtc.so" "$here/hiprtc.c" \
    "$nvrtc" "$cudart" -Wl,--disable-new-dtags -Wl,-rpath,"$(dirname "$nvrtc")" -Wl,-rpath,"$(dirname "$cudart")"

echo "built $out/lib/libamdhip64.so and $out/lib/libhiprtc.so"
echo "  cuda: $cuda_home  cudart: $cudart  libcuda: $libcuda  nvrtc: $nvrtc"
