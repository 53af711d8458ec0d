# Call C2: decode over streamed experts with each layer's gate, up and down as one split and the next
# layer's lookahead started after its copies, before its compute (the working tree) against the tree before
# (69a23ea, base): every expert in pinned host memory, each tree in turn; half of them (-ncmoe 24); llama-bench
# beside both in the same call. First the gemv microbench of the working tree (calls rotating past L2,
# gate+up then down with and without down's experts asked into L2) and the CUDA tests of gemv.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; T=$PWD; M=/tmp/m/c2; mkdir -p $M; pack() { tar cf $OUT/all.tar -C /tmp/m c2; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
nproc >> $M/gpu.txt; cat $D/tree_new.txt $D/tree_base.txt > $M/tree.txt
mkdir -p /tmp/base && tar xzf $D/tree_base.tgz -C /tmp/base
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf $D/llamacpp-sm90.tar.xz -C /tmp ) &
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( PYTHONPATH=/tmp/site:$T python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
MAKE=$!
( cd $T && PYTHONPATH=/tmp/site:$T timeout 230 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv-new.txt 2>&1 ); stamp "gemv new"
( cd $T && PYTHONPATH=/tmp/site:$T timeout $(left 300) python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py -k "any_number or gate_up or next_experts" -rf > $M/pytest-gemv.txt 2>&1 ); stamp pytest
wait $MAKE; stamp make
row() {  # TREE TAG BENCH-ARGS...
  local tree=$1 tag=$2; shift 2
  ( cd $tree && PYTHONPATH=/tmp/site:$tree timeout $(left 540) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -r 3 "$@" -o json > $M/tg64-$tag.json 2> $M/tg64-$tag.err )
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['rows']: print('ours tg64', sys.argv[2], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), round(r.get('decode_link_pct') or 0,1), r['decode_sha256'][:12])
" $M/tg64-$tag.json $tag 2>&1 | tee -a $M/summary.txt; stamp "tg64 $tag"
}
row $T new-all-1 -ncmoe all; row /tmp/base base-all-1 -ncmoe all; row $T new-all-2 -ncmoe all; row /tmp/base base-all-2 -ncmoe all
row $T new-24 -ncmoe 24; row /tmp/base base-24 -ncmoe 24
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
for n in 48 24; do
  timeout $(left 590) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe $n -lm none -fa 0 -p 0 -n 64 -r 3 -o md > $M/llama-tg64-ncmoe$n.md 2>&1; stamp "llama tg64 ncmoe $n"
  grep tg64 $M/llama-tg64-ncmoe$n.md | tee -a $M/summary.txt
done
unset LD_LIBRARY_PATH
cat $M/times.txt $M/summary.txt; tail -3 $M/pytest-gemv.txt
grep -E " 8 |copy|dense" $M/gemv-new.txt | grep -E "gemv|copy"
