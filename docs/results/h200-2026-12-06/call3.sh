# Call 3 (the same machine, right after call 2): decode of the 48-layer file beside llama-bench
# (microbench/model_h200.sh decode: llama-bench -p 0 -n 64 -ncmoe 48|24|0 -lm none -fa 0 -r 2 and
# expertstream bench -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe all,24,0 -r 2).
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD; R=$OUT; M=/tmp/m/model5; mkdir -p $M
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
export OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" REPS=2 DECODE_STEPS=64
timeout 150 bash microbench/model_h200.sh decode > $M/console.txt 2>&1; tar cf $R/all.tar -C /tmp/m model5
