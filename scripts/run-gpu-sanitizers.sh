#!/usr/bin/env bash
# Runs the CUDA suites under compute-sanitizer on a machine with a GPU (CI has none, so CI does not
# run this): memcheck (with leak check) over the whole kernel suite, synccheck over a subset that
# covers every kernel path, initcheck over the kernels it can judge (below), racecheck (slowest)
# over the small shapes; with a second argument, memcheck over the server's CUDA suite too. Any
# report fails.
#   scripts/run-gpu-sanitizers.sh [path/to/kernels_cuda_test [path/to/server_cuda_test]]
# SANITIZER_TOOLS picks the tools (default: memcheck synccheck initcheck racecheck), so that a
# run can be split over several calls on a machine with a time limit per command.
set -euo pipefail
cd "$(dirname "$0")/.."
test_bin=${1:-build/tests/cuda/kernels_cuda_test}
server_bin=${2:-}
tools=${SANITIZER_TOOLS:-memcheck synccheck initcheck racecheck}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# synccheck: every schedule of the fused run (plain, overlapped, row-thread and blocks-per-SM
# variants, chunking), all targets ignored, N = 1, the backend-level tests (determinism, streams,
# errors); the shard calls, the gradient stash (one device and shards), the optimizer step on its
# vector and scalar paths, the squared norm, and the logits of a width's tail (its warp shuffles).
subset='Shapes/*N1000_V32003*:Shapes/*overlap*:Shapes/*N1_V1001*:Shapes/*allignored*:CudaBackend*'
subset+=':Shards/*:Cases/*:ShardCuda*:CudaGradStash*:CudaSquaredNorm*:Pairs/*:LogitsTail*'
subset+=':Optimizers/*.MatchesCpuBitForBit/*1031x1001:Optimizers/*.Misaligned*/*_64x128'
# initcheck does not see what cuBLAS's Hopper GEMMs write (their TMA stores): in a fresh process
# every logits element that the row kernels read is reported uninitialized, although the results
# match the CPU backend. So it checks only the kernels whose inputs no GEMM wrote: the optimizer
# step, the squared norm and the logits tail, and the calls rejected before any launch.
init_subset='Optimizers/*.MatchesCpuBitForBit/*1031x1001:Optimizers/*.Misaligned*/*_64x128'
init_subset+=':CudaSquaredNorm*:*Error*:Pairs/*:LogitsTail*'
small='Shapes/*N1_V1001*:Shapes/*N300_V1001*:Shards/*N300*:Shards/*N400*'
small+=':Cases/CudaGradStashTest.*/fp32_mean:Cases/CudaShardGradStashTest.*/fp32_mean_k2'
small+=':Optimizers/*.MatchesCpuBitForBit/*_fp32_64x128'
# Tests that make allocations fail on purpose: memcheck reports each failed CUDA call, so these
# run with API error reports off (their own assertions check the statuses).
oom_kernels='CudaBackendTest.AFailedAllocationDoesNotFailTheNextRun'
oom_server='StashMemoryCudaTest.*'
run() {
  local bin=$1 tool=$2 filter=$3
  shift 3
  echo "== $(basename "$bin"): compute-sanitizer --tool $tool ($filter)"
  "$sanitizer" --tool "$tool" --error-exitcode 3 "$@" "$bin" --gtest_filter="$filter" \
    | grep -E "PASSED|FAILED|SUMMARY|=========" | grep -v "^========= $" | tail -20
}
for tool in $tools; do
  case $tool in
    memcheck)
      run "$test_bin" memcheck "*-$oom_kernels" --leak-check full
      run "$test_bin" memcheck "$oom_kernels" --leak-check full --report-api-errors no
      if [ -n "$server_bin" ]; then
        run "$server_bin" memcheck "*-$oom_server" --leak-check full
        run "$server_bin" memcheck "$oom_server" --leak-check full --report-api-errors no
      fi
      ;;
    synccheck) run "$test_bin" synccheck "$subset" ;;
    initcheck) run "$test_bin" initcheck "$init_subset" ;;
    racecheck) run "$test_bin" racecheck "$small" --racecheck-report all ;;
    *) echo "unknown tool: $tool" >&2 && exit 2 ;;
  esac
done
echo "compute-sanitizer: no reports"
