#!/usr/bin/env bash
# Decode round 5's defaults on the 48-layer file beside the round's start and llama.cpp, in one call:
#
#   BASE=DIR OUT=DIR bash docs/results/decode-round5/final.sh    (from the repository root)
#
# tg64 with everything on the GPU: this tree as it stands (its defaults), then the tree at $BASE (left
# out: skipped), then llama-bench -ncmoe 0 -n 64. Needs what microbench/model_h200.sh needs (its setup
# and make stages run first); then the 8-layer step of this tree with each launch timed alone. Appends to
# $OUT/summary.txt, writes raw/final-*.
set -uo pipefail
source microbench/summary.sh
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf LCP=/tmp/llamacpp-sm90
OUT=/tmp/mh bash microbench/model_h200.sh setup make >"$R/final-make.log" 2>&1
tg64() {  # NAME DIR: expertstream bench tg64 from DIR
    (cd "$2" && PYTHONPATH="$2:${PYTHONPATH:-}" timeout 120 python3 -m expertstream bench -m $F --backend cuda -p 16 \
        -n 64 --slots 3 --host-memory pinned -ncmoe 0 -r 3 -o json) >"$R/final-$1.json" 2>"$R/final-$1.err"
    el "48-layer tg64 $1: $(python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(round(r['decode_tokens_per_s'], 1), '+-', round(r['decode_tokens_per_s_sd'] or 0, 1), 'median step',
          round(r['decode_median_step_ms'], 3), 'ms', r['decode_sha256'][:12])
" "$R/final-$1.json" 2>&1)"
}
tg64 head "$PWD"
[ -n "${BASE:-}" ] && tg64 base "$BASE"
export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
timeout 120 $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 0 -n 64 -r 3 -o md >"$R/final-llama.md" 2>&1
el "llama-bench tg64 -ncmoe 0: $(grep tg64 "$R/final-llama.md" | awk -F'|' '{print $(NF-1)}')"
# the 8-layer step of this tree, each launch also timed alone (decode_profile --alone)
M=/tmp/m8.gguf
[ -f $M ] || timeout 60 python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M \
    >>"$R/final-make.log" 2>&1
timeout 60 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 40 -ncmoe 0 --alone \
    >"$R/final-profile-head.txt" 2>&1
el "8-layer step head: $(grep -E 'one decode step' "$R/final-profile-head.txt" | tail -1)"
