# Right after ds13 on the same machine: pp4096 with every expert on the GPU for deepseek-v2-lite Q4_K_M and
# gpt-oss-20b MXFP4 at ubatch 512/2048/4096, expertstream (prefill graphs) beside llama-bench -ncmoe 0.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=$OUT; M=/tmp/m/call2; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m call2; }
start=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
[ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp
mkdir -p /tmp/models
one() {  # PRESET TYPE
  local F=/tmp/models/$1-$2.gguf
  [ -f $F ] || timeout $(left 300) python3 -m expertstream make-model --preset $1 --type $2 -o $F > $M/make-$1.txt 2>&1
  stamp "make $1"
  LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin timeout $(left 420) /tmp/llamacpp-sm90/bin/llama-bench -m $F -ngl 99 -ncmoe 0 \
     -lm none -fa 0 -p 4096 -n 0 -b 4096 -ub 512,2048,4096 -r 3 -o md > $M/llama-$1.md 2>&1; stamp "llama $1"
  timeout $(left 585) python3 -m expertstream bench -m $F --backend cuda -p 4096 -n 0 -ub 512,2048,4096 --slots 3 \
     --host-memory pinned -ncmoe 0 -r 3 -o json > $M/ours-$1.json 2> $M/ours-$1.err
  python3 -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']: print(sys.argv[2], 'ub', r['ubatch'], 'pp4096', round(r['prefill_tokens_per_s']), '+-', round(r['prefill_tokens_per_s_sd'] or 0), r.get('prefill_path'), r['work'], r['prefill_order'], r['prefill_sha256'][:12])
" $M/ours-$1.json $1 2>&1 | tee -a $M/summary.txt; stamp "ours $1"
  grep pp4096 $M/llama-$1.md | tee -a $M/summary.txt
}
one deepseek-v2-lite Q4_K_M
one gpt-oss-20b MXFP4
cat $M/times.txt $M/summary.txt
