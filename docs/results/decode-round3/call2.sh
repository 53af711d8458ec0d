#!/usr/bin/env bash
# gemv: fused gate_up + Q6_K word loads (N), no staging (S), 256 threads (W); 8-layer step base/prev/N/S;
# CUDA gemv tests; 48-layer decode, pp4096 ub512 and layer-major pp32768 beside llama-bench.
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
for t in base prev; do mkdir -p /tmp/$t && tar xf .dev/$t.tar -C /tmp/$t; done
for v in N S W; do mkdir -p /tmp/v$v && cp -r expertstream microbench /tmp/v$v/; done
sed -i "s/^#define MOE_GEMV_STAGE 4096 /#define MOE_GEMV_STAGE 32 /" /tmp/vS/expertstream/kernels/gemv.cu
sed -i "s/^#define MOE_GEMV_THREADS 128/#define MOE_GEMV_THREADS 256/" /tmp/vW/expertstream/kernels/gemv.cu
sed -i "s/^GEMV_THREADS = 128 /GEMV_THREADS = 256 /" /tmp/vW/expertstream/kernels/layout.py
for v in base prev vN vS vW; do
  echo "gemv $v" | tee -a $S
  (cd /tmp/$v && PYTHONPATH=/tmp/site:/tmp/$v timeout 60 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K 2>&1 | grep -E " gemv ") | tee -a $S
done
el "variants done" | tee -a $S
wait $maker; el "make: $(grep -c make-model $OUT/make.log)" | tee -a $S
for v in base prev vN vS vW; do
  (cd /tmp/$v && PYTHONPATH=/tmp/site:/tmp/$v timeout 60 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 16 -ncmoe 0 > $OUT/profile-$v.txt 2>&1)
  el "$v: $(grep -E 'one decode step' $OUT/profile-$v.txt | tail -1)" | tee -a $S
done
OUT=/tmp/mh REPS=2 DECODE_STEPS=64 timeout 200 bash microbench/model_h200.sh decode > /tmp/mh/decode.log 2>&1
el "decode done" | tee -a $S
grep -E "tg|decode" /tmp/mh/decode.log | grep -vE "^\| model|---" | tail -14 | tee -a $S
OUT=/tmp/mh TAG=-pp32768 PREFILL_ORDER=layer TOKENS=32768 UBATCH=4096 REPS=1 timeout 150 bash microbench/model_h200.sh bench > /tmp/mh/pp32768.log 2>&1
el "pp32768 done" | tee -a $S
grep -E "pp32768|tg64|prompt|pp " /tmp/mh/pp32768.log | grep -vE "^\| model|---" | tail -10 | tee -a $S
timeout 100 python3 -m pytest -q tests/kernels/test_gemv.py -k "Q4_K or Q6_K or Q8_0 or Q4_0 or MXFP4 or gate_up or silu" --backend cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
el "tests: $(tail -1 $OUT/tests.txt)" | tee -a $S
grep -E "FAILED|Error" $OUT/tests.txt | head -10 | tee -a $S
tar czf $OUT/mh.tgz -C /tmp mh 2>/dev/null
el done | tee -a $S
