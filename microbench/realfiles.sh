#!/usr/bin/env bash
# Prefill on llama.cpp-loadable files of real models' shapes and mixes, expertstream beside
# llama.cpp's llama-bench on the same files and GPU. Results: docs/results/realfiles-h200.md.
#
# usage: microbench/realfiles.sh STAGE...      stages, in order: build make llama ours (or check)
#   build  build llama-bench from $PEERS/llama.cpp.tgz (shared/peers/llamacpp/build.sh)
#   make   write the files into $MODELS with `expertstream make-model`
#   llama  llama-bench on each file: experts of all / half the layers in pinned host memory
#          (-lm none) at ubatch 512, 2048, 4096; mmap at 4096
#   ours   `expertstream bench` on each file: slots 0 and 3, registered and mmap, same ubatches,
#          all layers streamed and half (-ncmoe)
#   check  a shorter `expertstream bench` on each file (registered, ubatch 512 and 4096, one run per
#          row) whose outputs must hash as the committed rows of docs/results/realfiles-h200/ do:
#          a change that means to compute the same thing proves it here (exit 1 when they differ)
# Environment: PEERS (.peers), MODELS (/tmp/models), OUT (.), TOKENS (4096), LAYERS (all),
# REPS (2), FILES ("qwen3-30b-a3b:Q4_K_M gpt-oss-20b:MXFP4_MOE"), BACKEND (auto).
set -euo pipefail
PEERS=${PEERS:-.peers}
MODELS=${MODELS:-/tmp/models}
OUT=${OUT:-.}
TOKENS=${TOKENS:-4096}
REPS=${REPS:-2}
FILES=${FILES:-"qwen3-30b-a3b:Q4_K_M gpt-oss-20b:MXFP4_MOE"}
BACKEND=${BACKEND:-auto}
UBATCH=${UBATCH:-512,2048,4096}
python=${PYTHON:-python3}

file_of() { echo "$MODELS/$1-$2.gguf"; }
moe_layers() { "$python" -c "from expertstream.model import MoeModel; print(len(MoeModel.open('$1').layers))"; }

for stage in "$@"; do
    case $stage in
    build)
        bash "$PEERS/build.sh" "$PEERS" ;;
    make)
        mkdir -p "$MODELS"
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            layers=()
            [[ -n ${LAYERS:-} ]] && layers=(--layers "$LAYERS")
            "$python" -m expertstream make-model --preset "$preset" --type "$qtype" "${layers[@]}" \
                -o "$(file_of "$preset" "$qtype")" | tee "$OUT/make-$preset.txt"
        done ;;
    llama)
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            file=$(file_of "$preset" "$qtype")
            n=$(moe_layers "$file")
            "$PEERS/build/bin/llama-bench" -m "$file" -ngl 99 -ncmoe "$n,$((n / 2))" -lm none -fa 0 \
                -p "$TOKENS" -n 0 -b "$TOKENS" -ub "$UBATCH" -r "$REPS" -o md | tee "$OUT/llama-$preset.md"
            "$PEERS/build/bin/llama-bench" -m "$file" -ngl 99 -ncmoe "$n" -lm mmap -fa 0 \
                -p "$TOKENS" -n 0 -b "$TOKENS" -ub "$TOKENS" -r "$REPS" -o md | tee "$OUT/llama-$preset-mmap.md"
        done ;;
    ours)
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            file=$(file_of "$preset" "$qtype")
            n=$(moe_layers "$file")
            "$python" -m expertstream bench -m "$file" --backend "$BACKEND" -p "$TOKENS" -ub "$UBATCH" \
                --slots 0,3 --host-memory registered,mmap -ncmoe "all,$((n / 2))" -r "$REPS" \
                -o json >"$OUT/ours-$preset.json"
            "$python" -c "
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc['rows']:
    print(f\"{r['host_memory']:>10} slots {r['slots']} ub {r['ubatch']:>4} streamed {r['layers_streamed']:>2}: \"
          f\"{r['prefill_tokens_per_s']:8.0f} t/s  {r['h2d_gbps']:5.1f} GB/s  {r['output_sha256'][:12]}\")
" "$OUT/ours-$preset.json" | tee "$OUT/ours-$preset.txt"
        done ;;
    check)
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            file=$(file_of "$preset" "$qtype")
            n=$(moe_layers "$file")
            "$python" -m expertstream bench -m "$file" --backend "$BACKEND" -p "$TOKENS" -ub 512,4096 \
                --slots 0,3 --host-memory registered -ncmoe "all,$((n / 2))" -r 1 -o json >"$OUT/check-$preset.json"
            "$python" -c "
import json, sys
now, then = (json.load(open(path)) for path in sys.argv[1:])
want = {r['output_sha256'] for r in then['rows']}
got = {r['output_sha256'] for r in now['rows']}
print(f'{sys.argv[1]}: {len(now[\"rows\"])} rows hash {sorted(h[:16] for h in got)}; committed {sorted(h[:16] for h in want)}')
sys.exit(0 if got == want else 1)
" "$OUT/check-$preset.json" "docs/results/realfiles-h200/ours-$preset.json" | tee "$OUT/check-$preset.txt"
        done ;;
    *)
        echo "unknown stage $stage (build, make, llama, ours, check)" >&2
        exit 2 ;;
    esac
done
