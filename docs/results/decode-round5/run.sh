#!/usr/bin/env bash
# Decode round 5 on one GPU: this tree's decode step beside a base tree and llama.cpp, with ncu's
# counters for one step of each tool.
#
#   BASE=DIR OUT=DIR bash docs/results/decode-round5/run.sh    (from the repository root)
#
# BASE: a checkout of an earlier commit, for the "base" rows; left out, they are skipped. Needs what
# microbench/model_h200.sh needs (its setup and make stages run first). Writes under $OUT: summary.txt
# (the table) and raw/ (every command's output). In order of worth, so a call cut short keeps the first:
#   1. the 8-layer step (decode_profile --alone) of this tree (head), base and the variants;
#   2. 48-layer tg64 all on the GPU: head, head with chained launches (c1), base, d1, llama-bench;
#   3. ncu (--clock-control none) over one replayed 8-layer decode step of head, and over one token of
#      llama-bench's tg on the same file: each kernel's time, DRAM throughput, occupancy, registers;
#   4. the experts' matrix-vector kernels alone (microbench.kernels --gemv);
#   5. the 8-layer step again, if fewer than ROUND2_BEFORE seconds (420) have gone.
# VARIANTS (default "head d1 base") picks the trees, d1 being this tree with the matrix-vector kernels'
# and the router's loads as deep as at the round's start (defines_of below); stages 1, 4 and 5 also time
# a32, w4 and m4. NCU=0 skips stage 3.
set -uo pipefail
source microbench/summary.sh
mkdir -p /tmp/mh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee "$S"
M=/tmp/m8.gguf F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf LCP=/tmp/llamacpp-sm90
(OUT=/tmp/mh bash microbench/model_h200.sh setup >"$R/make.log" 2>&1
 [ -f $M ] || python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M >>"$R/make.log" 2>&1
 OUT=/tmp/mh bash microbench/model_h200.sh make >>"$R/make.log" 2>&1) &
maker=$!
defines_of() {  # VARIANT: the kernel constants it changes (with_defines.py), none for head, c1 and base
    case $1 in
    d1) echo "MOE_GEMV_DEPTH=1 LOGITS_DEPTH=4" ;;  # the loads in flight of the round's start
    w4) echo "MOE_GEMV_WAVE_ROWS=4 MOE_GEMV_DEPTH=1 expertstream.kernels.layout.GEMV_ROWS=16" ;;  # 4 rows a wave
    a32) echo "ATTN_DECODE_CHUNK=32 expertstream.kernels.attention.DECODE_CHUNK=32" ;;  # 32-key decode chunks
    m4) echo "MOE_GEMV_MIN_BLOCKS=4" ;;  # registers bounded so that 4 blocks fit a multiprocessor
    esac
}
in_tree() {  # VARIANT SECONDS MODULE ARGS...: python3 -m MODULE ARGS in a variant, SECONDS at most
    # head: this tree; c1: chained launches on; base: the tree at $BASE; others: defines_of
    local v=$1 t=$2; shift 2
    case $v in
    head) EXPERTSTREAM_CHAINED_LAUNCHES=0 timeout "$t" python3 -m "$@" ;;
    c1) EXPERTSTREAM_CHAINED_LAUNCHES=1 timeout "$t" python3 -m "$@" ;;
    base) (cd "$BASE" && PYTHONPATH="$BASE:${PYTHONPATH:-}" timeout "$t" python3 -m "$@") ;;
    *) timeout "$t" python3 docs/results/decode-round5/with_defines.py $(defines_of $v) -- -m "$@" ;;
    esac
}
variants=${VARIANTS:-head d1 base}
[ -z "${BASE:-}" ] && variants=${variants//base/}
until [ -f $M ] && ! pgrep -f "make-model.*m8.gguf" >/dev/null; do sleep 2; done
profiles() {  # ROUND: the 8-layer step of every variant (and a32, w4, m4)
    for v in $variants a32 w4 m4; do
        in_tree $v 120 microbench.decode_profile --backend cuda --model $M -p 512 -n 12 \
            --top 40 -ncmoe 0 --alone >"$R/profile-$v-$1.txt" 2>&1
        el "8-layer step $v round $1: $(grep -E 'one decode step' "$R/profile-$v-$1.txt" | tail -1)"
    done
}
profiles 1
wait $maker
el "models: $(ls -la $F 2>&1 | awk '{print $5}') bytes"
for v in ${variants/head/head c1}; do
    in_tree $v 120 expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 \
        --host-memory pinned -ncmoe 0 -r 3 -o json >"$R/decode48-$v.json" 2>"$R/decode48-$v.err"
    el "48-layer tg64 $v: $(python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(round(r['decode_tokens_per_s'], 1), '+-', round(r['decode_tokens_per_s_sd'] or 0, 1), r['decode_sha256'][:12])
" "$R/decode48-$v.json" 2>&1)"
done
export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
timeout 120 $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 0 -n 64 -r 3 -o md \
    >"$R/llama-decode.md" 2>&1
el "llama-bench tg64 -ncmoe 0: $(grep tg64 "$R/llama-decode.md" | awk -F'|' '{print $(NF-1)}')"
NCU_CMD="ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
    timeout 150 $NCU_CMD --profile-from-start off -f -o "$R/ncu-head" python3 -m microbench.decode_profile --backend cuda \
        --model $M -p 512 -n 4 -ncmoe 0 --profiler-range >"$R/ncu-head.log" 2>&1
    ncu -i "$R/ncu-head.ncu-rep" --csv --page raw >"$R/ncu-head.csv" 2>>"$R/ncu-head.log"
    el "ncu head: $(python3 -m microbench.ncu_table "$R/ncu-head.csv" --summary 2>&1 | tail -1)"
    export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
    timeout 150 $NCU_CMD --launch-skip 400 --launch-count 140 -f -o "$R/ncu-llama" $LCP/bin/llama-bench -m $M -ngl 99 \
        -ncmoe 0 -lm none -fa 0 -p 0 -n 8 -r 1 >"$R/ncu-llama.log" 2>&1
    ncu -i "$R/ncu-llama.ncu-rep" --csv --page raw >"$R/ncu-llama.csv" 2>>"$R/ncu-llama.log"
    el "ncu llama.cpp: $(python3 -m microbench.ncu_table "$R/ncu-llama.csv" --summary 2>&1 | tail -1)"
fi
for v in ${variants/base/} w4 m4; do
    in_tree $v 60 microbench.kernels --backend cuda --gemv --types Q4_K Q6_K --paths direct >"$R/gemv-$v.txt" 2>&1
    el "gemv $v (type tensor pairs kernel ms MB GB/s): $(grep ' gemv ' "$R/gemv-$v.txt" | grep -v dense | tr -s ' ' | sed 's/^ //' | cut -d' ' -f1-7 | tr '\n' ';')"
done
[ $(($(date +%s) - T0)) -lt ${ROUND2_BEFORE:-420} ] && profiles 2
