# One short call: the CUDA tests of the MXFP4 direct-decode kernels, then MXFP4's mul_mat_id on the
# matrix cores through shared weight tiles (mma) and decoded straight into fragments (direct), at
# Qwen3-30B-A3B's expert shapes (microbench.kernels).
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=$OUT; M=/tmp/m/call4; mkdir -p $M
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $M/gpu.txt
git log -1 --format=%h > $M/tree.txt 2>/dev/null
(timeout 60 python3 -m pytest -q -p no:cacheprovider --backend cuda tests/kernels/test_direct.py -k "MXFP4" -rf 2>&1 \
   | sed "s#$PWD/##g" | tail -8) > $M/pytest.txt
cat $M/pytest.txt; tar cf $R/all.tar -C /tmp/m call4
timeout 75 python3 -m microbench.kernels --backend cuda --types MXFP4 --paths mma direct --ubatch 512 4096 \
   --bandwidth-gbs 55 > $M/kernels.txt 2>&1
tail -20 $M/kernels.txt; tar cf $R/all.tar -C /tmp/m call4
