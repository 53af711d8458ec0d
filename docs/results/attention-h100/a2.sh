# Call A2: the 48-layer qwen3-30b-a3b Q4_K_M file: layer-major pp32768 with every expert streamed (the
# 8-warp prefill attention by default) beside llama-bench -ncmoe 48 at ubatch 4096 and 8192; every expert
# on the GPU (pp4096 at ubatch 512/2048/4096 with the prefill replay, tg64) beside llama-bench -ncmoe 0;
# the one-token kernels against a plain device copy in the same run.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; rm -rf /tmp/tree && mkdir -p /tmp/tree && tar xzf $D/tree2.tgz -C /tmp/tree
cd /tmp/tree; export PYTHONPATH=/tmp/site:/tmp/tree
R=$OUT; M=/tmp/m/a2; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m a2; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
cp $D/tree2.txt $M/tree.txt
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf $D/llamacpp-sm90.tar.xz -C /tmp ) &
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
timeout 70 python3 -m microbench.kernels --backend cuda --gemv --types Q4_K Q6_K > $M/gemv.txt 2>&1; stamp gemv
wait; stamp make
timeout $(left 170) python3 -m expertstream bench -m $F --backend cuda -p 32768 -n 0 -ub 4096 --slots 3 --host-memory pinned -ncmoe all --prefill-order layer -r 2 -o json > $M/pp32768.json 2> $M/pp32768.err
python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('ours pp32768 streamed', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_order'), r['prefill_sha256'][:12])
" $M/pp32768.json 2>&1 | tee -a $M/summary.txt; stamp "ours pp32768"
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 240) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 32768 -n 0 -b 32768 -ub 4096 -r 2 -o md > $M/llama-pp32768.md 2>&1; stamp "llama pp32768"
grep pp32768 $M/llama-pp32768.md | tee -a $M/summary.txt
timeout $(left 290) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 4096 -n 0 -b 4096 -ub 512,2048,4096 -r 3 -o md > $M/llama-pp4096.md 2>&1; stamp "llama pp4096"
timeout $(left 310) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 0 -n 64 -r 3 -o md > $M/llama-tg64.md 2>&1; stamp "llama tg64"
grep -h "pp4096\|tg64" $M/llama-pp4096.md $M/llama-tg64.md | tee -a $M/summary.txt
unset LD_LIBRARY_PATH
timeout $(left 400) python3 -m expertstream bench -m $F --backend cuda -p 4096 -n 0 -ub 512,2048,4096 --slots 3 --host-memory pinned -ncmoe 0 -r 3 -o json > $M/pp4096.json 2> $M/pp4096.err
python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('ours all-GPU ub', r['ubatch'], 'pp4096', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_path'), r['work'], r['prefill_sha256'][:12])
" $M/pp4096.json 2>&1 | tee -a $M/summary.txt; stamp "ours pp4096"
timeout $(left 450) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe 0 -r 3 -o json > $M/tg64.json 2> $M/tg64.err
python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('ours tg64 all-GPU', round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r.get('decode_path'), r['decode_sha256'][:12])
" $M/tg64.json 2>&1 | tee -a $M/summary.txt; stamp "ours tg64"
grep -E "gate\+up|copy" $M/gemv.txt | tee -a $M/summary.txt
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 580) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 32768 -n 0 -b 32768 -ub 8192 -r 1 -o md > $M/llama-pp32768-ub8192.md 2>&1; stamp "llama pp32768 ub8192"
grep pp32768 $M/llama-pp32768-ub8192.md | tee -a $M/summary.txt
cat $M/times.txt $M/summary.txt
