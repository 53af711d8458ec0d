# Call B3: tune with the whole 48-layer file (it now times decode's copies both ways and records the
# faster), then tg64 with every expert in pinned host memory: auto (with the tuned profile) and dma.
[ -d /tmp/site/gguf ] || pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m/b3; mkdir -p $M; pack() { tar cf $OUT/all.tar -C /tmp/m b3; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
git rev-parse --short HEAD > $M/tree.txt 2>/dev/null; git status --short >> $M/tree.txt 2>/dev/null
F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf; ls -la $F > $M/model.txt 2>&1
[ -f $F ] || { mkdir -p /tmp/models; python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F > $M/make.txt 2>&1; stamp make; }
timeout 200 python3 -m expertstream tune --backend cuda -m $F -o $M/tuned.json > $M/tune.txt 2>&1; stamp tune
for how in auto dma; do
  extra="--decode-copies dma"; [ $how = auto ] && extra="--predict $M/tuned.json"
  timeout $(left 560) python3 -m expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe all -r 3 $extra -o json > $M/tg64-$how.json 2> $M/tg64-$how.err
  python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
for r in d['rows']: print('tg64 pinned every expert', sys.argv[2], d['decode_copies'], round(r['decode_tokens_per_s'],1), '+-', round(r['decode_tokens_per_s_sd'] or 0,1), r['decode_sha256'][:12])
" $M/tg64-$how.json $how 2>&1 | tee -a $M/summary.txt; stamp "tg64 $how"
done
cat $M/times.txt; grep -E "decode copies|H2D|phases|written" $M/tune.txt; cat $M/summary.txt
