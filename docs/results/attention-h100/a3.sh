# Call A3: logits and perplexity of the 24-layer gpt-oss-20b MXFP4_MOE and 48-layer qwen3-30b-a3b Q4_K_M
# files against llama.cpp CUDA (and llama.cpp CPU, no GPU visible, for the band) with the base-2 prefill
# attention: microbench/model_h200.sh setup make big.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev; rm -rf /tmp/tree && mkdir -p /tmp/tree && tar xzf $D/tree3.tgz -C /tmp/tree
cd /tmp/tree; export PYTHONPATH=/tmp/site:/tmp/tree
R=$OUT; M=/tmp/m/a3; mkdir -p $M
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader > $M/gpu.txt
cp $D/tree3.txt $M/tree.txt
start=$(date +%s)
( while sleep 20; do tar cf $R/all.tar -C /tmp/m a3; done ) &
LOOP=$!
ARCHIVE=$D/llamacpp-sm90.tar.xz OUT=$M FILES="gpt-oss-20b:MXFP4_MOE" timeout 260 bash microbench/model_h200.sh setup make big > $M/run-gpt-oss.log 2>&1
echo "gpt-oss rc $? after $(( $(date +%s) - start )) s" >> $M/run.log
ARCHIVE=$D/llamacpp-sm90.tar.xz OUT=$M FILES="qwen3-30b-a3b:Q4_K_M" timeout $(( 520 - ($(date +%s) - start) )) bash microbench/model_h200.sh make big > $M/run-qwen3.log 2>&1
echo "qwen3 rc $? after $(( $(date +%s) - start )) s" >> $M/run.log
kill $LOOP; wait $LOOP 2>/dev/null
tar cf $R/all.tar -C /tmp/m a3
cat $M/logits.txt $M/ppl.txt $M/make.txt; tail -3 $M/run.log
