# the rest of CALM=0.125 after the disk filled: the same commands as microbench/logits_cpu.sh
set -euo pipefail
export PYTHONPATH=. PATH=/tmp/dv/bin:$PATH
tool=LLAMACPP_LOGITS work=WORK_DIR
name=gpt-oss-20b-24L-r0.125
python3 -m expertstream make-model --preset gpt-oss-20b --type MXFP4_MOE --seed 3 --layers 24 --residual-scale 0.125 -o $work/$name.gguf >/dev/null
python3 -m microbench.llamacpp_logits.prompt "$work/$name.gguf" 256 >"$work/$name.prompt"
"$tool" -m "$work/$name.gguf" --tokens "$work/$name.prompt" --n-prompt 256 --n-gen 16 --ngl 0 --ubatch 64 -o "$work/$name-llama-cpu" >"$work/$name-llama-cpu.log" 2>&1
"$tool" -m "$work/$name.gguf" --tokens "$work/$name-llama-cpu.tokens" --n-prompt 272 --n-gen 0 --ngl 0 --ubatch 64 --fa on -o "$work/$name-llama-cpu-fa" >"$work/$name-llama-cpu-fa.log" 2>&1
python3 -m microbench.llamacpp_logits.compare "$work/$name-llama-cpu" "$work/$name-llama-cpu-fa" | sed "s/^/$name llama.cpp CPU, flash attention on against off: /"
rm -f $work/$name.gguf
name=gpt-oss-20b-8L-r0.125
python3 tools/logits_check.py -m "$work/$name.gguf" --ref "$work/$name-llama-cpu" -o "$work/$name-ours" --backend sim --ubatch 64 | sed "s/^/$name (ubatch 64): /"
python3 -m microbench.llamacpp_logits.compare "$work/$name-llama-cpu" "$work/$name-ours" | sed "s/^/$name expertstream against llama.cpp CPU (flash attention off), every position: /"
