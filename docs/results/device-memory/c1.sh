# Call c1: where a generating process's device memory goes, beside llama.cpp's. The CUDA tests of the packed
# gather (its zeroed rows), the release of the prompt's slots at decode and generate's memory line; then on
# the qwen3 file: llama-bench -v (its own buffers) and expertstream's stage-by-stage count
# (microbench.device_memory: as the tree runs; each tensor in an allocation of its own, as before the
# arenas; the context's stack limit set low), generate's peaks by
# nvidia-smi every 100 ms (a process per run), and tg64 with every expert in pinned host memory (hash and
# speed after the zeroing). Raw output under c1/.
CALL=c1 RESULTS=device-memory; source microbench/device_call.sh
timeout $(left 150) python3 -m pytest -q -p no:cacheprovider --backend cuda tests/backends/test_gather.py \
  tests/scheduler/test_copy_paths.py tests/engine/test_decode_lookahead.py tests/cli/test_generate.py \
  > $M/pytest.txt 2>&1; stamp "pytest rc $?"
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp make
peak "llama-bench -v -ncmoe 48 -p 0 -n 64" timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 48 \
  -lm none -fa 0 -p 0 -n 64 -r 1 -v > $M/llama-p0.txt 2>&1
peak "llama-bench -v -ncmoe 48 -p 512 -n 0" timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 48 \
  -lm none -fa 0 -p 512 -n 0 -r 1 -v > $M/llama-p512.txt 2>&1; stamp llama
probe() {  # NAME ARGS...
  local name=$1; shift
  peak "device_memory $name" timeout $(left 580) python3 -m microbench.device_memory --backend cuda --model $F \
    --out $M/probe-$name.json "$@" > $M/probe-$name.txt 2>&1; stamp "probe $name"
}
probe p16 --prompt 16
probe p16-own-allocations --prompt 16 --arena-max 0
probe p16-stack256 --prompt 16 --stack-limit 256
probe p512 --prompt 512
python3 -c "
import sys
from expertstream.engine.tokenizer import Tokenizer
from microbench.llamacpp_logits.prompt import corpus_tokens
print(Tokenizer.from_path(sys.argv[1]).decode(corpus_tokens(sys.argv[1], 16)), end='')" $F > $M/prompt-16.txt
peak "expertstream generate -f prompt-16 -n 64" timeout $(left 580) python3 -m expertstream generate -m $F \
  -f $M/prompt-16.txt -n 64 --temp 0 --backend cuda --host-memory pinned > $M/generate-16.txt 2>&1; stamp generate
[ "$(left 560)" -gt 80 ] && { timeout $(left 580) python3 -m expertstream bench --backend cuda --slots 3 \
  --host-memory pinned -o json -m $F -p 16 -n 64 -ncmoe all -r 3 > $M/bench-all.json 2> $M/bench-all.err; stamp bench; }
tail -3 $M/pytest.txt; cat $M/times.txt $M/memory.txt
grep -h "buffer size\|CUDA0\|tg64\|pp512" $M/llama-*.txt | sort | uniq -c | head -20
for f in $M/probe-*.txt; do echo "== $f"; tail -8 $f; done
grep -h "device memory\|eval time" $M/generate-16.txt
python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(f\"tg64 {r['decode_tokens_per_s']:.1f} +- {r['decode_tokens_per_s_sd'] or 0:.1f} {(r['decode_sha256'] or '-')[:12]} {r['decode_link_pct']:.1f}% of link, staging {r['device_memory']['staging'] / 2**20:.0f} MiB\")" $M/bench-all.json 2>&1 | tail -3
