# Call B1: the matrix-vector kernels' variants timed by a standalone harness (graphs of 64 launches,
# plain and chained), the CUDA tests of gemv and dense with the shared-memory rows, and tg64 all on the
# GPU with the tree's gemv.cu against the one before.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; T=$PWD; export PYTHONPATH=/tmp/site:$T
M=/tmp/m/b1; mkdir -p $M /tmp/h
pack() { tar cf $OUT/all.tar -C /tmp/m b1; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
vs=$(python3 $D/gen_variants.py /tmp/h $D/gemv_harness.cu $D/gemv_old.cu)
for v in $vs; do ( nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/h/$v /tmp/h/h_$v.cu > /tmp/h/$v.log 2>&1 || cp /tmp/h/$v.log $M/ ) & done; wait_nvcc() { for v in $vs; do while [ ! -e /tmp/h/$v ] && [ ! -e $M/$v.log ]; do sleep 1; done; done; }
wait_nvcc; stamp compiled
for mode in - pdl; do for v in $vs; do timeout 60 /tmp/h/$v $v $mode >> $M/harness.txt 2>&1; done; done; stamp harness
timeout $(left 200) python3 -m pytest -q -x -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py tests/kernels/test_dense.py > $M/pytest.txt 2>&1; tail -3 $M/pytest.txt > $M/pytest-tail.txt; stamp pytest
wait; stamp make
mkdir -p /tmp/old && cp -r $T/expertstream /tmp/old/ && cp $D/gemv_old.cu /tmp/old/expertstream/kernels/gemv.cu
for tree in new old; do
  P=$T; [ $tree = old ] && P=/tmp/old:$T
  PYTHONPATH=/tmp/site:$P timeout $(left 420) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe 0 -r 3 -o json > $M/tg64-$tree.json 2> $M/tg64-$tree.err
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('tg64 all-GPU', sys.argv[2], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/tg64-$tree.json $tree 2>&1 | tee -a $M/summary.txt; stamp "tg64 $tree"
done
PYTHONPATH=/tmp/site:$T timeout $(left 560) python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv.txt 2>&1; stamp gemv
cat $M/times.txt; grep -E "gate\+up|copy" $M/gemv.txt; cat $M/pytest-tail.txt $M/summary.txt; sort -k3,3 -k2,2 -s $M/harness.txt | awk '{print $1,$2,$3,$4,$5,$6,$10,$11,$13}' | column -t
