# Right after ds11 on the same machine (the 48-layer file and llama.cpp already there): pp4096 at ubatch
# 512/2048/4096, every expert streamed and all on the GPU, beside llama-bench (model_h200.sh bench).
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=$OUT; M=/tmp/m/model3; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m model3; }
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
[ -x /tmp/llamacpp-sm90/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp
export OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" TOKENS=4096 UBATCH=512,2048,4096 REPS=2
timeout 150 bash microbench/model_h200.sh make
timeout $(( 540 - ($(date +%s) - start) )) bash microbench/model_h200.sh bench
echo "bench $(( $(date +%s) - start )) s" >> $M/times.txt; pack
left=$(( 580 - ($(date +%s) - start) )); [ $left -gt 20 ] && timeout $left python3 -m microbench.decode_profile --backend cuda --model /tmp/models/qwen3-30b-a3b-Q4_K_M.gguf --layers 48 -p 4096 -ub 512 -n 3 --top 30 > $M/profile-ub512.txt 2>&1; pack
grep "pp4096\|tg64" $M/llama-bench-*.md; cat $M/ours-*.txt $M/times.txt
