#!/usr/bin/env bash
# gemv variants (decoders' conversions, rows per wave, block size), CUDA gemv tests, 8-layer step old/new, 48-layer decode beside llama-bench.
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
variant() {  # name threads wave_rows min_blocks old_gemv old_decode
  local d=/tmp/v$1; mkdir -p $d; cp -r expertstream microbench $d/
  if [ $5 = 1 ]; then cp .dev/gemv_v1.cu $d/expertstream/kernels/gemv.cu; git show HEAD:expertstream/kernels/layout.py > $d/expertstream/kernels/layout.py; fi
  if [ $6 = 1 ]; then cp .dev/decode_v1.cu $d/expertstream/kernels/decode.cu; fi
  if [ $5 = 0 ]; then
    sed -i "s/^#define MOE_GEMV_THREADS 128/#define MOE_GEMV_THREADS $2/; s/^#define MOE_GEMV_WAVE_ROWS 2 /#define MOE_GEMV_WAVE_ROWS $3 /" $d/expertstream/kernels/gemv.cu
    sed -i "s/^GEMV_THREADS = 128 /GEMV_THREADS = $2 /; s/^GEMV_WAVE_ROWS = 2 /GEMV_WAVE_ROWS = $3 /" $d/expertstream/kernels/layout.py
    [ $4 != 0 ] && sed -i "s/__launch_bounds__(MOE_GEMV_THREADS)/__launch_bounds__(MOE_GEMV_THREADS, $4)/" $d/expertstream/kernels/gemv.cu
  fi
  echo "gemv variant $1: threads $2 rows/wave $3 minblocks $4 old-gemv $5 old-decode $6" | tee -a $S
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 60 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K 2>&1 | grep -E " gemv ") | tee -a $S
}
variant A 256 1 0 1 1
variant B 256 1 0 1 0
variant C 128 2 0 0 0
variant D 256 1 0 0 0
variant E 128 4 0 0 0
variant F 128 2 4 0 0
variant G 256 2 0 0 0
variant H 64 2 0 0 0
el "variants done" | tee -a $S
timeout 120 python3 -m pytest -q tests/kernels/test_gemv.py --backend cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
el "tests: $(tail -1 $OUT/tests.txt)" | tee -a $S
grep -E "FAILED|Error" $OUT/tests.txt | head -10 | tee -a $S
wait $maker; el "make: $(grep -c make-model $OUT/make.log)" | tee -a $S
for v in A C E; do
  (cd /tmp/v$v && PYTHONPATH=/tmp/site:/tmp/v$v timeout 60 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 16 -ncmoe 0 > $OUT/profile-$v.txt 2>&1)
  el "variant $v: $(grep -E 'replayed' $OUT/profile-$v.txt | tail -1)" | tee -a $S
done
OUT=/tmp/mh REPS=2 DECODE_STEPS=64 timeout 240 bash microbench/model_h200.sh decode > /tmp/mh/decode.log 2>&1
el "decode done" | tee -a $S
grep -E "tg|decode" /tmp/mh/decode.log | grep -vE "^\| model|---" | tail -14 | tee -a $S
tar czf $OUT/mh.tgz -C /tmp mh --exclude='*.gguf' --exclude='models' 2>/dev/null
el done | tee -a $S
