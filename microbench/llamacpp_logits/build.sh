#!/usr/bin/env bash
# Build llamacpp-logits (logits.cpp) against a built llama.cpp library.
# usage: build.sh DIR [OUT]
#   DIR: a folder holding include/llama.h and the shared libraries (in DIR/bin, DIR/lib or DIR itself),
#        as the prebuilt llamacpp-sm90 archive unpacks; or a source build made by
#        ../shared/peers/llamacpp/build.sh (DIR/src/include, DIR/build/bin).
#   OUT: the binary to write (default: beside the libraries, LIBDIR/llamacpp-logits).
# The binary finds the libraries through its rpath; no LD_LIBRARY_PATH needed. The libraries' own
# dependencies (CUDA driver, cuBLAS) are left to the loader at run time, so that the tool links where
# the linker cannot see them.
set -euo pipefail
dir=$(cd "${1:?usage: build.sh DIR [OUT]}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$dir/include/llama.h" ]; then
    includes=(-I"$dir/include")
    lib=
    for candidate in "$dir/bin" "$dir/lib" "$dir"; do
        [ -e "$candidate/libllama.so" ] && { lib=$candidate; break; }
    done
elif [ -f "$dir/src/include/llama.h" ]; then
    includes=(-I"$dir/src/include" -I"$dir/src/ggml/include")
    lib="$dir/build/bin"
else
    echo "build.sh: $dir holds neither include/llama.h nor src/include/llama.h" >&2
    exit 2
fi
[ -n "$lib" ] && [ -e "$lib/libllama.so" ] || { echo "build.sh: no libllama.so under $dir" >&2; exit 2; }
out=${2:-$lib/llamacpp-logits}
g++ -O2 -std=c++17 -Wall -Wextra "${includes[@]}" "$here/logits.cpp" -o "$out" \
    -L"$lib" -lllama -lggml -lggml-base -ldl -Wl,-rpath,"$lib" -Wl,--allow-shlib-undefined
echo "$out"
