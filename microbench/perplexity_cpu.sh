#!/usr/bin/env bash
# expertstream perplexity (simulator) beside llama-perplexity (llama.cpp's CPU build) on make-model's tiny preset
# of every first-group architecture (Q8_0, seed 3), or with SECOND set deepseek2's and qwen3next's: docs/design.md
# as the text, chunks of 128 tokens, 8 chunks. Results: docs/results/model-cpu.md.
# usage: [SECOND=1] microbench/perplexity_cpu.sh LLAMA_PERPLEXITY WORK_DIR     (from the repository root)
set -euo pipefail
tool=${1:?usage: perplexity_cpu.sh LLAMA_PERPLEXITY WORK_DIR}
work=${2:?usage: perplexity_cpu.sh LLAMA_PERPLEXITY WORK_DIR}
export PYTHONPATH=.
export LD_LIBRARY_PATH=$(dirname "$tool"):${LD_LIBRARY_PATH:-}
mkdir -p "$work"
presets="tiny tiny-mixtral tiny-qwen2moe tiny-gpt-oss tiny-glm4moe"
[[ -n ${SECOND:-} ]] && presets="tiny-deepseek2 tiny-qwen3next"
for preset in $presets; do
    model=$work/$preset.gguf
    [ -f "$model" ] || python3 -m expertstream make-model --preset "$preset" --type Q8_0 --seed 3 -o "$model" >/dev/null
    # --no-repack: ggml's repacked CPU matmuls crash on this machine's AMX (the weights are the same either way)
    "$tool" -m "$model" -f docs/design.md -c 128 --chunks 8 -t 2 --no-repack >"$work/$preset-llama.txt" 2>&1
    python3 -m expertstream perplexity -m "$model" -f docs/design.md -c 128 --chunks 8 --backend sim \
        >"$work/$preset-ours.txt" 2>&1
    llama=$(grep -o "PPL = [0-9.]*" "$work/$preset-llama.txt" | tail -1 | cut -d' ' -f3)
    ours=$(grep -o "PPL = [0-9.]*" "$work/$preset-ours.txt" | tail -1 | cut -d' ' -f3)
    python3 -c "import sys; l, o = map(float, sys.argv[2:]); print(f'{sys.argv[1]}: llama-perplexity {l:.4f}, expertstream {o:.4f}, difference {100 * (o / l - 1):+.3f}%')" \
        "$preset" "$llama" "$ours"
done
