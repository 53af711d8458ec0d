#!/usr/bin/env bash
# One call: CUDA tests of the changed kernels, decode and prefill beside llama-bench on the 48-layer file.
# Needs the gguf wheel (and llama.cpp's sm_90 archive, microbench/model_h200.sh setup) under .dev/, which the call carried.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee $OUT/machine.txt
(bash microbench/model_h200.sh setup make > $OUT/make.log 2>&1) &
maker=$!
timeout 150 python3 -m pytest -q -x tests/kernels/test_router.py tests/kernels/test_router_arch.py tests/kernels/test_gemv.py \
  tests/kernels/test_dense.py tests/kernels/test_attention.py tests/kernels/test_direct.py tests/engine/test_model.py \
  tests/engine/test_against_llamacpp.py --backend cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
el "tests: $(tail -1 $OUT/tests.txt)"
wait $maker; el "setup+make: $(tail -1 $OUT/make.log)"
REPS=2 timeout 200 bash microbench/model_h200.sh decode > $OUT/decode.log 2>&1
el "decode done"; grep -E "^\| qwen|tg" $OUT/decode.log | grep -v "^| model" | tail -14
REPS=2 timeout 220 bash microbench/model_h200.sh bench > $OUT/bench.log 2>&1
el "bench done"; grep -E "pp +[0-9]|^\| qwen" $OUT/bench.log | tail -14
cat $OUT/memory.txt 2>/dev/null
