# Call G1: matrix-vector launches of fewer than 4096 rows in all with one row a wave (the working tree) against
# the tree before (d26fe9f, base, unpacked from .dev/base.tgz): the CUDA tests of gemv.cu that launch it, then tg64 with
# everything on the GPU, each tree in turn, on the 48-layer qwen3-30b-a3b Q4_K_M file (two rounds) and the
# 24-layer gpt-oss-20b MXFP4_MOE file (one round), both made here; a second qwen3 round while time is left.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
T=$PWD; M=/tmp/m/g1; mkdir -p $M /tmp/base /tmp/models; pack() { tar cf $OUT/all.tar -C /tmp/m g1; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; date -u; } > $M/gpu.txt
cp docs/results/gemv-one-row/tree.txt $M/tree.txt; tar xzf .dev/base.tgz -C /tmp/base
Q=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf; O=/tmp/models/gpt-oss-20b-MXFP4_MOE.gguf
( PYTHONPATH=/tmp/site:$T python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $Q > $M/make.txt 2>&1
  PYTHONPATH=/tmp/site:$T python3 -m expertstream make-model --preset gpt-oss-20b --type MXFP4_MOE -o $O >> $M/make.txt 2>&1 ) &
MAKE=$!
PYTHONPATH=/tmp/site:$T timeout 100 python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py -rf \
  -k "few_rows or dense_projection or any_number or gate_up" > $M/pytest-gemv.txt 2>&1; stamp pytest; tail -2 $M/pytest-gemv.txt
wait $MAKE; stamp make
tg() {  # NAME TREE FILE
  [ "$(left 560)" -gt 35 ] || return 0
  ( cd $2 && PYTHONPATH=/tmp/site:$2 timeout $(left 590) python3 -m expertstream bench -m $3 --backend cuda -p 16 -n 64 --slots 3 \
      --host-memory pinned -ncmoe 0 -r 3 -o json > $M/tg64-$1.json 2> $M/tg64-$1.err )
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('tg64 -ncmoe 0', sys.argv[2], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/tg64-$1.json $1 2>&1 | tee -a $M/summary.txt; stamp "tg64 $1"
}
tg qwen3-new-1 $T $Q; tg qwen3-base-1 /tmp/base $Q; tg oss-new $T $O; tg oss-base /tmp/base $O
tg qwen3-new-2 $T $Q; tg qwen3-base-2 /tmp/base $Q  # while time is left
cat $M/times.txt $M/summary.txt
