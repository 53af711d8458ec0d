# One call: the CUDA tests of prefill graphs and the wide attention kernels, then pp4096 of the 48-layer
# qwen3-30b-a3b Q4_K_M file with every expert on the GPU at ubatch 512/2048/4096: expertstream with
# prefill graphs and with --no-graphs, beside llama-bench -ncmoe 0, same file, same machine.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=$OUT; M=/tmp/m/call; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m call; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
git log -1 --format=%h > $M/tree.txt 2>/dev/null; git status --short >> $M/tree.txt 2>/dev/null
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp ) &
mkdir -p /tmp/models; F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1 ) &
(timeout 170 python3 -m pytest -q -p no:cacheprovider --backend cuda tests/engine/test_prefill_graphs.py \
   tests/kernels/test_attention.py -k "prefill_graphs or replayed or stock or refuses or matches_reference" -rf 2>&1 \
   | sed "s#$PWD/##g" | tail -15) > $M/pytest.txt
tail -4 $M/pytest.txt; stamp tests
wait; stamp make
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 330) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 4096 -n 0 -b 4096 \
   -ub 512,2048,4096 -r 3 -o md > $M/llama-ncmoe0.md 2>&1; stamp llama
unset LD_LIBRARY_PATH
ours() {  # NAME FLAGS...
  local name=$1; shift
  timeout $(left 585) python3 -m expertstream bench -m $F --backend cuda -p 4096 -n 0 -ub 512,2048,4096 --slots 3 \
     --host-memory pinned -ncmoe 0 -r 3 "$@" -o json > $M/ours-$name.json 2> $M/ours-$name.err
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print(sys.argv[2], 'ub', r['ubatch'], 'pp4096', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_path'), r['work'], r['prefill_order'], r['prefill_sha256'][:12])
" $M/ours-$name.json $name 2>&1 | tee -a $M/summary.txt; stamp "ours $name"
}
ours graphs
ours calls --no-graphs
grep pp4096 $M/llama-ncmoe0.md | tee -a $M/summary.txt
cat $M/times.txt $M/summary.txt
