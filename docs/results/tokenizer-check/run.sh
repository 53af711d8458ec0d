#!/usr/bin/env bash
# Compare expertstream's tokenizer with llama-tokenize on make-model files of every vocabulary kind.
# usage: bash docs/results/tokenizer-check/run.sh LLAMA_BIN_DIR WORK_DIR   (from the repository root)
set -euo pipefail
bin=${1:?usage: run.sh LLAMA_BIN_DIR WORK_DIR}
work=${2:?usage: run.sh LLAMA_BIN_DIR WORK_DIR}
here=docs/results/tokenizer-check
export PYTHONPATH=. LD_LIBRARY_PATH="$bin"
mkdir -p "$work"
presets="tiny tiny-qwen2moe tiny-qwen3next tiny-gpt-oss tiny-glm4moe tiny-deepseek2 tiny-mixtral"
for preset in $presets; do
    python3 -m expertstream make-model --preset "$preset" --type Q8_0 -o "$work/$preset.gguf" >/dev/null
done
# The same byte-level styles with 1300 tokens: more merges, so more of each split regex shows.
python3 - "$work" <<'PY'
import dataclasses, sys
from expertstream.model import get_preset, make_model
for name in ["tiny", "tiny-gpt-oss", "tiny-glm4moe"]:
    preset = dataclasses.replace(get_preset(name), name=f"{name}-v1300", n_vocab=1300)
    make_model(preset, "Q8_0", f"{sys.argv[1]}/{name}-v1300.gguf")
PY
status=0
for model in $presets tiny-v1300 tiny-gpt-oss-v1300 tiny-glm4moe-v1300; do
    for bos in "" --no-bos; do
        python3 tools/tokenize_check.py "$work/$model.gguf" "$here/corpus.json" --llama-tokenize "$bin/llama-tokenize" \
            --show 1000 $bos || status=1
    done
done
exit $status
