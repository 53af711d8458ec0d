#!/usr/bin/env bash
# Decode round 8 on one GPU: the 48-layer qwen3-30b-a3b Q4_K_M file and gpt-oss-20b MXFP4_MOE beside
# llama.cpp.
#
#   [BASE=DIR] OUT=DIR bash docs/results/decode-round8/run.sh STAGE...    (from the repository root)
#
# BASE: a checkout of the round's start, for the rows named base (skipped without it). Stages (each
# writes its rows into $OUT/summary.txt, every command's output under $OUT/raw/):
#   make      llama.cpp's prebuilt archive and both files (in the background), the matrix-vector and
#             dense kernel tests on the GPU meanwhile (TESTS_S seconds, default 200; TESTS_K: pytest -k)
#   make-oss  the same with gpt-oss-20b alone
#   host      tg64 with every expert of the qwen3 file in pinned host memory: the device's gather, then
#             the experts' kernels reading host memory in place (EXPERTSTREAM_DECODE_READ_HOST=1, a
#             trial in commit cd511d5 only: slower, taken back); llama-bench -ncmoe 48 -lm none
#   gpu       tg64, everything on the GPU: both files, expertstream and llama-bench
#   more      partial offload (-ncmoe 24; --gpu-memory 24G), mmap beside -lm mmap, tg256 on the GPU, and
#             gpt-oss-20b's host rows
#   oss       gpt-oss-20b: tg64 and tg256 on the GPU, tg64 with half the layers' experts in pinned host
#             memory (-ncmoe 12), this tree, base and llama-bench
#   oss-profile  one decode step of gpt-oss-20b, each launch also timed alone (decode_profile), this
#             tree and base
#   qwen3-logits  the same as oss-logits on the 48-layer qwen3 file (made here), and llama.cpp's CPU
#             perplexity beside
#   oss-kl    gpt-oss-20b's KL from llama.cpp CUDA by runs of 64 positions (ours and llama.cpp CPU), and
#             perplexity at -c 128 (inside the sliding window) beside llama-perplexity
#   oss-logits   gpt-oss-20b's logits (512-token prompt, 64 greedy steps) against llama.cpp CUDA, with
#             llama.cpp CPU beside them, and perplexity beside llama-perplexity (microbench/model_h200.sh
#             setup and big)
set -uo pipefail
source microbench/summary.sh
source microbench/decode_rows.sh
G=/tmp/models/gpt-oss-20b-MXFP4_MOE.gguf

ours() {  # [base] NAME FILE SECONDS ARGS...: expertstream bench -p 16 --slots 3 -r 3 ARGS (in $BASE after base)
    local where=.
    if [ "$1" = base ]; then
        [ -n "${BASE:-}" ] || return 0
        where=$BASE
        shift
    fi
    local name=$1 file=$2 t=$3
    shift 3
    (cd "$where" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout "$t" python3 -m expertstream bench -m "$file" \
        --backend cuda -p 16 --slots 3 -r 3 -o json "$@") >"$R/$name.json" 2>"$R/$name.err"
    el "$name: $(python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['host_memory'], 'ncmoe', r.get('n_cpu_moe'), 'tg', r['decode_steps'], round(r['decode_tokens_per_s'], 1),
          '+-', round(r['decode_tokens_per_s_sd'] or 0, 1), 'step', round(r['decode_median_step_ms'], 3), 'ms',
          r['decode_sha256'][:12], 'link limit', round(r.get('decode_link_limit_tokens_per_s') or 0, 1),
          'device MiB', round((r.get('device_used_bytes') or 0) / 2**20))
" "$R/$name.json" 2>&1 | tail -3)"
}

profile() {  # [base] NAME FILE: one decode step of FILE, each launch also timed alone
    local where=.
    if [ "$1" = base ]; then
        [ -n "${BASE:-}" ] || return 0
        where=$BASE
        shift
    fi
    (cd "$where" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout 150 python3 -m microbench.decode_profile --backend cuda \
        --model "$2" -p 512 -n 12 --top 40 -ncmoe 0 --alone) >"$R/profile-$1.txt" 2>&1
    el "profile $1: $(grep -E 'one decode step' "$R/profile-$1.txt" | tail -1)"
}

