# Call H1 on an H200: the 48-layer qwen3-30b-a3b Q4_K_M and 24-layer gpt-oss-20b MXFP4_MOE files made here
# (both left in /tmp/models for the calls after); the one-token kernels (the gemv microbench, and the
# matrix-vector harness over four block shapes: s0 the tree's, s3 one row a wave, s4 512 threads, s6 512
# threads one row a wave); layer-major pp32768 of the qwen3 file, every expert streamed and everything on the
# GPU, and pp4096 at ubatch 512, 2048 and 4096, beside llama-bench -ncmoe 48 and 0 (model_h200.sh bench),
# only on an H200 (an H100's are in attention-h100.md, decode-kernels-h100.md and prefill-graphs-h100.md);
# then tg64 all on the GPU in the tree and in copies with shapes s4 and s3, each in turn, while time is left.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
H=docs/results/decode-rows-h100; M=/tmp/m/h1; mkdir -p $M /tmp/hs /tmp/models
pack() { tar cf $OUT/all.tar -C /tmp/m h1; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; date -u; } > $M/gpu.txt
cp $H/tree.txt $M/tree.txt
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp ) &
( OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" bash microbench/model_h200.sh make > $M/make-qwen3.log 2>&1; stamp "make qwen3" ) &
MAKE=$!
( OUT=$M FILES="gpt-oss-20b:MXFP4_MOE" bash microbench/model_h200.sh make > $M/make-oss.log 2>&1; stamp "make gpt-oss" ) &
python3 $H/gen_shape.py /tmp/hs docs/results/decode-kernels-h100/gemv_harness.cu s0 s3 s4 s6 > /dev/null
( for v in s0 s3 s4 s6; do nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/hs/$v /tmp/hs/h_$v.cu > $M/nvcc-$v.log 2>&1 & done; wait ); stamp compiled
for round in 1 2; do for mode in - pdl; do for v in s0 s3 s4 s6; do timeout 60 /tmp/hs/$v $v $mode >> $M/harness.txt 2>&1; done; done; done
stamp harness
awk '$3 != "copy" {k=$3" "$4" "$5" "$2; t[k]=t[k]" "$1":"$6} END {for (k in t) print k, t[k]}' $M/harness.txt | sort > $M/harness-table.txt
timeout 150 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv.txt 2>&1; stamp gemv
wait $MAKE
if grep -q H200 $M/gpu.txt; then
  OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" TOKENS=32768 UBATCH=4096 REPS=2 PREFILL_ORDER=layer TAG=-pp32768 \
    timeout $(left 420) bash microbench/model_h200.sh bench > $M/bench-pp32768.log 2>&1; stamp "bench pp32768"
  OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" TOKENS=4096 UBATCH=512,2048,4096 REPS=2 TAG=-pp4096 \
    timeout $(left 590) bash microbench/model_h200.sh bench > $M/bench-pp4096.log 2>&1; stamp "bench pp4096"
fi
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
bash $H/shape_tree.sh /tmp/s4 512 2 2 > /dev/null; bash $H/shape_tree.sh /tmp/s3 256 1 4 > /dev/null
tg() {  # NAME TREE
  [ "$(left 560)" -gt 40 ] || return 0
  ( cd $2 && PYTHONPATH=/tmp/site:$2 timeout $(left 585) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 \
      --host-memory pinned -ncmoe 0 -r 3 -o json > $M/tg64-$1.json 2> $M/tg64-$1.err )
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('ours tg64 -ncmoe 0', sys.argv[2], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/tg64-$1.json $1 2>&1 | tee -a $M/summary.txt; stamp "tg64 $1"
}
for round in 1 2; do tg s0-$round $PWD; tg s4-$round /tmp/s4; tg s3-$round /tmp/s3; done
cat $M/times.txt; cat $M/ours-*.txt 2>/dev/null; grep -h "pp32768\|tg64" $M/llama-bench-*.md 2>/dev/null
cat $M/summary.txt; cat $M/memory.txt 2>/dev/null; cat $M/harness-table.txt; grep -E " 8 |copy|head" $M/gemv.txt | head -20
