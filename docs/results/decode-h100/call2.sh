#!/usr/bin/env bash
# gemv variants A/B/C, kernel tests, 8-layer decode profile, 48-layer decode beside llama-bench.
# .dev/gemv_old.cu is `git show 56ecbca:expertstream/kernels/gemv.cu` and .dev/decode_old.cu `git show 56ecbca:expertstream/kernels/decode.cu`
# (the kernels before this round); .dev/ also held the gguf wheel and llama.cpp's sm_90 archive.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S=$OUT/summary.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee $S
M=/tmp/m8.gguf
(mkdir -p /tmp/mh; OUT=/tmp/mh bash microbench/model_h200.sh setup make > $OUT/make.log 2>&1; python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M >> $OUT/make.log 2>&1) &
maker=$!
for v in A B; do
  mkdir -p /tmp/v$v && cp -r expertstream microbench /tmp/v$v/ && cp .dev/gemv_old.cu /tmp/v$v/expertstream/kernels/gemv.cu
done
cp .dev/decode_old.cu /tmp/vA/expertstream/kernels/decode.cu
for v in A B C; do
  d=/tmp/v$v; [ $v = C ] && d=$PWD
  echo "gemv variant $v" | tee -a $S
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 60 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K 2>&1 | grep -E " gemv ") | tee -a $S
done
el "variants done" | tee -a $S
timeout 200 python3 -m pytest -q tests/kernels/test_gemv.py tests/kernels/test_router.py tests/kernels/test_dense.py tests/kernels/test_direct.py \
  --backend cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
el "tests: $(tail -1 $OUT/tests.txt)" | tee -a $S
grep -E "FAILED|Error" $OUT/tests.txt | head -10 | tee -a $S
wait $maker; el "make: $(grep make-model $OUT/make.log | tail -2 | tr '\n' ' ')" | tee -a $S
timeout 60 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 16 -ncmoe 0 > $OUT/profile.txt 2>&1
el "$(grep -E 'replayed' $OUT/profile.txt | head -2)" | tee -a $S
OUT=/tmp/mh REPS=2 DECODE_STEPS=64 timeout 280 bash microbench/model_h200.sh decode > /tmp/mh/decode.log 2>&1
el "decode done" | tee -a $S
grep -E "tg|decode" /tmp/mh/decode.log | grep -vE "^\| model|---" | tail -14 | tee -a $S
cat /tmp/mh/memory.txt 2>/dev/null | tee -a $S
tar czf $OUT/mh.tgz -C /tmp mh
