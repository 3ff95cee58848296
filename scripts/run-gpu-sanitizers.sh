#!/usr/bin/env bash
# Runs the CUDA suite under compute-sanitizer on a machine with a GPU (CI has none, so CI does not
# run this): memcheck (with leak check) over the whole suite, synccheck and initcheck over a subset
# that covers every kernel path, racecheck (slowest) over the small shapes. Any report fails.
#   scripts/run-gpu-sanitizers.sh [path/to/kernels_cuda_test]
set -euo pipefail
cd "$(dirname "$0")/.."
test_bin=${1:-build/tests/cuda/kernels_cuda_test}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# Every schedule (plain, overlapped, row-thread and blocks-per-SM variants, chunking), all
# targets ignored, N = 1, and the backend-level tests (determinism, streams, errors).
subset='Shapes/*N1000_V32003*:Shapes/*overlap*:Shapes/*N1_V1001*:Shapes/*allignored*:CudaBackend*'
small='Shapes/*N1_V1001*:Shapes/*N300_V1001*'
run() {
  local tool=$1 filter=$2
  shift 2
  echo "== compute-sanitizer --tool $tool ($filter)"
  "$sanitizer" --tool "$tool" --error-exitcode 3 "$@" "$test_bin" --gtest_filter="$filter" \
    | grep -E "PASSED|FAILED|SUMMARY|=========" | grep -v "^========= $" | tail -20
}
run memcheck '*' --leak-check full
run synccheck "$subset"
run initcheck "$subset"
run racecheck "$small" --racecheck-report all
echo "compute-sanitizer: no reports"
