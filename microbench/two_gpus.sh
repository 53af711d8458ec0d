#!/usr/bin/env bash
# Two GPUs: links, peer copies, a layer split's outputs, and prefill on one GPU vs two.
# Results: docs/results/prefill-2xh200.md.
#
# usage: microbench/two_gpus.sh STAGE...     stages: topo links outputs make prefill
#   topo     how the GPUs are linked (nvidia-smi topo -m)
#   links    H2D of each GPU alone and both at once, peer and via-host copies
#   outputs  a LAYERS_CHECK-layer file on GPU 0, then split over GPUs 0 and 1: prefill and DECODE
#            decode steps must give one hash for every slot setting and host memory mode
#   make     write the full file (qwen3-30b-a3b shapes, $TYPE) into $MODELS
#   prefill  `expertstream bench` on it: GPU 0 alone, then GPUs 0,1; slots 0 and 3 at $UBATCH
# Environment: MODELS (/tmp/models), OUT (.), TYPE (Q4_K_M), TOKENS (8192), UBATCH (512,2048,4096),
# REPS (2), DECODE (1000), LAYERS_CHECK (2), HOST (registered), BACKEND (cuda).
set -euo pipefail
MODELS=${MODELS:-/tmp/models}
OUT=${OUT:-.}
TYPE=${TYPE:-Q4_K_M}
TOKENS=${TOKENS:-8192}
UBATCH=${UBATCH:-512,2048,4096}
REPS=${REPS:-2}
DECODE=${DECODE:-1000}
LAYERS_CHECK=${LAYERS_CHECK:-2}
HOST=${HOST:-registered}
BACKEND=${BACKEND:-cuda}
python=${PYTHON:-python3}
full="$MODELS/qwen3-30b-a3b-$TYPE.gguf"
check="$MODELS/qwen3-30b-a3b-$TYPE-${LAYERS_CHECK}L.gguf"

for stage in "$@"; do
    case $stage in
    topo)
        nvidia-smi topo -m | tee "$OUT/topo.txt" ;;
    links)
        "$python" -m microbench.two_gpus --backend "$BACKEND" --out "$OUT/links.json" | tee "$OUT/links.txt" ;;
    outputs)
        mkdir -p "$MODELS"
        [[ -f $check ]] || "$python" -m expertstream make-model --preset qwen3-30b-a3b --type "$TYPE" \
            --layers "$LAYERS_CHECK" -o "$check" >/dev/null
        "$python" -m microbench.two_gpus --backend "$BACKEND" --mb 64 --repeats 2 --model "$check" \
            --tokens 2048 --ubatch 512 --decode "$DECODE" --host-memory registered,pinned,ring,mmap --slots 0,2,3 \
            --out "$OUT/outputs.json" 2>"$OUT/outputs.log" | tee "$OUT/outputs.txt" ;;
    make)
        mkdir -p "$MODELS"
        [[ -f $full ]] || "$python" -m expertstream make-model --preset qwen3-30b-a3b --type "$TYPE" -o "$full" \
            | tail -1 ;;
    prefill)
        for devices in 0 0,1; do
            "$python" -m expertstream bench -m "$full" --backend "$BACKEND" --device "$devices" -p "$TOKENS" \
                -ub "$UBATCH" --slots 0,3 --host-memory "$HOST" -r "$REPS" -o json >"$OUT/prefill-$devices.json"
            "$python" - "$OUT/prefill-$devices.json" <<'EOF' | tee "$OUT/prefill-$devices.txt"
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc["rows"]:
    print(f"{doc['device']}: {r['host_memory']:>10} slots {r['slots']} ub {r['ubatch']:>4}: "
          f"{r['prefill_tokens_per_s']:8.0f} t/s  {r['h2d_gbps']:6.1f} GB/s ({r['h2d_pct_of_peak']:5.1f}% of "
          f"{r['h2d_peak_gbps']:.1f})  compute only {r['compute_only_s']:.3f} s  {r['crossing'] or '-'}  "
          f"{r['output_sha256'][:12]}")
EOF
        done ;;
    *)
        echo "unknown stage $stage (topo links outputs make prefill)" >&2
        exit 2 ;;
    esac
done
