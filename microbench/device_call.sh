# What a results call on a lent GPU machine shares; sourced by the call scripts under docs/results/
# (CALL=NAME before sourcing; the call's raw output goes under /tmp/m/NAME and is packed into $OUT).
#   left N     seconds left of a budget of N since the call began (for timeout)
#   stamp TEXT notes TEXT and the seconds since the start in times.txt, and packs what is there
#   peak NAME COMMAND...  runs COMMAND while nvidia-smi samples the device's used memory every 100 ms;
#              its peak goes to memory.txt under NAME
# It installs the carried gguf wheel, unpacks the carried llama.cpp archive into /tmp, and notes the
# GPU, the host's cores, the date and the tree (docs/results/$RESULTS/tree.txt, the commit the working
# tree is at, written there before the call) in gpu.txt and tree.txt.
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m/$CALL; mkdir -p $M
LCP=/tmp/llamacpp-sm90; export LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-}
pack() { tar cf $OUT/all.tar -C /tmp/m $CALL; }
start=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - start) )); }
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
peak() {
  local name=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > /tmp/used.log 2>/dev/null &
  local sampler=$!
  "$@"; local status=$?
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  echo "$name: peak $(sort -n /tmp/used.log | tail -1) MiB used on the device" >> $M/memory.txt
  return $status
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nproc; date -u; } > $M/gpu.txt
cp docs/results/$RESULTS/tree.txt $M/tree.txt  # written before the call: git there may name another commit
( [ -x $LCP/bin/llama-bench ] || tar xJf .dev/llamacpp-sm90.tar.xz -C /tmp ); stamp setup
