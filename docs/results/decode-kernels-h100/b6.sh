# Call B6: the matrix-vector harness again: the activations' amax exchanged by warp shuffles (one barrier
# a chunk), and blocks of 256 and 512 threads (the activations quantized once for 16 or 32 rows).
[ -d /tmp/site/gguf ] || pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD; D=$PWD/.dev
M=/tmp/m/b6; mkdir -p $M /tmp/h6; pack() { tar cf $OUT/all.tar -C /tmp/m b6; }
start=$(date +%s); stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
git rev-parse --short HEAD > $M/tree.txt 2>/dev/null; git status --short >> $M/tree.txt 2>/dev/null
vs=$(python3 $D/gen_variants.py /tmp/h6 $D/gemv_harness.cu $D/gemv_old.cu)
for v in $vs; do ( nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/h6/$v /tmp/h6/h_$v.cu > $M/nvcc-$v.log 2>&1 ) & done; wait; stamp compiled
for round in 1 2; do for mode in - pdl; do for v in $vs; do timeout 60 /tmp/h6/$v $v $mode >> $M/harness.txt 2>&1; done; done; done; stamp timed
cat $M/times.txt
awk '$3 != "copy" {k=$3" "$4" "$5" "$2; v[k]=v[k]" "$1":"$6} END {for (k in v) print k, v[k]}' $M/harness.txt | sort
grep copy $M/harness.txt | head -4
