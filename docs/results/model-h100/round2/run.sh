#!/usr/bin/env bash
# Final code: gemv bench; pp4096 at ubatch 4096 beside llama-bench (Q6_K direct kernels); 48-layer decode beside llama-bench.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S=$OUT/summary.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee $S
mkdir -p /tmp/mh
(OUT=/tmp/mh bash microbench/model_h200.sh setup make > $OUT/make.log 2>&1) &
maker=$!
timeout 40 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K 2>&1 | grep -E " gemv " | tee -a $S
wait $maker; el "make: $(grep make-model $OUT/make.log | tail -1)" | tee -a $S
OUT=/tmp/mh REPS=2 UBATCH=4096 timeout 200 bash microbench/model_h200.sh bench > /tmp/mh/bench.log 2>&1
el "bench done" | tee -a $S
grep -E "pp4096|ub 4096" /tmp/mh/bench.log | tail -6 | tee -a $S
tar czf $OUT/mh.tgz -C /tmp mh
OUT=/tmp/mh REPS=2 DECODE_STEPS=64 timeout 150 bash microbench/model_h200.sh decode > /tmp/mh/decode.log 2>&1
el "decode done" | tee -a $S
grep -E "tg64" /tmp/mh/decode.log | tail -6 | tee -a $S
cat /tmp/mh/memory.txt | tee -a $S
tar czf $OUT/mh.tgz -C /tmp mh
