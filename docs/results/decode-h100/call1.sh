#!/usr/bin/env bash
# Q6_K direct kernels verified on the GPU; the current decode step profiled per kernel (8-layer file).
# .dev/gemv_old.cu is `git show 56ecbca:expertstream/kernels/gemv.cu` and .dev/decode_old.cu `git show 56ecbca:expertstream/kernels/decode.cu`
# (the kernels before this round); .dev/ also held the gguf wheel and llama.cpp's sm_90 archive.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
S=$OUT/summary.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; git log -1 --format=%H; } | tee $S
M=/tmp/m8.gguf
(python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M > $OUT/make.log 2>&1) &
maker=$!
timeout 150 python3 -m pytest -q -x tests/kernels/test_direct.py tests/kernels/test_mul_mat_id.py tests/kernels/test_gemv.py tests/kernels/test_router.py tests/kernels/test_router_arch.py tests/kernels/test_dense.py tests/engine/test_model.py \
  --backend cuda -p no:cacheprovider > $OUT/tests.txt 2>&1
el "tests: $(tail -1 $OUT/tests.txt)" | tee -a $S
timeout 90 python3 -m microbench.kernels --backend cuda --types Q6_K Q4_K --ubatch 512 4096 --paths mma direct 2>&1 | tail -14 | tee -a $S
echo "gemv, this commit:" | tee -a $S
timeout 60 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K 2>&1 | grep -E "gemv|GB/s|copy" | tee -a $S
mkdir -p /tmp/old && cp -r expertstream microbench /tmp/old/ && cp .dev/gemv_old.cu /tmp/old/expertstream/kernels/gemv.cu
echo "gemv, the commit before:" | tee -a $S
(cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout 60 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K 2>&1 | grep -E "gemv|GB/s|copy") | tee -a $S
wait $maker; el "make: $(tail -1 $OUT/make.log)" | tee -a $S
timeout 90 python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 24 -ncmoe 0 > $OUT/profile.txt 2>&1
el "profile: $(grep -i 'replayed' $OUT/profile.txt | head -2)" | tee -a $S
timeout 150 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
  python3 -m microbench.decode_profile --backend cuda --model $M -p 512 -n 6 --profiler-range -ncmoe 0 > $OUT/ncu.csv 2>$OUT/ncu.err
python3 - $OUT/ncu.csv <<'PY' | tee -a $S
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value"); ui = h.index("Metric Unit")
t = collections.defaultdict(list)
for r in rows[1:]:
    v = float(r[vi].replace(",", "")); v = v / 1000 if r[ui] == "nsecond" else v
    t[r[ki].split("(")[0]].append(v)
tot = sum(sum(v) for v in t.values()); print(f"kernels {sum(len(v) for v in t.values())}, sum {tot:.1f} us")
for k, v in sorted(t.items(), key=lambda kv: -sum(kv[1])):
    print(f"{k:42s} {len(v):4d} {sum(v):9.1f} us {sum(v)/len(v):8.2f} us each")
PY
el done | tee -a $S
