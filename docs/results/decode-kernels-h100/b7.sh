# Call B7: the 256-thread matrix-vector blocks (tree_new, 0995588) against the tree before (tree_base,
# c7779e2): the harness and the project's microbench for both; tg64 with everything on the GPU, two rounds
# each in turn as the call's time allows; the CUDA tests of gemv while the file is made.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; M=/tmp/m/b7; mkdir -p $M /tmp/h7; pack() { tar cf $OUT/all.tar -C /tmp/m b7; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
cat $D/tree_new.txt $D/tree_base.txt > $M/tree.txt
for v in base new; do mkdir -p /tmp/t_$v && tar xzf $D/tree_$v.tgz -C /tmp/t_$v; done
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( cd /tmp/t_new && PYTHONPATH=/tmp/site:/tmp/t_new python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
MAKE=$!
( cd /tmp/t_new && PYTHONPATH=/tmp/site:/tmp/t_new python3 $D/gen_variants.py /tmp/h7 $D/gemv_harness.cu $D/gemv_old.cu $D/gemv_new.cu ) > /dev/null
( for v in base new; do nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/h7/$v /tmp/h7/h_$v.cu > $M/nvcc-$v.log 2>&1 & done; wait )
stamp compiled
for round in 1 2; do for mode in - pdl; do for v in base new; do timeout 60 /tmp/h7/$v $v $mode >> $M/harness.txt 2>&1; done; done; done; stamp harness
for v in base new; do ( cd /tmp/t_$v && PYTHONPATH=/tmp/site:/tmp/t_$v timeout 90 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv-$v.txt 2>&1 ); stamp "gemv $v"; done
( cd /tmp/t_new && PYTHONPATH=/tmp/site:/tmp/t_new timeout $(left 185) python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py > $M/pytest-gemv.txt 2>&1 ); stamp pytest
wait $MAKE; stamp make
tg() {  # tree, round, ncmoe
  ( cd /tmp/t_$1 && PYTHONPATH=/tmp/site:/tmp/t_$1 timeout $(left 275) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe $3 -r 3 -o json > $M/tg64-$1-$2-$3.json 2> $M/tg64-$1-$2-$3.err )
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('tg64 -ncmoe', sys.argv[4], sys.argv[2], sys.argv[3], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/tg64-$1-$2-$3.json $1 $2 $3 2>&1 | tee -a $M/summary.txt; stamp "tg64 $1 $2 $3"
}
tg new 1 0; tg base 1 0; tg new 2 0; tg base 2 0
cat $M/times.txt $M/summary.txt; tail -1 $M/pytest-gemv.txt
for v in base new; do echo "== $v"; grep -E "gemv |copy" $M/gemv-$v.txt | grep -E " 8 |copy|dense"; done
awk '$3 != "copy" {k=$3" "$4" "$5" "$2; t[k]=t[k]" "$1":"$6} END {for (k in t) print k, t[k]}' $M/harness.txt | sort
