# One call: prefill attention's rate (tall and 64-query blocks), layer-major pp32768 of the 48-layer
# qwen3-30b-a3b Q4_K_M file with this tree (tall prefill) and the tree before it (base, 0daf5d8) beside
# llama-bench -ncmoe 48 (-fa 0: the archive's build), then the CUDA attention tests in the time left.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=$OUT; M=/tmp/m/model; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m model; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp; mkdir -p /tmp/base && tar xzf .dev/base-tall.tgz -C /tmp/base ) &
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
timeout 100 python3 -m microbench.attention --backend cuda --tokens 512 4096 --context 4096 32768 > $M/attention.txt 2>&1; stamp attention
cat $M/attention.txt
wait; stamp make
ours() {  # NAME TREE NCMOE
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout $(left 330) python3 -m expertstream bench -m $F --backend cuda -p 32768 -n 0 -ub 4096 --slots 3 --host-memory pinned -ncmoe $3 --prefill-order layer -r 2 -o json > $M/ours-$1.json 2> $M/ours-$1.err)
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print(sys.argv[2], 'ncmoe', r.get('n_cpu_moe'), 'pp32768', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), 'H2D', round(r['h2d_gbps'],1), 'of', round(r['h2d_peak_gbps'],1))
" $M/ours-$1.json $1 2>&1 | tee -a $M/summary.txt; stamp "ours $1"
}
ours tall-streamed $PWD all
ours base-streamed /tmp/base all
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 420) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 32768 -n 0 -b 32768 -ub 4096 -r 2 -o md > $M/llama-ncmoe48.md 2>&1; stamp "llama 48"
grep pp32768 $M/llama-ncmoe48.md | tee -a $M/summary.txt
unset LD_LIBRARY_PATH
(timeout $(left 480) python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_attention.py -k "tall or t1100 or t1030 or wide or decode" -rf 2>&1 | sed "s#$PWD/##g" | tail -12) > $M/pytest-kernels.txt
tail -3 $M/pytest-kernels.txt; stamp tests
cat $M/times.txt $M/summary.txt
