# Call C3: the decode lookahead started after the layer before's down split has enqueued its copies, before
# down computes (22d0a8e, fork), against the tree before (69a23ea, base) and the layer as one split (the
# working tree, 4910c21's decode), every expert in pinned host memory, each tree in turn.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; T=$PWD; M=/tmp/m/c3; mkdir -p $M; pack() { tar cf $OUT/all.tar -C /tmp/m c3; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
nproc >> $M/gpu.txt; cat $D/tree_fork.txt $D/tree_base.txt $D/tree_new.txt > $M/tree.txt
for v in base fork; do mkdir -p /tmp/$v && tar xzf $D/tree_$v.tgz -C /tmp/$v; done
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
PYTHONPATH=/tmp/site:$T python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1; stamp make
row() {  # TREE TAG
  ( cd $1 && PYTHONPATH=/tmp/site:$1 timeout $(left 520) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -r 3 -ncmoe all -o json > $M/tg64-$2.json 2> $M/tg64-$2.err )
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['rows']: print('ours tg64', sys.argv[2], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), round(r.get('decode_link_pct') or 0,1), r['decode_sha256'][:12])
" $M/tg64-$2.json $2 2>&1 | tee -a $M/summary.txt; stamp "tg64 $2"
}
row /tmp/fork fork-1; row /tmp/base base-1; row /tmp/fork fork-2; row /tmp/base base-2
[ $(left 520) -gt 40 ] && row $T new-3
cat $M/times.txt $M/summary.txt
