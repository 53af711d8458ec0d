#!/usr/bin/env bash
# Decode round 6 on one GPU: this tree's decode step (the router selecting by one warp, the norms on
# wider blocks, dense weights asked into L2 before the chained wait) beside the round's start and llama.cpp.
#
#   BASE=DIR OUT=DIR bash docs/results/decode-round6/run.sh    (from the repository root)
#
# BASE: a checkout of the round's start (its rows are skipped without it). Needs what
# microbench/model_h200.sh needs (its setup and make stages run first, in the background). Writes under
# $OUT: summary.txt (the table) and raw/ (every command's output). In order of worth:
#   1. the 8-layer step (decode_profile --alone) of head, n256 (head with the norms' blocks of 256
#      threads, as at the start) and base;
#   2. 48-layer tg64, everything on the GPU: head, base, llama-bench;
#   3. 48-layer tg64 with every expert in pinned host memory: head, llama-bench -ncmoe 48 -lm none;
#   4. the routing and dense kernel tests on the GPU (TESTS_S seconds, default 300).
set -uo pipefail
source microbench/summary.sh
source microbench/decode_rows.sh
start_models
declare -A DEFINES=([n256]="DENSE_NORM_BLOCK_THREADS=256 expertstream.kernels.dense.NORM_BLOCK_THREADS=256")
variants="head n256"
[ -n "${BASE:-}" ] && variants="$variants base"
profiles $variants
wait $maker
el "models: $(ls -la $F 2>&1 | awk '{print $5}') bytes"
tg64 head 0
[ -n "${BASE:-}" ] && tg64 base 0
llama_tg64 0
tg64 head 48
llama_tg64 48
# last: the kernel tests on the GPU (most of their time is compiling the kernels, on a fresh machine
# about 4 s a test; at 04:54 UTC 2026-12-06 they ran first, with 200 s, and 44 finished)
timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_router.py \
    tests/kernels/test_router_arch.py tests/kernels/test_dense.py >"$R/tests-cuda.txt" 2>&1
el "kernel tests on the GPU: $(grep -E 'passed|failed|error' "$R/tests-cuda.txt" | tail -1)"
