#!/usr/bin/env bash
# Mode disk on the 48-layer qwen3-30b-a3b Q4_K_M file with the process and its page cache held under a
# cgroup v2 memory limit, beside llama.cpp -lm mmap under the same limit, on one GPU machine as root.
# Results: docs/results/disk-h200.md (an H200 machine's run, cut short, and an H100 machine's, in three calls).
#
# usage: OUT=DIR [LIMIT=8G] [ROW_S=150] [ROWS="..."] bash microbench/disk_h200.sh   (from the repository root)
#   1. microbench/model_h200.sh setup make: llama.cpp unpacked, the 48-layer file made in $MODELS;
#   2. the drive's own rate: microbench.disk_read, O_DIRECT at 1, 4 and 16 reads in flight, page cache dropped;
#      then KvikIO's reads into device memory at 1, 4 and 16 threads (microbench.kvikio_read), where its
#      wheels lie in .dev/kvikio;
#   3. under the limit, the page cache dropped before each row (each at most ROW_S seconds): pp4096 of
#      expertstream --host-memory disk (one ubatch of 4096) and of llama-bench -ncmoe 48 -lm mmap; pp32768
#      of both (expertstream at ubatch 4096, layer-major: mode disk's default); expertstream tg64, and with
#      --host-cache 4G (the decode tier's hit rate); llama-bench tg64;
#   4. the limit lifted and the file in the page cache: pp4096 through ring and through disk.
# llama-bench runs without its warm-up pass (--no-warmup): under the limit a warm-up leaves nothing cached
# for the measured pass, it only doubles the row's time.
# ROWS names the rows of 3 and 4 to run, in order (default: all, in the order above); beside those,
# disk-pp4096-t16p16 and disk-pp4096-t24p16 are the pp4096 row with the ring's reads made by 16 or 24
# threads in parts of 16 MiB (16 chunks of 32 MiB for 24), and disk-pp4096-ub512 and llama-mmap-pp4096-ub512
# the pp4096 rows at ubatch 512, llama.cpp's default (eight ubatches: expertstream layer-major).
# Writes $OUT/summary.txt (one line a row) and $OUT/raw/ (every command's output).
set -uo pipefail
LIMIT=${LIMIT:-8G}
ROW_S=${ROW_S:-150}  # seconds a row may take; llama.cpp's rows under the limit can take far longer
MODELS=${MODELS:-/tmp/models}
source microbench/summary.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; free -g | head -2
  df -h "$MODELS" 2>/dev/null | tail -1; } | tee "$S"
OUT=$R MODELS=$MODELS bash microbench/model_h200.sh setup make >"$R/make.log" 2>&1
F=$MODELS/qwen3-30b-a3b-Q4_K_M.gguf
el "file: $(stat -c %s "$F") bytes"
CG=/sys/fs/cgroup/expertstream-disk
echo "+memory" >/sys/fs/cgroup/cgroup.subtree_control 2>>"$R/cgroup.txt"
mkdir -p $CG && echo "$LIMIT" >$CG/memory.max && { echo 0 >$CG/memory.swap.max 2>/dev/null || true; }
el "cgroup $CG: memory.max $(cat $CG/memory.max)"
limited() { sh -c "echo \$\$ > $CG/cgroup.procs && exec \"\$@\"" sh "$@"; }
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
row() {  # JSON: one line per row
    python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['host_memory'], r.get('prefill_order'), 'pp', r['tokens'], round(r['prefill_tokens_per_s'] or 0),
          'tg', round(r['decode_tokens_per_s'] or 0, 1), 'disk GB', round((r.get('disk_bytes_read') or 0) / 1e9, 1),
          'hit', r.get('host_cache_hit_pct'), r.get('decode_host_cache_hit_pct'), (r.get('prefill_sha256') or '')[:12])
