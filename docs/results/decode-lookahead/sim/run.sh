# The simulator's decode rows with and without the decode lookahead (cuda-h200 profile, timing only), on the
# 48-layer qwen3-30b-a3b Q4_K_M file make-model writes (the file of prediction/README.md).
for la in 4 0; do
  python -m expertstream bench -m q3.gguf --backend sim --sim-profile cuda-h200 --timing-only -p 16 -n 64 --slots 3 \
    --host-memory pinned -ncmoe all,24 -r 1 --decode-lookahead $la -o md > bench-la$la.md 2> bench-la$la.err
done
