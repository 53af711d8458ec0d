# Call p2, after m1 on the same machine (its files in /tmp/models), where that machine is an H200: the
# prefill rows the H200 alone is asked for, on the 48-layer qwen3-30b-a3b Q4_K_M file: layer-major
# pp32768 with every expert streamed and with everything on the GPU beside llama-bench -ncmoe 48 and
# -ncmoe 0 (same -p/-b/-ub), and pp4096 at ubatch 512 with everything on the GPU beside llama-bench.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m/p2; mkdir -p $M
LCP=/tmp/llamacpp-sm90
pack() { tar cf $OUT/all.tar -C /tmp/m p2; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; date -u; } > $M/gpu.txt
cp docs/results/decode-packed/tree.txt $M/tree.txt
( [ -x $LCP/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp )
OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" bash microbench/model_h200.sh make > $M/make.log 2>&1; stamp make
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf
ours=(python3 -m expertstream bench -m $F --backend cuda -n 0 --slots 3 --host-memory pinned -o json)
timeout $(left 250) "${ours[@]}" -p 32768 -ub 4096 -ncmoe all,0 --prefill-order layer -r 2 > $M/ours-pp32768.json \
  2> $M/ours-pp32768.err; stamp "ours pp32768"
timeout $(left 300) "${ours[@]}" -p 4096 -ub 512 -ncmoe 0 -r 3 > $M/ours-pp4096-ub512.json 2> $M/ours-pp4096-ub512.err
stamp "ours ub512"
export LD_LIBRARY_PATH=$LCP/bin
timeout $(left 340) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 4096 -n 0 -b 4096 -ub 512 -r 3 -o md \
  > $M/llama-pp4096-ub512.md 2>&1; stamp "llama ub512"
timeout $(left 420) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 0 -lm none -fa 0 -p 32768 -n 0 -b 32768 -ub 4096 -r 2 -o md \
  > $M/llama-pp32768.md 2>&1; stamp "llama pp32768 -ncmoe 0"
timeout $(left 590) $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe 48 -lm none -fa 0 -p 32768 -n 0 -b 32768 -ub 4096 -r 2 -o md \
  >> $M/llama-pp32768.md 2>&1; stamp "llama pp32768 -ncmoe 48"
cat $M/times.txt; grep -h "pp" $M/llama-*.md
python3 - $M/ours-*.json <<'PY'
import json, sys
for name in sys.argv[1:]:
    try:
        rows = json.load(open(name))["rows"]
    except Exception as exc:
        print(name, "unread:", exc); continue
    for r in rows:
        print(f"{name.split('/')[-1]:26} ncmoe {str(r.get('n_cpu_moe')):>4} pp{r['tokens']} ub{r['ubatch']} "
              f"{r.get('prefill_order')}: {r['prefill_tokens_per_s']:8.0f} +- {r['prefill_tokens_per_s_sd'] or 0:5.0f} t/s "
              f"{(r['prefill_sha256'] or '-')[:12]}")
PY
