# Call l1: logits and perplexity against llama.cpp on files written at residual scale 0.125
# (make-model --residual-scale 0.125), gpt-oss-20b MXFP4_MOE then qwen3-30b-a3b Q4_K_M: a 512-token prompt
# and 64 greedy steps through llama.cpp CUDA, llama.cpp CPU and expertstream, each against llama.cpp CUDA;
# llama-perplexity (CUDA and CPU) and expertstream perplexity on docs/design.md (microbench/model_h200.sh
# setup make big). Raw output under l1/.
CALL=l1 RESULTS=calm-h100; source microbench/device_call.sh
export RESIDUAL_SCALE=0.125  # OUT stays the call's: pack writes there
OUT=$M timeout $(left 120) bash microbench/model_h200.sh setup > $M/setup.log 2>&1; stamp setup-logits
for spec in gpt-oss-20b:MXFP4_MOE qwen3-30b-a3b:Q4_K_M; do
  OUT=$M FILES=$spec timeout $(left 585) bash microbench/model_h200.sh make big > $M/run-${spec%%:*}.log 2>&1
  stamp "${spec%%:*} rc $?"
done
cat $M/times.txt $M/logits.txt $M/ppl.txt
