# Call p1: the qwen3 file's prefill targets on an H200 beside llama-bench in the same call. Layer-major
# pp32768 with every expert streamed (pinned) and with every expert on the GPU, against llama-bench
# -ncmoe 48 -lm none at ubatch 4096 and 8192 and -ncmoe 0; pp4096 all on the GPU at ubatch 512/2048/4096
# (the prefill replay, on by default) against llama-bench -ncmoe 0; then, if time is left, the device's peak
# with a 512-token prompt beside llama-bench's (device-memory.md's unmeasured row). Raw output under p1/.
CALL=p1 RESULTS=h200-prefill-targets; source microbench/device_call.sh
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp make
ours() {  # NAME ARGS...: expertstream bench -o json, one summary line a row
  local name=$1; shift
  timeout $(left 585) python3 -m expertstream bench -m $F --backend cuda --slots 3 --host-memory pinned -n 0 \
    -o json "$@" > $M/$name.json 2> $M/$name.err
  python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print('ours', sys.argv[2], 'ub', r['ubatch'], round(r['prefill_tokens_per_s']), '+-',
          round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_order'), r['work'], r['prefill_sha256'][:12])
" $M/$name.json $name 2>&1 | tee -a $M/summary.txt; stamp "ours $name"
}
llama() {  # NAME ARGS...: llama-bench -o md
  local name=$1; shift
  timeout $(left 585) $LCP/bin/llama-bench -m $F -ngl 99 -lm none -fa 0 -n 0 -o md "$@" > $M/llama-$name.md 2>&1
  grep "pp[0-9]" $M/llama-$name.md | sed "s/^/llama $name /" | tee -a $M/summary.txt; stamp "llama $name"
}
ours pp4096-ncmoe0 -p 4096 -ub 512,2048,4096 -ncmoe 0 -r 3
llama pp4096-ncmoe0 -p 4096 -b 4096 -ub 512,2048,4096 -ncmoe 0 -r 3
ours pp32768-streamed -p 32768 -ub 4096 -ncmoe all --prefill-order layer -r 2
ours pp32768-ncmoe0 -p 32768 -ub 4096 -ncmoe 0 --prefill-order layer -r 2
llama pp32768-ncmoe48-ub4096 -p 32768 -b 32768 -ub 4096 -ncmoe 48 -r 2
llama pp32768-ncmoe0 -p 32768 -b 32768 -ub 4096 -ncmoe 0 -r 2
llama pp32768-ncmoe48-ub8192 -p 32768 -b 32768 -ub 8192 -ncmoe 48 -r 1
# device memory with a 512-token prompt at the CUDA backend's default stack limit, beside llama-bench's peak
peak "llama-bench -v -ncmoe 48 -p 512 -n 0" timeout $(left 590) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 48 \
  -lm none -fa 0 -p 512 -n 0 -r 1 -v > $M/llama-p512-memory.txt 2>&1
peak "device_memory p512" timeout $(left 595) python3 -m microbench.device_memory --backend cuda --model $F \
  --prompt 512 --out $M/probe-p512.json > $M/probe-p512.txt 2>&1; stamp memory
cat $M/times.txt $M/summary.txt $M/memory.txt
