# Call B2: launch bounds of the matrix-vector kernels (8 blocks a multiprocessor for all of them, or for the
# experts' two only) against the tree as it is: the one-token kernel table and tg64 with every expert on
# the GPU; then layer-major pp32768 with every expert streamed against everything on the GPU (tree as is).
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; M=/tmp/m/b2; mkdir -p $M
pack() { tar cf $OUT/all.tar -C /tmp/m b2; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
cp $D/tree_b2.txt $M/tree.txt
for v in base all experts; do mkdir -p /tmp/t_$v && tar xzf $D/tree_b2.tgz -C /tmp/t_$v; done
python3 $D/mb_variant.py /tmp/t_all all && python3 $D/mb_variant.py /tmp/t_experts experts
( cd /tmp/t_base && diff expertstream/kernels/gemv.cu /tmp/t_all/expertstream/kernels/gemv.cu; diff expertstream/kernels/gemv.cu /tmp/t_experts/expertstream/kernels/gemv.cu ) > $M/variants.diff
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( cd /tmp/t_base && PYTHONPATH=/tmp/site:/tmp/t_base python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
for v in base all experts; do
  ( cd /tmp/t_$v && PYTHONPATH=/tmp/site:/tmp/t_$v timeout 90 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv-$v.txt 2>&1 ); stamp "gemv $v"
done
wait; stamp make
tg() {  # variant, repetition round
  ( cd /tmp/t_$1 && PYTHONPATH=/tmp/site:/tmp/t_$1 timeout $(left 400) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe 0 -r 3 -o json > $M/tg64-$1-$2.json 2> $M/tg64-$1-$2.err )
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('tg64 all-GPU', sys.argv[2], sys.argv[3], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/tg64-$1-$2.json $1 $2 2>&1 | tee -a $M/summary.txt; stamp "tg64 $1 $2"
}
for round in 1 2; do for v in base all experts; do tg $v $round; done; done
cd /tmp/t_base; export PYTHONPATH=/tmp/site:/tmp/t_base
for ncmoe in 0 all; do
  timeout $(left 590) python3 -m expertstream bench -m $F --backend cuda -p 32768 -n 0 -ub 4096 --slots 3 --host-memory pinned -ncmoe $ncmoe --prefill-order layer -r 2 -o json > $M/pp32768-$ncmoe.json 2> $M/pp32768-$ncmoe.err
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('pp32768 layer -ncmoe', sys.argv[2], round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_order'), r['prefill_sha256'][:12])
" $M/pp32768-$ncmoe.json $ncmoe 2>&1 | tee -a $M/summary.txt; stamp "pp32768 $ncmoe"
done
cat $M/times.txt $M/summary.txt; for v in base all experts; do echo "== $v"; grep -E "gemv |copy" $M/gemv-$v.txt | grep -E " 8 |copy|dense"; done
