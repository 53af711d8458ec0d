# The simulator's decode rows with and without the decode lookahead (cuda-h200 profile, timing only), on the
# 48-layer qwen3-30b-a3b Q4_K_M file make-model writes (the file of prediction/README.md).
for la in 4 0; do
  python -m expertstream bench -m q3.gguf --backend sim --sim-profile cuda-h200 --timing-only -p 16 -n 64 --slots 3 \
    --host-memory pinned -ncmoe all,24 -r 1 --decode-lookahead $la -o md > bench-la$la.md 2> bench-la$la.err
done
# One traced step's last layers (no graphs, so each operation is its own in the trace):
python -m expertstream bench -m q3.gguf --backend sim --sim-profile cuda-h200 --timing-only -p 16 -n 2 --slots 3 \
  --host-memory pinned -r 1 --no-graphs --trace la4.json > /dev/null 2>&1
python trace_tail.py la4.json > trace-la4.txt
