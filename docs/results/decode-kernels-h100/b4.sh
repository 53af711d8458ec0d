# Call B4: ncu over the matrix-vector kernels of the standalone harness (each case launched once):
# the 8-pair gate+up (Q4_K), the 8-pair down (Q6_K) and the output head (Q6_K, 255 MB), the tree's
# kernels and the shared-memory rows variant.
[ -d /tmp/site/gguf ] || pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD; D=$PWD/.dev
M=/tmp/m/b4; mkdir -p $M /tmp/h4; pack() { tar cf $OUT/all.tar -C /tmp/m b4; }
start=$(date +%s); stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
which ncu > $M/ncu-path.txt 2>&1; ncu --version >> $M/ncu-path.txt 2>&1
# the async-rows variant: the patch over the tree's gemv.cu
cp expertstream/kernels/gemv.cu /tmp/h4/gemv_tree.cu
rm -rf /tmp/pt && mkdir -p /tmp/pt/expertstream/kernels && cp expertstream/kernels/gemv.cu /tmp/pt/expertstream/kernels/gemv.cu && (cd /tmp/pt && patch -p1 -s < $D/async-rows.patch) && cp /tmp/pt/expertstream/kernels/gemv.cu /tmp/h4/gemv_async.cu
python3 - <<'PY'
from pathlib import Path
from gguf import GGMLQuantizationType as Q
from expertstream.kernels.layout import weight_format
from expertstream.kernels.program import SOURCE_NAMES, _instances, source_file
names = [n for n in SOURCE_NAMES if n not in ("attention.cu", "recurrent.cu", "mma.cu", "int8.cu", "direct.cu")]
lines = [line for t in (Q.Q4_K, Q.Q6_K) for _, line in _instances(weight_format(t)) if "VEC" in line]
harness = Path(".dev/gemv_harness.cu").read_text()
for v in ("tree", "async"):
    gemv = Path(f"/tmp/h4/gemv_{v}.cu").read_text()
    files = [gemv if n == "gemv.cu" else source_file(n) for n in names]
    Path(f"/tmp/h4/h_{v}.cu").write_text("\n".join(files) + "\n" + "\n".join(lines) + "\n" + harness)
PY
for v in tree async; do ( nvcc -arch=sm_90 -O3 -std=c++17 -lineinfo -o /tmp/h4/$v /tmp/h4/h_$v.cu > $M/nvcc-$v.log 2>&1 ) & done; wait; stamp compiled
for v in tree async; do /tmp/h4/$v $v - > $M/harness-$v.txt 2>&1; done; stamp timed
for v in tree async; do
  timeout 150 ncu --set full -k regex:"moe_gate_up_vec_id_q4_k|moe_mul_mat_vec_id_q6_k" /tmp/h4/$v $v ncu > $M/ncu-$v.txt 2>&1; stamp "ncu $v"
done
cat $M/times.txt; head -3 $M/ncu-path.txt; cat $M/harness-*.txt | grep -v copy