llama() {  # NAME FILE ARGS...: llama-bench -p 0 -r 3 with ARGS, its tg rows into the summary
    local name=$1 file=$2
    shift 2
    LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-} timeout 200 $LCP/bin/llama-bench -m "$file" -ngl 99 -fa 0 -p 0 \
        -r 3 -o md "$@" >"$R/llama-$name.md" 2>&1
    el "llama $name: $(grep -E '\| +tg' "$R/llama-$name.md" | awk -F'|' '{print $(NF-1)}' | tr '\n' ' ')"
}

for stage in "$@"; do
    case $stage in
    make | make-oss)
        { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee -a "$S"
        mkdir -p /tmp/models
        [ -x $LCP/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp &
        [ -f $F ] || [ $stage = make-oss ] ||
            python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o $F >"$R/make-qwen3.log" 2>&1 &
        [ -f $G ] || python3 -m expertstream make-model --preset gpt-oss-20b --type MXFP4_MOE -o $G >"$R/make-gpt-oss.log" 2>&1 &
        timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_gemv.py \
            tests/kernels/test_dense.py -k "${TESTS_K:-}" >"$R/tests-cuda.txt" 2>&1
        el "kernel tests on the GPU: $(grep -E 'passed|failed|error' "$R/tests-cuda.txt" | tail -1)"
        wait
        el "models: $(ls -la $F $G 2>&1 | awk '{print $5, $9}' | tr '\n' ' ')" ;;
    gpu)
        ours qwen3-gpu $F 150 -n 64 -ncmoe 0
        llama qwen3-gpu $F -n 64 -ncmoe 0 -lm none
        ours gpt-oss-gpu $G 150 -n 64 -ncmoe 0
        llama gpt-oss-gpu $G -n 64 -ncmoe 0 -lm none ;;
    host)
        ours qwen3-host $F 150 -n 64 -ncmoe 48 --host-memory pinned
        EXPERTSTREAM_DECODE_READ_HOST=1 ours qwen3-host-in-place $F 150 -n 64 -ncmoe 48 --host-memory pinned
        llama qwen3-host $F -n 64 -ncmoe 48 -lm none ;;
    more)
        ours qwen3-half $F 150 -n 64 -ncmoe 24 --host-memory pinned
        llama qwen3-half $F -n 64 -ncmoe 24 -lm none
        ours qwen3-24g $F 150 -n 64 --gpu-memory 24G --host-memory pinned
        ours qwen3-mmap $F 150 -n 64 -ncmoe 48 --host-memory mmap
        llama qwen3-mmap $F -n 64 -ncmoe 48 -lm mmap
        ours qwen3-gpu-tg256 $F 150 -n 256 -ncmoe 0
        llama qwen3-gpu-tg256 $F -n 256 -ncmoe 0 -lm none
        ours gpt-oss-host $G 150 -n 64 -ncmoe 24 --host-memory pinned
        llama gpt-oss-host $G -n 64 -ncmoe 24 -lm none ;;
    oss)
        ours gpt-oss-gpu $G 150 -n 64 -ncmoe 0
        ours base gpt-oss-gpu-base $G 150 -n 64 -ncmoe 0
        llama gpt-oss-gpu $G -n 64 -ncmoe 0 -lm none
        ours gpt-oss-gpu-tg256 $G 150 -n 256 -ncmoe 0
        llama gpt-oss-gpu-tg256 $G -n 256 -ncmoe 0 -lm none
        ours gpt-oss-half $G 150 -n 64 -ncmoe 12 --host-memory pinned
        ours base gpt-oss-half-base $G 150 -n 64 -ncmoe 12 --host-memory pinned
        llama gpt-oss-half $G -n 64 -ncmoe 12 -lm none ;;
    oss-profile)
        profile gpt-oss $G
        profile base gpt-oss-base $G ;;
    oss-logits)
        OUT=$R FILES=gpt-oss-20b:MXFP4_MOE bash microbench/model_h200.sh setup big >"$R/big.log" 2>&1
        el "logits: $(cat "$R/logits.txt" 2>&1 | tr '\n' ' ')"
        el "perplexity: $(cat "$R/ppl.txt" 2>&1 | tr '\n' ' ')" ;;
    oss-kl)  # after oss-logits (its llamacpp-logits build): KL by position, and perplexity at -c 128
        dir=$R/kl
        mkdir -p "$dir"
        export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
        [ -x /tmp/llamacpp-logits ] || bash microbench/llamacpp_logits/build.sh $LCP /tmp/llamacpp-logits >/dev/null
        python3 -m microbench.llamacpp_logits.prompt $G 512 >"$dir/prompt"
        /tmp/llamacpp-logits -m $G --tokens "$dir/prompt" --n-prompt 512 --n-gen 64 --ngl 99 -o "$dir/cuda" >"$dir/cuda.log" 2>&1
        # llama.cpp's CPU backend with no GPU visible (with -ngl 0 alone it still multiplies a prompt's
        # batches on the GPU)
        CUDA_VISIBLE_DEVICES= /tmp/llamacpp-logits -m $G --tokens "$dir/cuda.tokens" --n-prompt 576 --n-gen 0 --ngl 0 \
            -o "$dir/cpu" >"$dir/cpu.log" 2>&1
        python3 tools/logits_check.py -m $G --ref "$dir/cuda" -o "$dir/ours" --backend cuda >"$dir/ours.txt" 2>&1
        for other in ours cpu; do
            python3 -m microbench.llamacpp_logits.compare "$dir/cuda" "$dir/$other" --by 64 >"$dir/kl-$other.txt" 2>&1
            el "KL by position, $other vs llama.cpp CUDA: $(tr '\n' ';' <"$dir/kl-$other.txt")"
        done
        rm -f "$dir"/*.logits
        LD_LIBRARY_PATH=$LCP/bin $LCP/bin/llama-perplexity -m $G -f docs/design.md -c 128 --chunks 16 -ngl 99 -fa off \
            >"$R/ppl128-llama.txt" 2>&1
        el "llama-perplexity -c 128: $(grep -E 'Final estimate' "$R/ppl128-llama.txt")"
        python3 -m expertstream perplexity -m $G -f docs/design.md -c 128 --chunks 16 --backend cuda >"$R/ppl128-ours.txt" 2>&1
        el "expertstream perplexity -c 128: $(tail -1 "$R/ppl128-ours.txt")"
        for c in 128 512; do  # llama.cpp's own spread: its CPU backend (no GPU visible) on the same text
            CUDA_VISIBLE_DEVICES= $LCP/bin/llama-perplexity -m $G -f docs/design.md -c $c --chunks $((2048 / c)) -ngl 0 \
                -fa off >"$R/ppl$c-llama-cpu.txt" 2>&1
            el "llama-perplexity -c $c on the CPU: $(grep -E 'Final estimate' "$R/ppl$c-llama-cpu.txt")"
        done ;;
    qwen3-logits)  # the 48-layer qwen3 file made and checked as oss-logits checks gpt-oss-20b, with
        # llama.cpp's CPU perplexity (no GPU visible) beside
        OUT=$R FILES=qwen3-30b-a3b:Q4_K_M bash microbench/model_h200.sh setup make big >"$R/big-qwen3.log" 2>&1
        el "logits: $(cat "$R/logits.txt" 2>&1 | tr '\n' ' ')"
        el "perplexity: $(cat "$R/ppl.txt" 2>&1 | tr '\n' ' ')"
        CUDA_VISIBLE_DEVICES= LD_LIBRARY_PATH=$LCP/bin $LCP/bin/llama-perplexity -m $F -f docs/design.md -c 512 --chunks 4 \
            -ngl 0 -fa off >"$R/ppl512-llama-cpu-qwen3.txt" 2>&1
        el "llama-perplexity -c 512 on the CPU: $(grep -E 'Final estimate' "$R/ppl512-llama-cpu-qwen3.txt")" ;;
    esac
done