" "$1" 2>&1 | tr '\n' ';'
}
bench() {  # NAME ARGS...: expertstream bench under the limit, the page cache dropped first
    local name=$1; shift
    drop
    limited timeout "$ROW_S" python3 -m expertstream bench -m "$F" --backend cuda --slots 3 -ncmoe all -r 1 -o json "$@" \
        >"$R/$name.json" 2>"$R/$name.err"
    el "$name (limit $LIMIT): $(row "$R/$name.json") cgroup peak $(cat $CG/memory.peak 2>/dev/null)"
}
drop
timeout 120 python3 -m microbench.disk_read --file "$F" --depths 1 4 16 --gib 2 >"$R/disk-read.txt" 2>&1
el "drive: $(tail -4 "$R/disk-read.txt" | tr '\n' ' ')"
# KvikIO (cuFile, or its POSIX compatibility mode where GPUDirect Storage is not there) from the same drive
# into device memory, beside the ring; its wheels are carried in .dev/kvikio (the project does not install it)
if ls .dev/kvikio/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvsite .dev/kvikio/*.whl >"$R/kvikio.txt" 2>&1
    for n in 1 4 16; do
        drop
        KVIKIO_NTHREADS=$n PYTHONPATH=/tmp/kvsite:${PYTHONPATH:-} timeout 90 python3 -m microbench.kvikio_read --file "$F" \
            --gib 2 >>"$R/kvikio.txt" 2>&1
        el "kvikio, $n threads: $(tail -1 "$R/kvikio.txt")"
    done
fi
# kernels compiled once outside the limit: the kernel cache serves the limited runs
timeout 300 python3 -m expertstream bench -m "$F" --backend cuda -p 512 -n 2 --slots 3 --host-memory disk -ncmoe all \
    -r 1 -o json >"$R/warm.json" 2>"$R/warm.err"
export LD_LIBRARY_PATH=/tmp/llamacpp-sm90/bin:${LD_LIBRARY_PATH:-}
LB=/tmp/llamacpp-sm90/bin/llama-bench
llama() {  # NAME UBATCH ARGS...: llama-bench -ncmoe 48 -lm mmap under the limit, the page cache dropped first
    local name=$1 ub=$2; shift 2
    drop
    limited timeout "$ROW_S" $LB -m "$F" -ngl 99 -ncmoe 48 -lm mmap -fa 0 -b "$ub" -ub "$ub" -r 1 --no-warmup -o md "$@" \
        >"$R/$name.md" 2>&1
    local rc=$?
    el "$name (limit $LIMIT): $(grep -E '\| *(pp|tg)[0-9]+ ' "$R/$name.md" | awk -F'|' '{print $(NF-2), $(NF-1)}' | tr '\n' ' ')$(
        [ $rc = 124 ] && echo "did not finish in $ROW_S s")"
}
# the rows most worth having first: a run that meets its time limit keeps what came before. The prompts
# first (the 5x target), then decode, then the file cached; llama.cpp's decode under the limit is slow
# (every token faults its experts in), so it runs after expertstream's.
pp4096="--host-memory disk -p 4096 -ub 4096 -n 0"
run_row() {  # NAME
    case $1 in
    disk-pp4096) bench $1 $pp4096 ;;
    disk-pp4096-t16p16) bench $1 $pp4096 --ring-threads 16 --ring-part-mib 16 ;;
    disk-pp4096-t24p16) bench $1 $pp4096 --ring-threads 24 --ring-part-mib 16 --ring-chunks 16 ;;
    llama-mmap-pp4096) llama $1 4096 -p 4096 -n 0 ;;
    disk-pp4096-ub512) bench $1 --host-memory disk -p 4096 -ub 512 -n 0 ;;
    llama-mmap-pp4096-ub512) llama $1 512 -p 4096 -n 0 ;;
    disk-pp32768) bench $1 --host-memory disk -p 32768 -ub 4096 -n 0 ;;
    llama-mmap-pp32768) llama $1 4096 -p 32768 -n 0 ;;
    disk-tg64) bench $1 --host-memory disk -p 16 -n 64 ;;
    disk-cache4g-tg64) bench $1 --host-memory disk --host-cache 4G -p 16 -n 64 ;;
    llama-mmap-tg64) llama $1 4096 -p 0 -n 64 ;;
    cached)
        cat "$F" >/dev/null  # the limit lifted: the file in the page cache
        for mode in ring disk; do
            timeout "$ROW_S" python3 -m expertstream bench -m "$F" --backend cuda -p 4096 -ub 4096 -n 0 --slots 3 \
                --host-memory $mode -ncmoe all -r 2 -o json >"$R/$mode-cached-pp4096.json" 2>"$R/$mode-cached-pp4096.err"
            el "$mode pp4096 (no limit, file cached): $(row "$R/$mode-cached-pp4096.json")"
        done ;;
    *) el "no row named $1" ;;
    esac
}
for name in ${ROWS:-disk-pp4096 llama-mmap-pp4096 disk-pp32768 llama-mmap-pp32768 disk-tg64 disk-cache4g-tg64 \
    llama-mmap-tg64 cached}; do
    run_row "$name"
done
