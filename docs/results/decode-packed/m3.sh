# Call m3: m2 again after the prompt's slots and scratch are freed when decode begins (a captured step
# brings its own): device memory of `expertstream generate`, every expert streamed from pinned host
# memory, beside llama-bench on the same file in the same call, each run in a process of its own with
# nvidia-smi sampling the device's used memory every 100 ms (a 16-token and a 512-token prompt and 64
# tokens; llama-bench -p 0 -n 64, then -p 512 -n 64), generate's own "device memory:" line beside each;
# then tg64 of bench on the qwen3 file (every expert on the host, and none). Raw output under m3/.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m/m3; mkdir -p $M
LCP=/tmp/llamacpp-sm90; export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
pack() { tar cf $OUT/all.tar -C /tmp/m m3; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
peak() {  # NAME COMMAND...: the device's peak used memory while COMMAND runs, into memory.txt
  local name=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > /tmp/used.log 2>/dev/null &
  local sampler=$!
  "$@"; local status=$?
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  echo "$name: peak $(sort -n /tmp/used.log | tail -1) MiB used on the device" >> $M/memory.txt
  return $status
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; date -u; } > $M/gpu.txt
cp docs/results/decode-packed/tree.txt $M/tree.txt
( [ -x $LCP/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp ); stamp setup
for spec in qwen3-30b-a3b:Q4_K_M:48 gpt-oss-20b:MXFP4_MOE:24; do
  IFS=: read preset qtype n <<< "$spec"; F=/tmp/models/$preset-$qtype.gguf
  [ "$(left 560)" -gt 100 ] || break
  OUT=$M FILES="$preset:$qtype" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp "make $preset"
  for count in 16 512; do
    python3 -c "
import sys
from expertstream.engine.tokenizer import Tokenizer
from microbench.llamacpp_logits.prompt import corpus_tokens
ids = corpus_tokens(sys.argv[1], int(sys.argv[2]))
print(Tokenizer.from_path(sys.argv[1]).decode(ids), end='')" $F $count > $M/prompt-$preset-$count.txt
    peak "expertstream generate $preset -f prompt-$count -n 64" timeout $(left 580) python3 -m expertstream generate \
      -m $F -f $M/prompt-$preset-$count.txt -n 64 --temp 0 --backend cuda --host-memory pinned \
      > $M/generate-$preset-$count.txt 2>&1
  done
  peak "llama-bench $preset -ncmoe $n -p 0 -n 64" timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $n \
    -lm none -fa 0 -p 0 -n 64 -r 1 -o md >> $M/llama-$preset.md 2>&1
  peak "llama-bench $preset -ncmoe $n -p 512 -n 64" timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $n \
    -lm none -fa 0 -p 512 -n 64 -r 1 -o md >> $M/llama-$preset.md 2>&1
  stamp "$preset"
done
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
[ "$(left 560)" -gt 60 ] && timeout $(left 590) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 \
  --host-memory pinned -ncmoe all,0 -r 3 -o json > $M/bench-qwen3.json 2> $M/bench-qwen3.err; stamp bench
cat $M/times.txt $M/memory.txt; grep -h "tg64\|pp512" $M/llama-*.md
python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    m = r['device_memory']
    print(f\"bench ncmoe {r['n_cpu_moe']}: tg64 {r['decode_tokens_per_s']:.1f} +- {r['decode_tokens_per_s_sd'] or 0:.1f} \"
          f\"({r['decode_link_pct'] or 0:.1f}% of link) {r['decode_sha256'][:12]} staging {m['staging'] / 2**20:.0f} MiB\")
" $M/bench-qwen3.json
grep -H "prompt eval\|  eval time\|device memory" $M/generate-*.txt
