#!/usr/bin/env bash
# Builds the libFuzzer target over Step request framing and validation (clang, ASan + UBSan) into
# ${FUZZ_BUILD_DIR:-build-fuzz} and runs it for FUZZ_SECONDS (default 60) from the seed corpus.
# Inputs that once broke an invariant (tests/fuzz/regressions) are replayed first and stay in the
# corpus. Any crash, leak, sanitizer report, timeout (> 10 s per input) or out-of-memory (> 2 GiB) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${FUZZ_BUILD_DIR:-build-fuzz}
seconds=${FUZZ_SECONDS:-60}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOSSHEAD_CUDA=OFF \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DLOSSHEAD_FUZZ=ON -DLOSSHEAD_SANITIZE=address,undefined >/dev/null
cmake --build "$build_dir" --target step_fuzzer step_fuzzer_seeds -j "${JOBS:-$(nproc)}"
corpus="$build_dir/fuzz-corpus"
mkdir -p "$corpus" "$build_dir/fuzz-seeds"
"$build_dir/tests/fuzz/step_fuzzer_seeds" "$build_dir/fuzz-seeds"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
"$build_dir/tests/fuzz/step_fuzzer" tests/fuzz/regressions/*
"$build_dir/tests/fuzz/step_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$build_dir/" \
  "$corpus" "$build_dir/fuzz-seeds" tests/fuzz/regressions
