#!/usr/bin/env bash
# llamacpp-logits on make-model's tiny files: the prompt decoded U tokens at a time plus G greedy
# steps, against the same N+G tokens decoded as one ubatch. Rows must agree (the same tokens at the
# same positions); prints compare.py's summary per file and flash-attention setting.
# usage: selfcheck.sh LLAMACPP_LOGITS WORK_DIR [PRESETS...]   (from the repository root)
set -euo pipefail
tool=${1:?usage: selfcheck.sh LLAMACPP_LOGITS WORK_DIR [PRESETS...]}
work=${2:?usage: selfcheck.sh LLAMACPP_LOGITS WORK_DIR [PRESETS...]}
shift 2
presets=${*:-tiny tiny-mixtral tiny-qwen2moe tiny-gpt-oss tiny-deepseek2 tiny-glm4moe tiny-qwen3next}
export PYTHONPATH=.
mkdir -p "$work"
for preset in $presets; do
    model="$work/$preset.gguf"
    [ -f "$model" ] || python3 -m expertstream make-model --preset "$preset" --type Q8_0 -o "$model" >/dev/null
    # The prompt: the start of make-model's own corpus in the file's vocabulary.
    python3 -c "import sys; from expertstream.engine.tokenizer import Tokenizer as T; \
text = open('expertstream/model/corpus.txt', encoding='utf-8').read()[:600]; \
print(*T.from_path(sys.argv[1]).encode(text), sep='\n')" "$model" >"$work/$preset.prompt"
    for fa in off on; do
        "$tool" -m "$model" --tokens "$work/$preset.prompt" --n-prompt 64 --n-gen 16 --ubatch 32 --fa "$fa" \
            -o "$work/$preset-$fa-steps" >/dev/null
        "$tool" -m "$model" --tokens "$work/$preset-$fa-steps.tokens" --n-prompt 80 --n-gen 0 --ubatch 80 --fa "$fa" \
            -o "$work/$preset-$fa-whole" >/dev/null
        echo "== $preset, --fa $fa: 64 prompt (ubatch 32) + 16 greedy steps vs the 80 tokens as one ubatch"
        python3 -m microbench.llamacpp_logits.compare "$work/$preset-$fa-steps" "$work/$preset-$fa-whole"
    done
done
