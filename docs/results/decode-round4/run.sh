#!/usr/bin/env bash
# Decode round 4 on one GPU: the launches this round removed and chained launches, against a base tree.
#
#   BASE=DIR OUT=DIR bash docs/results/decode-round4/run.sh    (from the repository root)
#
# BASE: a checkout of the commit before the round (8b9ef3c), for the "base" rows; left out, they are
# skipped. Needs what microbench/model_h200.sh needs (its setup and make stages run first).
# Writes under $OUT: summary.txt (the table), raw/ (every command's output).
#   1. the CUDA tests of the kernels this round added, chained launches on (TEST_S seconds at most, 150;
#      TEST_K: a pytest -k expression to run fewer);
#   2. the 8-layer step (decode_profile --alone: each launch timed on its own beside the replayed
#      step) for chained launches on (c1) and off (c0), and base;
#   3. 48-layer tg64 all on the GPU of the three, beside llama-bench -ncmoe 0 -n 64 in the same call;
#   4. the experts' matrix-vector kernels alone: microbench.kernels --gemv at Qwen3-30B-A3B expert shapes;
#   5. the 8-layer step of the three again.
# The H100 run of 2026-12-06 used this script as of commit ad39cb8, which also ran a c1g4 variant (row
# groups a block in the matrix-vector kernels, since taken back): `git show ad39cb8:<this file>`.
set -uo pipefail
source microbench/summary.sh  # the summary and timer lines it ran with, shared since with later scripts
mkdir -p /tmp/mh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee "$S"
M=/tmp/m8.gguf F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
(OUT=/tmp/mh bash microbench/model_h200.sh setup make >"$R/make.log" 2>&1
 [ -f $M ] || python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M >>"$R/make.log" 2>&1) &
maker=$!
EXPERTSTREAM_CHAINED_LAUNCHES=1 timeout ${TEST_S:-150} python3 -m pytest -q tests/kernels/test_gemv.py \
    tests/kernels/test_router_arch.py tests/kernels/test_attention.py tests/kernels/test_dense.py \
    tests/backends/test_graphs.py tests/engine/test_model.py --backend cuda -p no:cacheprovider \
    ${TEST_K:+-k "$TEST_K"} >"$R/tests.txt" 2>&1
el "cuda tests, chained launches: $(tail -1 "$R/tests.txt")"
wait $maker
in_tree() {  # VARIANT COMMAND...: c1/c0 in this tree with chained launches on/off, base in $BASE
    local v=$1; shift
    case $v in
    c1) EXPERTSTREAM_CHAINED_LAUNCHES=1 "$@" ;;
    c0) EXPERTSTREAM_CHAINED_LAUNCHES=0 "$@" ;;
    base) (cd "$BASE" && PYTHONPATH="$BASE:${PYTHONPATH:-}" "$@") ;;
    esac
}
variants="c1 c0"
[ -n "${BASE:-}" ] && variants="c1 c0 base"
profiles() {  # ROUND: the 8-layer step of every variant
    for v in $variants; do
        in_tree $v timeout 120 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 \
            --top 40 -ncmoe 0 --alone >"$R/profile-$v-$1.txt" 2>&1
        el "8-layer step $v round $1: $(grep -E 'one decode step' "$R/profile-$v-$1.txt" | tail -1)"
    done
}
# In order of worth: a call cut short keeps what came before.
profiles 1
for v in $variants; do
    in_tree $v timeout 120 python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 \
        --host-memory pinned -ncmoe 0 -r 2 -o json >"$R/decode48-$v.json" 2>"$R/decode48-$v.err"
    el "48-layer tg64 $v: $(python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(round(r['decode_tokens_per_s'], 1), '+-', round(r['decode_tokens_per_s_sd'] or 0, 1), r['decode_sha256'][:12])
" "$R/decode48-$v.json" 2>&1)"
done
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin:${LD_LIBRARY_PATH:-}
timeout 120 /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 0 -n 64 -r 2 -o md \
    >"$R/llama-decode.md" 2>&1
el "llama-bench tg64 -ncmoe 0: $(grep tg64 "$R/llama-decode.md" | awk -F'|' '{print $(NF-1)}')"
timeout 60 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K --paths direct >"$R/gemv.txt" 2>&1
el "gemv (type tensor pairs kernel ms MB GB/s): $(grep ' gemv ' "$R/gemv.txt" | grep -v dense | tr -s ' ' | sed 's/^ //' | cut -d' ' -f1-7 | tr '\n' ';')"
profiles 2
