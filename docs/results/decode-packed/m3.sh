# Call m3: m2's generate rows again after the prompt's slots and scratch are freed when decode begins (a
# captured step brings its own), on the qwen3 file and then, as time allows, gpt-oss-20b's 16-token row:
# the device's peak used memory by nvidia-smi every 100 ms, each run in a process of its own, and
# generate's own "device memory:" line; llama-bench's peaks on these files are m1's and m2's (the same
# in both calls). Then where a process's memory goes, stage by stage (probe.py). Raw output under m3/.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m/m3; mkdir -p $M
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
gen() {  # PRESET QTYPE COUNT
  local F=/tmp/models/$1-$2.gguf
  python3 -c "
import sys
from expertstream.engine.tokenizer import Tokenizer
from microbench.llamacpp_logits.prompt import corpus_tokens
print(Tokenizer.from_path(sys.argv[1]).decode(corpus_tokens(sys.argv[1], int(sys.argv[2]))), end='')" $F $3 > $M/prompt-$1-$3.txt
  peak "expertstream generate $1 -f prompt-$3 -n 64" timeout $(left 590) python3 -m expertstream generate -m $F \
    -f $M/prompt-$1-$3.txt -n 64 --temp 0 --backend cuda --host-memory pinned > $M/generate-$1-$3.txt 2>&1
  stamp "$1 $3"
}
OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp make
gen qwen3-30b-a3b Q4_K_M 16
gen qwen3-30b-a3b Q4_K_M 512
timeout $(left 590) python3 docs/results/decode-packed/probe.py /tmp/models/qwen3-30b-a3b-Q4_K_M.gguf > $M/probe.txt 2>&1
stamp probe
if [ "$(left 590)" -gt 150 ]; then
  OUT=$M FILES="gpt-oss-20b:MXFP4_MOE" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp "make gpt-oss"
  gen gpt-oss-20b MXFP4_MOE 16
fi
cat $M/times.txt $M/memory.txt $M/probe.txt
grep -H "prompt eval\|  eval time\|device memory" $M/generate-*.txt
