#!/usr/bin/env bash
# expertstream's logits on the simulator against llama.cpp's CPU build, on make-model's tiny presets of every
# architecture run end to end (Q8_0, seed 3) and a 2-layer qwen3-30b-a3b Q4_K_M file: a 512-token prompt (128 for
# the 2-layer file) and 64 greedy steps (8) that llama.cpp chose, fed to both. Prints tools/logits_check.py's
# summary per file. With SECOND set, only the second group's files instead: the tiny deepseek2 and qwen3next
# presets, and the real shapes of DeepSeek-V2-Lite (2 layers, Q4_K_M: a dense layer, then MoE; 576-wide
# latent keys) and Qwen3-Next-80B-A3B (4 layers, Q4_0: three delta-net layers, then gated attention).
# With OSS set, only gpt-oss-20b's shape (MXFP4 experts, sinks, the 128-token window) at 2 and 8 layers:
# a 256-token prompt and 16 greedy steps, to see how far the two part over depth on random weights, then
# llama.cpp CPU with flash attention on against itself with it off, on the same tokens (its own rounding spread).
# Results: docs/results/model-cpu.md.
# With CALM=S set, gpt-oss-20b's shape written at residual scale S (make-model --residual-scale) and at 1:
# llama.cpp CPU with flash attention on against off at 8 and 24 layers, and expertstream against llama.cpp
# at 8 layers of scale S (the simulator is too slow for 24 here).
# usage: [SECOND=1 | OSS=1 | CALM=S] microbench/logits_cpu.sh LLAMACPP_LOGITS WORK_DIR     (from the repository root)
set -euo pipefail
tool=${1:?usage: logits_cpu.sh LLAMACPP_LOGITS WORK_DIR}
work=${2:?usage: logits_cpu.sh LLAMACPP_LOGITS WORK_DIR}
export PYTHONPATH=.
mkdir -p "$work"
make_file() {  # NAME PRESET TYPE LAYERS [RESIDUAL_SCALE]
    local model=$work/$1.gguf
    [ -f "$model" ] || python3 -m expertstream make-model --preset "$2" --type "$3" --seed 3 ${4:+--layers "$4"} \
        --residual-scale "${5:-1}" -o "$model" >/dev/null
}
llama_cpu() {  # NAME N_PROMPT N_GEN [UBATCH]: a prompt from the corpus, then llama.cpp CPU's greedy steps
    python3 -m microbench.llamacpp_logits.prompt "$work/$1.gguf" "$2" >"$work/$1.prompt"
    "$tool" -m "$work/$1.gguf" --tokens "$work/$1.prompt" --n-prompt "$2" --n-gen "$3" --ngl 0 ${4:+--ubatch "$4"} \
        -o "$work/$1-llama-cpu" >"$work/$1-llama-cpu.log" 2>&1
}
ours() {  # NAME UBATCH: expertstream on the simulator over llama.cpp's tokens
    python3 tools/logits_check.py -m "$work/$1.gguf" --ref "$work/$1-llama-cpu" -o "$work/$1-ours" --backend sim \
        --ubatch "$2" | sed "s/^/$1 (ubatch $2): /"
}
check() {  # NAME PRESET TYPE LAYERS N_PROMPT N_GEN UBATCH
    make_file "$1" "$2" "$3" "$4"
    llama_cpu "$1" "$5" "$6"
    ours "$1" "$7"
}
fa_on() {  # NAME N_TOKENS UBATCH: llama.cpp CPU again on the same tokens with flash attention on, against itself
    local name=$1
    "$tool" -m "$work/$name.gguf" --tokens "$work/$name-llama-cpu.tokens" --n-prompt "$2" --n-gen 0 --ngl 0 \
        --ubatch "$3" --fa on -o "$work/$name-llama-cpu-fa" >"$work/$name-llama-cpu-fa.log" 2>&1
    python3 -m microbench.llamacpp_logits.compare "$work/$name-llama-cpu" "$work/$name-llama-cpu-fa" \
        | sed "s/^/$name llama.cpp CPU, flash attention on against off: /"
}
ours_every() {  # NAME: expertstream against llama.cpp CPU over every position
    python3 -m microbench.llamacpp_logits.compare "$work/$1-llama-cpu" "$work/$1-ours" \
        | sed "s/^/$1 expertstream against llama.cpp CPU (flash attention off), every position: /"
}
fa_control() {  # NAME N_TOKENS UBATCH
    fa_on "$@"
    ours_every "$1"
}
if [[ -n ${OSS:-} ]]; then
    check gpt-oss-20b-2L gpt-oss-20b MXFP4_MOE 2 256 16 64
    check gpt-oss-20b-8L gpt-oss-20b MXFP4_MOE 8 256 16 64
    # llama.cpp's own spread on the same tokens: the size of a rounding change after 2 and 8 such layers
    fa_control gpt-oss-20b-2L 272 64
    fa_control gpt-oss-20b-8L 272 64
    exit 0
fi
if [[ -n ${CALM:-} ]]; then
    for layers in 8 24; do
        for scale in 1 "$CALM"; do
            name=gpt-oss-20b-${layers}L-r$scale
            make_file "$name" gpt-oss-20b MXFP4_MOE "$layers" "$scale"
            llama_cpu "$name" 256 16 64
            fa_on "$name" 272 64
            [ "$layers" = 8 ] || rm -f "$work/$name.gguf"  # 11 GB; only the 8-layer files run again below
        done
    done
    ours "gpt-oss-20b-8L-r$CALM" 64
    ours_every "gpt-oss-20b-8L-r$CALM"
    exit 0
fi
if [[ -n ${SECOND:-} ]]; then
    for preset in tiny-deepseek2 tiny-qwen3next; do
        check "$preset" "$preset" Q8_0 "" 512 64 512
    done
    check deepseek-v2-lite-2L deepseek-v2-lite Q4_K_M 2 128 8 64
    check qwen3-next-80b-a3b-4L qwen3-next-80b-a3b Q4_0 4 128 8 64
    exit 0
fi
for preset in tiny tiny-mixtral tiny-qwen2moe tiny-gpt-oss tiny-glm4moe; do
    check "$preset" "$preset" Q8_0 "" 512 64 512
done
check tiny-ub64 tiny Q8_0 "" 512 64 64
check qwen3-30b-a3b-2L qwen3-30b-a3b Q4_K_M 2 128 8 64
