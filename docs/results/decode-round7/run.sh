#!/usr/bin/env bash
# Decode round 7 on one GPU: this tree's matrix-vector kernels (Q4_0 and Q4_K rows against activations
# on the int8 grid, two slices a lane in flight) beside the round's start and llama.cpp.
#
#   BASE=DIR OUT=DIR bash docs/results/decode-round7/run.sh    (from the repository root)
#
# BASE: a checkout of the round's start (its rows are skipped without it). Needs what
# microbench/model_h200.sh needs (its setup and make stages run in the background while the GPU tests
# of the changed kernels run). Writes under $OUT: summary.txt (the table) and raw/ (every command's
# output). In order:
#   1. the matrix-vector and dense kernel tests on the GPU (TESTS_S seconds, default 150);
#   2. the 8-layer step (decode_profile --alone) of head, d2 (head with MOE_GEMV_INT8_DEPTH 2: two
#      slices of each row a lane in flight on the int8 path) and base;
#   3. 48-layer tg64, everything on the GPU: head, d2, base, llama-bench;
#   4. 48-layer tg64 with every expert in pinned host memory: head, base, llama-bench -ncmoe 48 -lm none.
set -uo pipefail
source microbench/summary.sh
source microbench/decode_rows.sh
start_models
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py \
    tests/kernels/test_dense.py >"$R/tests-cuda.txt" 2>&1
el "kernel tests on the GPU: $(grep -E 'passed|failed|error' "$R/tests-cuda.txt" | tail -1)"
declare -A DEFINES=([d2]="MOE_GEMV_INT8_DEPTH=2")
variants="head d2"
[ -n "${BASE:-}" ] && variants="$variants base"
profiles $variants
wait $maker
el "models: $(ls -la $F 2>&1 | awk '{print $5}') bytes"
tg64 head 0
tg64 d2 0
[ -n "${BASE:-}" ] && tg64 base 0
llama_tg64 0
tg64 head 48
[ -n "${BASE:-}" ] && tg64 base 48
llama_tg64 48
# the rows' JSON and stderr in one archive: a call brings back a limited number of files
(cd "$R" && tar czf tg64.tgz tg64-* && rm -f tg64-*)
