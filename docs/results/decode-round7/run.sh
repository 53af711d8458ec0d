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
#   2. the 8-layer step (decode_profile --alone) of head, d1 (head with MOE_GEMV_INT8_DEPTH 1: one
#      slice of each row a lane in flight on the int8 path, the default since these runs) and base;
#   3. 48-layer tg64, everything on the GPU: head, d1, base, llama-bench;
#   4. 48-layer tg64 with every expert in pinned host memory: head, base, llama-bench -ncmoe 48 -lm none.
set -uo pipefail
source microbench/summary.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee "$S"
M=/tmp/m8.gguf F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf LCP=/tmp/llamacpp-sm90
mkdir -p /tmp/mh
(OUT=/tmp/mh bash microbench/model_h200.sh setup >"$R/make.log" 2>&1
 [ -f $M ] || python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M >>"$R/make.log" 2>&1
 OUT=/tmp/mh bash microbench/model_h200.sh make >>"$R/make.log" 2>&1) &
maker=$!
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py \
    tests/kernels/test_dense.py >"$R/tests-cuda.txt" 2>&1
el "kernel tests on the GPU: $(grep -E 'passed|failed|error' "$R/tests-cuda.txt" | tail -1)"
in_tree() {  # VARIANT SECONDS MODULE ARGS...: python3 -m MODULE ARGS in a variant, SECONDS at most
    local v=$1 t=$2; shift 2
    case $v in
    head) timeout "$t" python3 -m "$@" ;;
    d1) timeout "$t" python3 docs/results/decode-round5/with_defines.py MOE_GEMV_INT8_DEPTH=1 -- -m "$@" ;;
    base) (cd "$BASE" && PYTHONPATH="$BASE:${PYTHONPATH:-}" timeout "$t" python3 -m "$@") ;;
    esac
}
variants="head d1"
[ -n "${BASE:-}" ] && variants="$variants base"
until [ -f $M ] && ! pgrep -f "make-model.*m8.gguf" >/dev/null; do sleep 2; done
for v in $variants; do
    in_tree $v 90 microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 40 -ncmoe 0 --alone \
        >"$R/profile-$v.txt" 2>&1
    el "8-layer step $v: $(grep -E 'one decode step' "$R/profile-$v.txt" | tail -1)"
done
wait $maker
el "models: $(ls -la $F 2>&1 | awk '{print $5}') bytes"
tg64() {  # VARIANT NCMOE: expertstream bench tg64, experts past the first NCMOE layers' on the GPU
    in_tree $1 150 expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe $2 \
        -r 3 -o json >"$R/tg64-$1-ncmoe$2.json" 2>"$R/tg64-$1-ncmoe$2.err"
    el "48-layer tg64 -ncmoe $2 $1: $(python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(round(r['decode_tokens_per_s'], 1), '+-', round(r['decode_tokens_per_s_sd'] or 0, 1), 'median step',
          round(r['decode_median_step_ms'], 3), 'ms', r['decode_sha256'][:12],
          'link limit', round(r.get('decode_link_limit_tokens_per_s') or 0, 1))
" "$R/tg64-$1-ncmoe$2.json" 2>&1)"
}
llama_tg64() {  # NCMOE
    LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-} timeout 150 $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $1 -lm none \
        -fa 0 -p 0 -n 64 -r 3 -o md >"$R/llama-tg64-ncmoe$1.md" 2>&1
    el "llama-bench tg64 -ncmoe $1: $(grep tg64 "$R/llama-tg64-ncmoe$1.md" | awk -F'|' '{print $(NF-1)}')"
}
tg64 head 0
tg64 d1 0
[ -n "${BASE:-}" ] && tg64 base 0
llama_tg64 0
tg64 head 48
[ -n "${BASE:-}" ] && tg64 base 48
llama_tg64 48
# the rows' JSON and stderr in one archive: a call brings back a limited number of files
(cd "$R" && tar czf tg64.tgz tg64-* && rm -f tg64-*)
