# The simulator's decode rows (cuda-h200 profile, timing only) of three trees on the 48-layer qwen3-30b-a3b
# Q4_K_M file make-model writes: 69a23ea (the lookahead started after the layer before's down computed),
# 22d0a8e (started after down's copies, before it computes), 4910c21 (a streamed layer's gate, up and down
# one split, the lookahead after its copies). tg64 after a 16-token prompt, every layer's experts or the
# first 24 layers' in pinned host memory.
python -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M -o /tmp/sim/q3.gguf > /dev/null
for rev in 69a23ea 22d0a8e 4910c21; do
  rm -rf /tmp/t_$rev && mkdir -p /tmp/t_$rev && git archive $rev | tar x -C /tmp/t_$rev
  ( cd /tmp/t_$rev && python -m expertstream bench -m /tmp/sim/q3.gguf --backend sim --sim-profile cuda-h200 \
      --timing-only -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe all,24 -r 1 -o md ) > bench-$rev.md 2> bench-$rev.err
done
