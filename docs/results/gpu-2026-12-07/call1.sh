# One call: CUDA tests of capture forks, skipping gathers and the decode lookahead; gpt-oss-20b MXFP4 (24
# layers) pp4096 with every expert on the GPU at ubatch 512/2048/4096 (MXFP4 direct-decode kernels, prefill
# replay) beside llama-bench -ncmoe 0; then tg64 of the 48-layer qwen3-30b-a3b Q4_K_M file with every expert
# (and the first 24 layers') in pinned host memory, the decode lookahead at N = 4 (default), 0 (off), 2, 8,
# beside llama-bench -ncmoe 48 / 24. Same files, same machine.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; rm -rf /tmp/tree && mkdir -p /tmp/tree && tar xf $D/tree.tar -C /tmp/tree && cd /tmp/tree
export PYTHONPATH=/tmp/site:$PWD
R=$OUT; M=/tmp/m/call1; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m call1; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
cat $D/tree.txt > $M/tree.txt 2>/dev/null
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf $D/llamacpp-sm90.tar.xz -C /tmp ) &
mkdir -p /tmp/models; G=/tmp/models/gpt-oss-20b-MXFP4.gguf; Q=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
( python3 -m expertstream make-model --preset gpt-oss-20b --type MXFP4 -o $G > $M/make-gpt-oss-20b.txt 2>&1 ) &
( python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $Q > $M/make-qwen3-30b-a3b.txt 2>&1 ) &
(timeout 100 python3 -m pytest -q -p no:cacheprovider --backend cuda tests/backends/test_graphs.py tests/backends/test_gather.py \
   tests/engine/test_decode_lookahead.py -rf 2>&1 | tail -8) > $M/pytest.txt
tail -3 $M/pytest.txt; stamp tests
wait; stamp make
LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin timeout $(left 200) /tmp/llamacpp-sm90/bin/llama-bench -m $Q -ngl 99 -ncmoe 48,24 \
   -lm none -fa 0 -p 0 -n 64 -r 3 -o md > $M/llama-decode.md 2>&1; stamp "llama decode"
grep tg64 $M/llama-decode.md | tee -a $M/summary.txt
ours() {  # NAME LIMIT FLAGS...
  local name=$1 limit=$2; shift 2
  timeout $(left $limit) python3 -m expertstream bench -m $Q --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned \
     -r 3 "$@" -o json > $M/decode-$name.json 2> $M/decode-$name.err
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print(sys.argv[2], 'ncmoe', r.get('layers_streamed'), 'tg64', round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), 'ahead', r.get('decode_lookahead'), r.get('decode_path'), round(r.get('decode_link_pct') or 0,1), '% of', round(r.get('decode_link_limit_tokens_per_s') or 0,1), r['decode_sha256'][:12])
" $M/decode-$name.json $name 2>&1 | tee -a $M/summary.txt; stamp "ours $name"
}
ours la4 290 -ncmoe all,24
ours la0 370 -ncmoe all,24 --decode-lookahead 0
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin
timeout $(left 420) /tmp/llamacpp-sm90/bin/llama-bench -m $G -ngl 99 -ncmoe 0 -lm none -fa 0 -p 4096 -n 0 -b 4096 \
   -ub 512,2048,4096 -r 3 -o md > $M/llama-gpt-oss-20b.md 2>&1; stamp "llama gpt-oss-20b"
unset LD_LIBRARY_PATH
grep pp4096 $M/llama-gpt-oss-20b.md | tee -a $M/summary.txt
timeout $(left 500) python3 -m expertstream bench -m $G --backend cuda -p 4096 -n 0 -ub 512,2048,4096 --slots 3 \
   --host-memory pinned -ncmoe 0 -r 3 -o json > $M/ours-gpt-oss-20b.json 2> $M/ours-gpt-oss-20b.err
python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('gpt-oss-20b ub', r['ubatch'], 'pp4096', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_path'), r['work'], r['prefill_sha256'][:12])
" $M/ours-gpt-oss-20b.json 2>&1 | tee -a $M/summary.txt; stamp "ours gpt-oss-20b"
ours la2 550 -ncmoe all --decode-lookahead 2
ours la8 590 -ncmoe all --decode-lookahead 8
cat $M/times.txt $M/summary.txt
