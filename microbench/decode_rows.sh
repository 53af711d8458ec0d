# Sourced by the decode rounds' scripts (docs/results/decode-round*/run.sh), after microbench/summary.sh.
# A variant of the tree: head (this tree), base (the tree at $BASE) or a name of DEFINES, an associative
# array the script declares: this tree with those settings (docs/results/decode-round5/with_defines.py).
M=/tmp/m8.gguf F=/tmp/models/qwen3-30b-a3b-Q4_K_M.gguf LCP=/tmp/llamacpp-sm90  # the 8- and 48-layer files

start_models() {  # the machine into the summary, then llama.cpp and both files made in the background ($maker)
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; } | tee "$S"
    mkdir -p /tmp/mh
    (OUT=/tmp/mh bash microbench/model_h200.sh setup >"$R/make.log" 2>&1
     [ -f $M ] || python3 -m expertstream make-model --preset qwen3-30b-a3b --type Q4_K_M --layers 8 -o $M \
         >>"$R/make.log" 2>&1
     OUT=/tmp/mh bash microbench/model_h200.sh make >>"$R/make.log" 2>&1) &
    maker=$!
}

in_tree() {  # VARIANT SECONDS MODULE ARGS...: python3 -m MODULE ARGS in a variant, SECONDS at most
    local v=$1 t=$2; shift 2
    case $v in
    head) timeout "$t" python3 -m "$@" ;;
    base) (cd "$BASE" && PYTHONPATH="$BASE:${PYTHONPATH:-}" timeout "$t" python3 -m "$@") ;;
    *) timeout "$t" python3 docs/results/decode-round5/with_defines.py ${DEFINES[$v]} -- -m "$@" ;;
    esac
}

profiles() {  # VARIANT...: the 8-layer step of each variant, each launch also timed alone
    until [ -f $M ] && ! pgrep -f "make-model.*m8.gguf" >/dev/null; do sleep 2; done
    for v in "$@"; do
        in_tree $v 90 microbench.decode_profile --backend cuda --model $M -p 512 -n 12 --top 40 -ncmoe 0 --alone \
            >"$R/profile-$v.txt" 2>&1
        el "8-layer step $v: $(grep -E 'one decode step' "$R/profile-$v.txt" | tail -1)"
    done
}

tg64() {  # VARIANT NCMOE: expertstream bench tg64, experts past the first NCMOE layers' on the GPU
    in_tree $1 150 expertstream bench -m $F --backend cuda -p 16 -n 64 --slots 3 --host-memory pinned -ncmoe $2 \
        -r 3 -o json >"$R/tg64-$1-ncmoe$2.json" 2>"$R/tg64-$1-ncmoe$2.err"
    el "48-layer tg64 -ncmoe $2 $1: $(python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(round(r['decode_tokens_per_s'], 1), '+-', round(r['decode_tokens_per_s_sd'] or 0, 1), 'median step',
          round(r['decode_median_step_ms'], 3), 'ms', r['decode_sha256'][:12],
          'link limit', round(r.get('decode_link_limit_tokens_per_s') or 0, 1))
" "$R/tg64-$1-ncmoe$2.json" 2>&1)"
}

llama_tg64() {  # NCMOE
    LD_LIBRARY_PATH=$LCP/bin:${LD_LIBRARY_PATH:-} timeout 150 $LCP/bin/llama-bench -m $F -ngl 99 -ncmoe $1 -lm none \
        -fa 0 -p 0 -n 64 -r 3 -o md >"$R/llama-tg64-ncmoe$1.md" 2>&1
    el "llama-bench tg64 -ncmoe $1: $(grep tg64 "$R/llama-tg64-ncmoe$1.md" | awk -F'|' '{print $(NF-1)}')"
}
