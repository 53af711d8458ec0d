#!/usr/bin/env bash
# The whole model on a GPU beside llama.cpp on the same files: logits, perplexity, prefill and decode.
# Results: docs/results/model-h200.md (raw output in docs/results/model-h200/).
#
# usage: microbench/model_h200.sh STAGE...     (from the repository root; writes under $OUT)
#   setup   unpack llama.cpp's prebuilt CUDA archive ($ARCHIVE) into /tmp and build llamacpp-logits
#   tiny    make-model's tiny presets of every architecture run end to end (Q8_0; TINY names others): a
#           512-token prompt and 64 greedy steps through llama.cpp CUDA (-ngl 99), llama.cpp CPU (-ngl 0) and
#           expertstream; KL of each from llama.cpp CUDA
#   big     the same on $FILES (made here), then llama-perplexity (CUDA, and CPU with no GPU visible) and
#           expertstream perplexity on one text
#   bench   llama-bench and expertstream bench on $FILES: pp$TOKENS at ubatch $UBATCH and tg64, every
#           expert streamed (-ncmoe all / llama.cpp -ncmoe N -lm none) and everything on the GPU (-ncmoe 0)
#   decode  llama-bench -p 0 -n $DECODE_STEPS and expertstream bench -p $DECODE_PROMPT -n $DECODE_STEPS on
#           $FILES: every expert on the host (pinned; llama.cpp -lm none), half the layers', none; with
#           DECODE_MMAP set also mmap beside -lm mmap and decode_profile's per-operation table of one step
# Every llama-bench and expertstream run is wrapped in used_memory: nvidia-smi samples the device's used
# memory every 100 ms and the run's peak goes to $OUT/memory.txt.
# Environment: ARCHIVE (.dev/llamacpp-sm90.tar.xz), MODELS (/tmp/models), OUT (.), RESIDUAL_SCALE, FILES
# ("qwen3-30b-a3b:Q4_K_M"), TOKENS (4096), UBATCH (512,2048,4096), REPS (2), LAYERS (all), DECODE_STEPS
# (64; a comma list such as 64,256 runs each), DECODE_PROMPT (16:
# the prompt before expertstream's decode steps; llama-bench's tg starts from an empty context), TAG (bench
# stage file-name suffix), PREFILL_ORDER (bench stage: expertstream's --prefill-order; default its own auto).
set -euo pipefail
ARCHIVE=${ARCHIVE:-.dev/llamacpp-sm90.tar.xz}
MODELS=${MODELS:-/tmp/models}
OUT=${OUT:-.}
FILES=${FILES:-"qwen3-30b-a3b:Q4_K_M"}
TOKENS=${TOKENS:-4096}
UBATCH=${UBATCH:-512,2048,4096}
REPS=${REPS:-2}
DECODE_PROMPT=${DECODE_PROMPT:-16}
DECODE_STEPS=${DECODE_STEPS:-64}
TAG=${TAG:-}  # appended to the bench stage's file names (e.g. -pp32768)
python=${PYTHON:-python3}
LCP=/tmp/llamacpp-sm90
export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
logits_tool=/tmp/llamacpp-logits

