#!/usr/bin/env bash
# Builds the CPU paths with AddressSanitizer + UndefinedBehaviorSanitizer into
# ${ASAN_BUILD_DIR:-build-asan} (CUDA off) and runs their suites: the CPU kernels, the server, the
# service end to end and the load / dropped-connection tests. Any sanitizer report fails the run.
# gRPC, protobuf and OpenBLAS come uninstrumented from the distribution; only our code is checked.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${ASAN_BUILD_DIR:-build-asan}
targets=(kernels_cpu_test server_test service_test load_test)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOSSHEAD_CUDA=OFF \
  -DLOSSHEAD_SANITIZE=address,undefined >/dev/null
cmake --build "$build_dir" --target "${targets[@]}" -j "${JOBS:-$(nproc)}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# Each suite's binary directly: the build holds only these suites, so ctest would list the others as
# not built.
status=0
for t in "${targets[@]}"; do
  bin=$(find "$build_dir/tests" -type f -name "$t" -perm -u+x | head -n1)
  echo "== $t (ASan + UBSan)"
  "$bin" --gtest_brief=1 || status=1
done
exit $status
