# Call A1: prefill attention in base 2 with whole tiles unmasked (64-query blocks) and 8-warp 128-query
# blocks, against the tree before (base): CUDA tests, the attention microbench in both trees, then
# layer-major pp32768 of the 48-layer qwen3-30b-a3b Q4_K_M file beside llama-bench -ncmoe 48, then
# tg64 rows with every expert in pinned host memory (the decode lookahead on and off) beside llama-bench.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; rm -rf /tmp/tree /tmp/base && mkdir -p /tmp/tree /tmp/base && tar xzf $D/tree.tgz -C /tmp/tree && tar xzf $D/base.tgz -C /tmp/base
cd /tmp/tree; export PYTHONPATH=/tmp/site:/tmp/tree
R=$OUT; M=/tmp/m/a1; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m a1; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
cp $D/tree.txt $M/tree.txt
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf $D/llamacpp-sm90.tar.xz -C /tmp ) &
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
att() {  # NAME TREE ROWS
  (cd $2 && PYTHONPATH=/tmp/site:$2 EXPERTSTREAM_ATTN_MMA_ROWS=$3 timeout 70 python3 -m microbench.attention --backend cuda \
     --shapes qwen3-30b-a3b gpt-oss-20b --tokens 512 4096 --context 4096 32768 > $M/attention-$1.txt 2>&1); stamp "attention $1"
}
att base /tmp/base ""
att new64 /tmp/tree 64
att new96 /tmp/tree 96
att new128 /tmp/tree 128
paste <(awk '{print $1,$2,$3,$NF}' $M/attention-base.txt) <(awk '{print $4,$NF}' $M/attention-new64.txt) <(awk '{print $4,$NF}' $M/attention-new96.txt) <(awk '{print $4,$NF}' $M/attention-new128.txt) | tee $M/attention-table.txt
(timeout 110 python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_attention.py -rf 2>&1 | tail -15) > $M/pytest.txt
tail -3 $M/pytest.txt; stamp tests
# the block height the qwen3 4096x32768 row ran fastest with
BEST=$(python3 -c "
import sys
def r(f):
    for l in open(f):
        p=l.split()
        if len(p)>=6 and p[0]=='qwen3-30b-a3b' and p[1]=='4096' and p[2]=='32768': return float(p[-1])
    return 0
print(max((r('$M/attention-new%d.txt' % n), n) for n in (64, 96, 128))[1])" 2>/dev/null || echo 64)
echo "best rows $BEST" | tee -a $M/summary.txt
wait; stamp make
ours() {  # NAME TREE ROWS LIMIT
  (cd $2 && PYTHONPATH=/tmp/site:$2 EXPERTSTREAM_ATTN_MMA_ROWS=$3 timeout $(left $4) python3 -m expertstream bench -m $F --backend cuda -p 32768 -n 0 -ub 4096 --slots 3 --host-memory pinned -ncmoe all --prefill-order layer -r 2 -o json > $M/pp-$1.json 2> $M/pp-$1.err)
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print(sys.argv[2], 'pp32768', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_order'), r['prefill_sha256'][:12])
" $M/pp-$1.json $1 2>&1 | tee -a $M/summary.txt; stamp "pp $1"
}
ours new$BEST /tmp/tree $BEST 300
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 370) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 32768 -n 0 -b 32768 -ub 4096 -r 2 -o md > $M/llama-pp32768.md 2>&1; stamp "llama pp32768"
grep pp32768 $M/llama-pp32768.md | tee -a $M/summary.txt
timeout $(left 420) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 0 -n 64 -r 3 -o md > $M/llama-tg64.md 2>&1; stamp "llama tg64"
grep tg64 $M/llama-tg64.md | tee -a $M/summary.txt
unset LD_LIBRARY_PATH
tg() {  # N LIMIT
  timeout $(left $2) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -r 3 -ncmoe all --decode-lookahead $1 -o json > $M/tg64-la$1.json 2> $M/tg64-la$1.err
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('ours tg64', round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), 'ahead', r.get('decode_lookahead'), round(r.get('decode_link_pct') or 0,1), '% of', round(r.get('decode_link_limit_tokens_per_s') or 0,1), r['decode_sha256'][:12])
" $M/tg64-la$1.json 2>&1 | tee -a $M/summary.txt; stamp "ours tg64 la$1"
}
tg 4 490
tg 0 540
[ $(left 590) -gt 60 ] && [ $BEST != 64 ] && ours new64 /tmp/tree 64 590
cat $M/times.txt $M/summary.txt