logits_three() {  # MODEL NAME: llama.cpp CUDA and CPU, then ours, each compared with llama.cpp CUDA
    local model=$1 name=$2 dir=$OUT/logits
    mkdir -p "$dir"
    "$python" -m microbench.llamacpp_logits.prompt "$model" 512 >"$dir/$name.prompt"
    "$logits_tool" -m "$model" --tokens "$dir/$name.prompt" --n-prompt 512 --n-gen 64 --ngl 99 -o "$dir/$name-llama-cuda" \
        >"$dir/$name-llama-cuda.log" 2>&1
    # llama.cpp's CPU backend with no GPU visible (with --ngl 0 alone a visible GPU still multiplies the
    # prompt's batches)
    CUDA_VISIBLE_DEVICES= "$logits_tool" -m "$model" --tokens "$dir/$name-llama-cuda.tokens" --n-prompt 576 --n-gen 0 \
        --ngl 0 -o "$dir/$name-llama-cpu" >"$dir/$name-llama-cpu.log" 2>&1
    "$python" tools/logits_check.py -m "$model" --ref "$dir/$name-llama-cuda" -o "$dir/$name-ours" --backend cuda \
        | sed "s/^/$name ours vs llama.cpp CUDA: /" | tee -a "$OUT/logits.txt"
    "$python" -m microbench.llamacpp_logits.compare "$dir/$name-llama-cuda" "$dir/$name-llama-cpu" \
        | sed "s/^/$name llama.cpp CPU vs CUDA: /" | tee -a "$OUT/logits.txt"
    rm -f "$dir"/*.logits  # large; the summaries and the token files stay
}

# RESIDUAL_SCALE set: make-model --residual-scale for the files of make, big, bench and decode, named with -rS
suffix=${RESIDUAL_SCALE:+-r$RESIDUAL_SCALE}
file_of() { echo "$MODELS/$1-$2$suffix.gguf"; }

used_memory() {  # NAME COMMAND...: run COMMAND, noting the device's peak used memory (MiB) under NAME
    local name=$1 log=/tmp/used-memory.$$
    shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$log" 2>/dev/null &
    local sampler=$!
    "$@"
    local status=$?
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    echo "$name: peak $(sort -n "$log" | tail -1) MiB used on the device" >>"$OUT/memory.txt"
    rm -f "$log"
    return $status
}

for stage in "$@"; do
    case $stage in
    setup)
        [ -x "$LCP/bin/llama-bench" ] || tar xJf "$ARCHIVE" -C /tmp
        bash microbench/llamacpp_logits/build.sh "$LCP" "$logits_tool" >/dev/null ;;
    tiny)
        mkdir -p "$MODELS"
        for preset in ${TINY:-tiny tiny-mixtral tiny-qwen2moe tiny-gpt-oss tiny-glm4moe tiny-deepseek2}; do
            "$python" -m expertstream make-model --preset "$preset" --type Q8_0 --seed 3 -o "$MODELS/$preset.gguf" >/dev/null
            logits_three "$MODELS/$preset.gguf" "$preset"
        done ;;
    make)
        mkdir -p "$MODELS"
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            layers=()
            [[ -n ${LAYERS:-} ]] && layers=(--layers "$LAYERS")
            [ -f "$(file_of "$preset" "$qtype")" ] && continue  # made by an earlier call on this machine
            /usr/bin/time -f "make-model %e s" "$python" -m expertstream make-model --preset "$preset" --type "$qtype" \
                "${layers[@]}" ${RESIDUAL_SCALE:+--residual-scale "$RESIDUAL_SCALE"} -o "$(file_of "$preset" "$qtype")" 2>&1 | tail -3 | tee -a "$OUT/make.txt"
        done ;;
    big)
        for spec in $FILES; do
            qtype=${spec##*:} preset=${spec%%:*}
            file=$(file_of "$preset" "$qtype")
            preset=$preset$suffix  # names the outputs
            logits_three "$file" "$preset"
            "$LCP/bin/llama-perplexity" -m "$file" -f docs/design.md -c 512 --chunks 4 -ngl 99 -fa off \
                >"$OUT/ppl-llama-$preset.txt" 2>&1 || true
            grep -E "Final estimate|^\[" "$OUT/ppl-llama-$preset.txt" | tail -2 | sed "s/^/$preset llama-perplexity: /" \
                | tee -a "$OUT/ppl.txt"
            # llama.cpp's own spread: its CPU backend with no GPU visible (with -ngl 0 alone the prompt's
            # matrix products still run on a visible GPU, giving the CUDA figure)
            CUDA_VISIBLE_DEVICES= "$LCP/bin/llama-perplexity" -m "$file" -f docs/design.md -c 512 --chunks 4 -ngl 0 \
                -fa off >"$OUT/ppl-llama-cpu-$preset.txt" 2>&1 || true
            { grep -E "Final estimate" "$OUT/ppl-llama-cpu-$preset.txt" || true; } \
                | sed "s/^/$preset llama-perplexity CPU: /" | tee -a "$OUT/ppl.txt"
            "$python" -m expertstream perplexity -m "$file" -f docs/design.md -c 512 --chunks 4 --backend cuda \
                2>&1 | tail -2 | sed "s/^/$preset expertstream perplexity: /" | tee -a "$OUT/ppl.txt"
        done ;;
    bench)
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            file=$(file_of "$preset" "$qtype")
            n=$("$python" -c "from expertstream.model import MoeModel; print(len(MoeModel.open('$file').layers))")
            for ncmoe in "$n" 0; do
                used_memory "llama-bench $preset -ncmoe $ncmoe -p $TOKENS" "$LCP/bin/llama-bench" -m "$file" -ngl 99 \
                    -ncmoe "$ncmoe" -lm none -fa 0 -p "$TOKENS" -n 64 -b "$TOKENS" -ub "$UBATCH" -r "$REPS" -o md 2>&1 \
                    | tee -a "$OUT/llama-bench-$preset$TAG.md"
            done
            order=()
            [[ -n ${PREFILL_ORDER:-} ]] && order=(--prefill-order "$PREFILL_ORDER")
            used_memory "expertstream $preset -ncmoe all,0 -p $TOKENS" "$python" -m expertstream bench -m "$file" \
                --backend cuda -p "$TOKENS" -n 64 -ub "$UBATCH" --slots 3 --host-memory pinned -ncmoe "all,0" \
                "${order[@]}" -r "$REPS" -o json >"$OUT/ours-$preset$TAG.json"
            "$python" -c "
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc['rows']:
    print(f\"{r['work']} ncmoe {str(r.get('n_cpu_moe')):>4} ub {r['ubatch']:>4}: pp {r['prefill_tokens_per_s']:8.0f} \"
          f\"+- {r['prefill_tokens_per_s_sd']:5.0f} t/s, tg {r['decode_tokens_per_s'] or 0:7.1f} t/s, \"
          f\"H2D {r['h2d_gbps']:5.1f} GB/s of {r['h2d_peak_gbps']:5.1f}, dev {r['device_bytes'] / 2**30:5.2f} GiB\")
" "$OUT/ours-$preset$TAG.json" | tee "$OUT/ours-$preset$TAG.txt"
        done ;;
    decode)
        for spec in $FILES; do
            preset=${spec%%:*} qtype=${spec##*:}
            file=$(file_of "$preset" "$qtype")
            n=$("$python" -c "from expertstream.model import MoeModel; print(len(MoeModel.open('$file').layers))")
            for ncmoe in "$n" $((n / 2)) 0; do
                used_memory "llama-bench $preset decode -ncmoe $ncmoe" "$LCP/bin/llama-bench" -m "$file" -ngl 99 \
                    -ncmoe "$ncmoe" -lm none -fa 0 -p 0 -n "$DECODE_STEPS" -r "$REPS" -o md 2>&1 | tee -a "$OUT/decode-llama-$preset.md"
            done
            used_memory "expertstream $preset decode -ncmoe all,$((n / 2)),0" "$python" -m expertstream bench \
                -m "$file" --backend cuda -p "$DECODE_PROMPT" -n "$DECODE_STEPS" --slots 3 --host-memory pinned \
                -ncmoe "all,$((n / 2)),0" -r "$REPS" -o json >"$OUT/decode-ours-$preset.json"
            results=("$OUT/decode-ours-$preset.json")
            if [[ -n ${DECODE_MMAP:-} ]]; then
                "$LCP/bin/llama-bench" -m "$file" -ngl 99 -ncmoe "$n" -lm mmap -fa 0 -p 0 -n 64 -r "$REPS" -o md 2>&1 \
                    | tee -a "$OUT/decode-llama-$preset.md"
                "$python" -m expertstream bench -m "$file" --backend cuda -p "$DECODE_PROMPT" -n 64 --slots 3 \
                    --host-memory mmap -ncmoe all -r "$REPS" -o json >"$OUT/decode-ours-mmap-$preset.json"
                results+=("$OUT/decode-ours-mmap-$preset.json")
                "$python" -m microbench.decode_profile --backend cuda --model "$file" -p "$DECODE_PROMPT" -n 16 \
                    --top 12 --json >"$OUT/decode-profile-$preset.json" 2>"$OUT/decode-profile-$preset.txt"
            fi
            "$python" -c "
import json, sys
for name in sys.argv[1:]:
    for r in json.load(open(name))['rows']:
        print(f\"{r['host_memory']:>6} ncmoe {str(r.get('n_cpu_moe')):>4} tg{r['decode_steps']:<3}: \"
              f\"{r['decode_tokens_per_s']:7.1f} +- {r['decode_tokens_per_s_sd'] or 0:4.1f} t/s ({r['decode_path']})\")
" "${results[@]}" | tee "$OUT/decode-ours-$preset.txt"
        done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
