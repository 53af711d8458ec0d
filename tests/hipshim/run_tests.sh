#!/usr/bin/env bash
# The test suite on the HIP backend over NVIDIA silicon. Builds the HIP-to-CUDA shim into a
# temporary directory, points hip-python at it through ROCM_PATH, checks hip-python through it
# (smoke.py), then runs `pytest -q tests --backend hip` with this script's arguments appended
# (only the tests named, where an argument names a test file or folder).
# A leading --bench also runs the event-order and H2D bandwidth microbenchmarks on that backend.
# Every stage runs even if an earlier one failed; the exit status is 1 if any failed.
#
# usage: tests/hipshim/run_tests.sh [--bench] [pytest arguments, test files or folders...]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-python3}
bench=0
if [[ ${1:-} == --bench ]]; then
    bench=1
    shift
fi

build=$(mktemp -d "${TMPDIR:-/tmp}/hipshim.XXXXXX")
trap 'rm -rf "$build"' EXIT
PYTHON=$python bash "$here/build.sh" "$build"
export ROCM_PATH=$build

cd "$root"
failed=()
"$python" "$here/smoke.py" || failed+=(smoke)
targets=(tests)  # the whole suite, unless an argument names what to run
for arg in "$@"; do
    if [[ $arg != -* && -e ${arg%%::*} ]]; then
        targets=()
        break
    fi
done
"$python" -m pytest -q ${targets[@]+"${targets[@]}"} --backend hip "$@" || failed+=(pytest)
if ((bench)); then
    "$python" -m microbench.event_order --backend hip || failed+=(event_order)
    "$python" -m microbench.h2d_bandwidth --backend hip || failed+=(h2d_bandwidth)
fi

if ((${#failed[@]})); then
    echo "run_tests.sh: failed: ${failed[*]}" >&2
    exit 1
fi
echo "run_tests.sh: all stages passed"
