#!/usr/bin/env bash
# The whole suite on a GPU backend, and the committed real-file rows' output hashes, in parts that
# fit one call of a lent machine each (nox cannot build its environments there: pytest runs directly).
#
# usage: microbench/gpu_check.sh STAGE...    stages:
#   wheels  install the wheels in .whl/ (gguf) into /tmp/site, for a machine without a registry
#   make    start writing the real files in the background (realfiles.sh make, logged to $OUT/make.log)
#   suite1  tests/kernels tests/backends tests/interop on $BACKEND
#   suite2  every other test folder on $BACKEND
#   check   wait for `make`, then realfiles.sh check: outputs must hash as the committed rows do
# Environment: BACKEND (cuda), OUT (.), MODELS (/tmp/models), LIMIT (seconds per pytest, 540).
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-cuda}
OUT=${OUT:-.}
export MODELS=${MODELS:-/tmp/models}
LIMIT=${LIMIT:-540}
if [[ -d /tmp/site ]]; then export PYTHONPATH=/tmp/site:$PWD; else export PYTHONPATH=$PWD; fi

suite() {
    local name=$1
    shift
    set +e
    timeout "$LIMIT" python3 -m pytest -q "$@" --backend "$BACKEND" \
        -p no:cacheprovider -rfE >"$OUT/$name.log" 2>&1
    local code=$?
    set -e
    tail -n 3 "$OUT/$name.log"
    echo "$name: pytest exit $code"
}

for stage in "$@"; do
    case $stage in
    wheels)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:$PWD ;;
    make)
        mkdir -p "$MODELS"
        setsid nohup bash microbench/realfiles.sh make >"$OUT/make.log" 2>&1 &
        echo $! >"$MODELS/make.pid" ;;
    suite1)
        suite suite1 tests/kernels tests/backends tests/interop ;;
    suite2)
        suite suite2 tests/architecture tests/bench tests/cli tests/docs tests/engine tests/hostmem tests/model \
            tests/scheduler tests/amdcompile ;;
    check)
        if [[ -f $MODELS/make.pid ]]; then
            while kill -0 "$(cat "$MODELS/make.pid")" 2>/dev/null; do sleep 2; done
        else  # a fresh machine: nothing was started, so make the files here
            OUT=$OUT bash microbench/realfiles.sh make >"$OUT/make.log" 2>&1
        fi
        [[ -f $OUT/make.log ]] && tail -n 4 "$OUT/make.log"
        OUT=$OUT bash microbench/realfiles.sh check ;;
    *)
        echo "unknown stage $stage (wheels, make, suite1, suite2, check)" >&2
        exit 2 ;;
    esac
done
