#!/usr/bin/env bash
# 8-layer step: staged always (N) / never (S) / up to 4096 blocks (H, the commit), alternated 3x;
# 48-layer decode beside llama-bench (H) and ours-only for N and S; pp4096 ub512; CUDA tests of gemv and the model.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S=$OUT/summary.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; git log -1 --format=%h; } | tee $S
M=/tmp/m8.gguf
mkdir -p /tmp/mh
(OUT=/tmp/mh bash microbench/model_h200.sh setup make > $OUT/make.log 2>&1; python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M >> $OUT/make.log 2>&1) &
maker=$!
for v in N S H; do mkdir -p /tmp/v$v && cp -r expertstream microbench /tmp/v$v/; done
sed -i "s/^#define MOE_GEMV_STAGE_BLOCKS 4096 /#define MOE_GEMV_STAGE_BLOCKS 1000000000 /" /tmp/vN/expertstream/kernels/gemv.cu
sed -i "s/^#define MOE_GEMV_STAGE_BLOCKS 4096 /#define MOE_GEMV_STAGE_BLOCKS 0 /" /tmp/vS/expertstream/kernels/gemv.cu
timeout 100 python3 -m pytest -q tests/kernels/test_gemv.py -k "Q4_K or Q6_K or Q8_0 or Q4_0 or gate_up or silu or dense" --backend cuda -p no:cacheprovider > $OUT/tests-gemv.txt 2>&1
el "gemv tests: $(tail -1 $OUT/tests-gemv.txt)" | tee -a $S
wait $maker; el "make: $(grep -c make-model $OUT/make.log)" | tee -a $S
for round in 1 2 3; do for v in N S H; do
  (cd /tmp/v$v && PYTHONPATH=/tmp/site:/tmp/v$v timeout 60 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 16 -ncmoe 0 > $OUT/profile-$v-$round.txt 2>&1)
  el "$v $round: $(grep -E 'one decode step' $OUT/profile-$v-$round.txt | tail -1)" | tee -a $S
done; done
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
for v in N S; do
  (cd /tmp/v$v && PYTHONPATH=/tmp/site:/tmp/v$v timeout 90 python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe 0 -r 2 -o json > $OUT/decode48-$v.json 2>$OUT/decode48-$v.err)
  el "48-layer decode $v: $(python3 -c "import json,sys; [print(r.get('decode_tokens_per_s'), r.get('decode_tokens_per_s_sd')) for r in json.load(open(sys.argv[1]))['rows']]" $OUT/decode48-$v.json 2>&1 | tr '\n' ' ')" | tee -a $S
done
OUT=/tmp/mh REPS=2 DECODE_STEPS=64 timeout 150 bash microbench/model_h200.sh decode > /tmp/mh/decode.log 2>&1
el "decode done" | tee -a $S
grep -E "tg|decode" /tmp/mh/decode.log | grep -vE "^\| model|---" | tail -8 | tee -a $S
OUT=/tmp/mh REPS=2 UBATCH=512 timeout 150 bash microbench/model_h200.sh bench > /tmp/mh/ub512.log 2>&1
el "ub512 done" | tee -a $S
grep -E "pp4096|tg64|pp " /tmp/mh/ub512.log | grep -vE "^\| model|---" | tail -8 | tee -a $S
tar czf $OUT/mh.tgz -C /tmp mh 2>/dev/null
el done | tee -a $S
