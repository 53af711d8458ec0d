#!/usr/bin/env bash
# Registers and shared memory of the matrix-vector kernels as ptxas reports them for sm_90.
#   [TYPES="Q8_0 MXFP4"] bash docs/results/decode-round7/cpu/ptxas_gemv.sh [TREE]    (TREE: a checkout; default
#   this one; TYPES: the weight types, default Q4_0 Q4_K Q6_K)
set -euo pipefail
tree=${1:-.}
work=$(mktemp -d)
(cd "$tree" && PYTHONPATH=. python3 -c "
from gguf import GGMLQuantizationType as T
from expertstream.kernels import kernel_source
open('$work/k.cu', 'w').write(kernel_source([T[name] for name in '${TYPES:-Q4_0 Q4_K Q6_K}'.split()]))")
nvcc -arch=sm_90 -cubin -std=c++17 -Xptxas -v "$work/k.cu" -o "$work/k.cubin" 2>"$work/ptxas.log"
python3 - "$work/ptxas.log" <<'PY'
import re, sys
name = None
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        name = m.group(1)
    m = re.search(r"(\d+) bytes stack frame", line)
    if m:
        stack = m.group(1)
    m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
    if m and name and ("mul_mat_vec" in name or "gate_up_vec" in name):
        print(f"{name:42s} {m.group(1):>4s} registers {m.group(2):>6s} bytes smem {stack:>4s} bytes stack")
PY
rm -rf "$work"
