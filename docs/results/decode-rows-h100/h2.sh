# Call H2 on the same H200, after H1 (its files in /tmp/models): decode beside llama-bench on both files
# (model_h200.sh decode: every expert in pinned host memory, half the layers', none; tg64 and tg256; the qwen3
# file also from its mapping beside llama-bench -lm mmap, and decode_profile's table of one step), then the
# qwen3 file with --gpu-memory 24G, and a trace of 8 streamed steps where nsys is installed.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
H=docs/results/decode-rows-h100; M=/tmp/m/h2; mkdir -p $M
pack() { tar cf $OUT/all.tar -C /tmp/m h2; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; date -u; } > $M/gpu.txt
cp $H/tree.txt $M/tree.txt; ls -la /tmp/models >> $M/gpu.txt
( [ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp )
OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" bash microbench/model_h200.sh make > $M/make.log 2>&1; stamp "make (kept?)"
OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" DECODE_STEPS=64,256 DECODE_MMAP=1 REPS=3 timeout $(left 330) \
  bash microbench/model_h200.sh decode > $M/decode-qwen3.log 2>&1; stamp "decode qwen3"
OUT=$M FILES="gpt-oss-20b:MXFP4_MOE" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp "make gpt-oss (kept?)"
OUT=$M FILES="gpt-oss-20b:MXFP4_MOE" DECODE_STEPS=64,256 REPS=3 timeout $(left 540) \
  bash microbench/model_h200.sh decode > $M/decode-oss.log 2>&1; stamp "decode gpt-oss"
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
timeout $(left 590) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned \
  --gpu-memory 24G -r 3 -o json > $M/decode-ours-gpu-memory-24G.json 2> $M/decode-ours-gpu-memory-24G.err; stamp "gpu-memory 24G"
# a trace of 8 streamed steps, where nsys is installed: kernels (the gather among them) and copies per stream
if command -v nsys > /dev/null && [ "$(left 590)" -gt 60 ]; then
  nsys --version > $M/nsys.txt 2>&1
  timeout $(left 585) nsys profile --cuda-graph-trace=node -t cuda -o /tmp/dec -f true python3 -m expertstream bench -m $F \
    --backend cuda -p 16 -n 8 --slots 3 --host-memory pinned -ncmoe all -r 1 >> $M/nsys.txt 2>&1
  timeout $(left 595) nsys stats -q --report cuda_gpu_trace --format csv -o $M/dec /tmp/dec.nsys-rep >> $M/nsys.txt 2>&1
  gzip -f $M/dec*.csv 2>/dev/null; stamp nsys
fi
cat $M/times.txt; cat $M/decode-ours-*.txt; grep -h "tg" $M/decode-llama-*.md; cat $M/memory.txt
python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print('gpu-memory 24G', r.get('n_cpu_moe'), round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/decode-ours-gpu-memory-24G.json
