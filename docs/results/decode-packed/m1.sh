# Call m1: packed decode copies. The CUDA tests of the changed parts (gather, stock copies, decode
# lookahead), then on each file: device memory with every expert on the host, each run in a process of
# its own with nvidia-smi sampling its peak every 100 ms (llama-bench -p 0 -n 64 and expertstream's
# 16-token prompt and 64 steps; then a 512-token prompt beside llama-bench -p 512), with tg64 of both;
# then half the layers' experts on the host (tg64 beside llama-bench -ncmoe N/2). Raw output under m1/.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m/m1; mkdir -p $M
LCP=/tmp/llamacpp-sm90; export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
pack() { tar cf $OUT/all.tar -C /tmp/m m1; }
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
timeout $(left 170) python3 -m pytest -q -p no:cacheprovider --backend cuda tests/backends/test_gather.py \
  tests/scheduler/test_copy_paths.py tests/engine/test_decode_lookahead.py > $M/pytest.txt 2>&1; stamp "pytest rc $?"
ours=(python3 -m expertstream bench --backend cuda --slots 3 --host-memory pinned -o json)
for spec in qwen3-30b-a3b:Q4_K_M:48 gpt-oss-20b:MXFP4_MOE:24; do
  IFS=: read preset qtype n <<< "$spec"; F=/tmp/models/$preset-$qtype.gguf; h=$((n / 2))
  [ "$(left 560)" -gt 120 ] || break
  OUT=$M FILES="$preset:$qtype" bash microbench/model_h200.sh make >> $M/make.log 2>&1; stamp "make $preset"
  peak "llama-bench $preset -ncmoe $n -p 0 -n 64" timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $n \
    -lm none -fa 0 -p 0 -n 64 -r 3 -o md >> $M/llama-$preset.md 2>&1
  peak "expertstream $preset -ncmoe all -p 16 -n 64" timeout $(left 580) "${ours[@]}" -m $F -p 16 -n 64 -ncmoe all -r 3 \
    > $M/ours-$preset-all.json 2> $M/ours-$preset-all.err; stamp "$preset all"
  peak "llama-bench $preset -ncmoe $n -p 512 -n 0" timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $n \
    -lm none -fa 0 -p 512 -n 0 -r 1 -o md >> $M/llama-$preset.md 2>&1
  peak "expertstream $preset -ncmoe all -p 512 -n 64" timeout $(left 580) "${ours[@]}" -m $F -p 512 -n 64 -ncmoe all -r 1 \
    > $M/ours-$preset-p512.json 2> $M/ours-$preset-p512.err; stamp "$preset p512"
  [ "$(left 560)" -gt 90 ] || continue
  timeout $(left 580) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $h -lm none -fa 0 -p 0 -n 64 -r 3 -o md >> $M/llama-$preset.md 2>&1
  timeout $(left 580) "${ours[@]}" -m $F -p 16 -n 64 -ncmoe $h -r 3 > $M/ours-$preset-half.json 2> $M/ours-$preset-half.err
  stamp "$preset half"
done
tail -3 $M/pytest.txt; cat $M/times.txt $M/memory.txt; grep -h "| *tg64\|pp512" $M/llama-*.md
python3 - $M/ours-*.json <<'PY'
import json, sys
for name in sys.argv[1:]:
    try:
        rows = json.load(open(name))["rows"]
    except Exception as exc:
        print(name, "unread:", exc); continue
    for r in rows:
        m = r["device_memory"]
        print(f"{name.split('/')[-1]:28} ncmoe {str(r.get('n_cpu_moe')):>4} p{r['tokens']} tg{r['decode_steps']}: "
              f"{r['decode_tokens_per_s']:6.1f} +- {r['decode_tokens_per_s_sd'] or 0:4.1f} t/s "
              f"{r['decode_link_pct'] or 0:5.1f}% of link {(r['decode_sha256'] or '-')[:12]} staging {m['staging'] / 2**20:6.0f} MiB used {r['device_used_bytes'] / 2**20:6.0f} MiB")
PY
