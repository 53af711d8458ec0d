#!/usr/bin/env bash
# Build llama.cpp's library for the CPU and the routing counter (routing.cpp) against it.
# usage: build.sh DIR_WITH_llama.cpp.tgz     -> DIR/build-cpu/bin/llamacpp-routing
# DIR/llama.cpp.tgz comes from ../shared/peers/llamacpp/prepare.sh. About 10 minutes on 2 cores.
set -euo pipefail
dir=$(cd "${1:?usage: build.sh DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
jobs=${JOBS:-2}
[ -d "$dir/src" ] || { mkdir -p "$dir/src" && tar xzf "$dir/llama.cpp.tgz" -C "$dir/src"; }
build="$dir/build-cpu"
# x86-64 with AVX2, and AVX-512 where the CPU has it. Not -march=native: that also compiles ggml's AMX
# matmul, which faults (SIGILL) where the CPU lists AMX but the kernel or hypervisor has not enabled it.
simd=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
for flag in avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16; do
    grep -qw "${flag%%:*}" /proc/cpuinfo && simd+=("-D${flag#*:}=ON")
done
cmake -S "$dir/src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF "${simd[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_OPENSSL=OFF >"$dir/cmake.log" 2>&1 \
    || { tail -30 "$dir/cmake.log"; exit 1; }
nice cmake --build "$build" --target llama -j "$jobs" >"$dir/build.log" 2>&1 || { tail -30 "$dir/build.log"; exit 1; }
mkdir -p "$build/bin"
nice g++ -O2 -std=c++17 -I"$dir/src/include" -I"$dir/src/ggml/include" "$here/routing.cpp" -o "$build/bin/llamacpp-routing" \
    "$build/src/libllama.a" "$build/ggml/src/libggml.a" "$build/ggml/src/libggml-cpu.a" "$build/ggml/src/libggml-base.a" \
    -fopenmp -lpthread -ldl
echo "$build/bin/llamacpp-routing"
