# Short call: the gather's rate at several kernel shapes beside the copy engines (microbench.gather_rates),
# tune's probe of the same, and the CUDA graph tests (the forked capture's count).
pip install --no-deps -q --target /tmp/site .dev/gguf-0.19.0-py3-none-any.whl 2>/dev/null
D=$PWD/.dev
rm -rf /tmp/tree && mkdir -p /tmp/tree && tar xf $D/tree.tar -C /tmp/tree
R=$OUT; M=/tmp/m/call2; mkdir -p $M
pack() { tar cf $R/all.tar -C /tmp/m call2; }
start=$(date +%s)
stamp() { echo "$1 $(( $(date +%s) - start )) s" >> $M/times.txt; pack; }
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader > $M/gpu.txt
cat $D/tree.txt > $M/tree.txt; lscpu | head -20 > $M/cpu.txt
cd /tmp/tree; export PYTHONPATH=/tmp/site:/tmp/tree
timeout 90 python3 -m microbench.gather_rates --backend cuda --out $M/gather_rates.json > $M/gather_rates.txt 2> $M/gather_rates.err
stamp gather_rates
(timeout 45 python3 -m pytest -q -p no:cacheprovider --backend cuda tests/backends/test_graphs.py -rf 2>&1 | tail -4) > $M/pytest.txt
stamp tests
timeout 45 python3 -m expertstream tune --backend cuda -o /tmp/prof.json > $M/tune.txt 2>&1; stamp tune
cat $M/gpu.txt; tail -2 $M/pytest.txt; grep -i "gather\|pinned" $M/tune.txt | head -4; tail -3 $M/gather_rates.err; cat $M/gather_rates.txt
