# Call C1: gate_up asking down's experts into L2 (tree 5e80c9c and later, the working tree) against the tree
# before (69a23ea, base): the gemv microbench in both (base's calls reread the same experts; the new one's
# rotate past L2 and time gate+up then down with and without the prefetch), the CUDA tests of the changed
# kernels, then tg64 with everything on the GPU, each tree in turn, then every expert in pinned host memory
# beside llama-bench -ncmoe 48 in the same call.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; T=$PWD; M=/tmp/m/c1; mkdir -p $M; pack() { tar cf $OUT/all.tar -C /tmp/m c1; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
nproc >> $M/gpu.txt; git rev-parse --short HEAD > $M/tree.txt 2>/dev/null; git status --short >> $M/tree.txt; cat $D/tree_base.txt >> $M/tree.txt
mkdir -p /tmp/base && tar xzf $D/tree_base.tgz -C /tmp/base
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf $D/llamacpp-sm90.tar.xz -C /tmp ) &
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( PYTHONPATH=/tmp/site:$T python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
MAKE=$!
mb() {  # NAME TREE
  ( cd $2 && PYTHONPATH=/tmp/site:$2 timeout 100 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv-$1.txt 2>&1 ); stamp "gemv $1"
}
mb new $T; mb base /tmp/base
( cd $T && PYTHONPATH=/tmp/site:$T timeout $(left 330) python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py -k "gate_up or next_experts or Q4_K or Q6_K" -rf > $M/pytest-gemv.txt 2>&1 ); stamp pytest
wait $MAKE; stamp make
row() {  # TREE TAG BENCH-ARGS...
  local tree=$1 tag=$2; shift 2
  ( cd $tree && PYTHONPATH=/tmp/site:$tree timeout $(left 560) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -r 3 "$@" -o json > $M/tg64-$tag.json 2> $M/tg64-$tag.err )
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['rows']: print('ours tg64', sys.argv[2], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), round(r.get('decode_link_pct') or 0,1), r['decode_sha256'][:12])
" $M/tg64-$tag.json $tag 2>&1 | tee -a $M/summary.txt; stamp "tg64 $tag"
}
row $T new-1 -ncmoe 0; row /tmp/base base-1 -ncmoe 0; row $T new-2 -ncmoe 0; row /tmp/base base-2 -ncmoe 0
row $T new-host -ncmoe all
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 560) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 0 -n 64 -r 3 -o md > $M/llama-tg64-host.md 2>&1; stamp "llama tg64 host"
grep tg64 $M/llama-tg64-host.md | tee -a $M/summary.txt
unset LD_LIBRARY_PATH
cat $M/times.txt $M/summary.txt; tail -3 $M/pytest-gemv.txt
for v in new base; do echo "== $v"; grep -E "gemv |copy|gemv\+L2" $M/gemv-$v.txt | grep -E " 8 |copy|dense"; done
