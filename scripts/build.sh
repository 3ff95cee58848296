#!/usr/bin/env bash
# Configures and builds losshead into ${BUILD_DIR:-build}.
#
#   scripts/build.sh [CMAKE_ARGS...]                      every target, the test suites included
#   scripts/build.sh --target T [--target T...] [CMAKE_ARGS...]   only those targets
#
# Each run configures the test suites on (LOSSHEAD_BUILD_TESTS=ON), the CUDA backend wherever nvcc
# is found (LOSSHEAD_CUDA=AUTO) and every file compiled on its own (CMAKE_UNITY_BUILD=OFF) unless
# CMAKE_ARGS say otherwise, so a build directory that scripts/run-demo.sh configured for its two
# targets becomes the full build again: the cache would keep the demo's choices otherwise.
# Environment: BUILD_DIR, BUILD_TYPE (default Release), JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
targets=()  # names, for ninja
cmake_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) [ $# -ge 2 ] || { echo "build.sh: --target needs a name" >&2; exit 2; }
              targets+=("$2"); shift 2 ;;
    *) cmake_args+=("$1"); shift ;;
  esac
done
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
  -DLOSSHEAD_BUILD_TESTS=ON -DLOSSHEAD_CUDA=AUTO -DCMAKE_UNITY_BUILD=OFF "${cmake_args[@]}"
# How much is left to do, before ninja's "[n/N]" lines count it down.
steps=$(ninja -C "$build_dir" -n "${targets[@]}" 2>/dev/null | grep -c '^\[' || true)
echo "build: ${steps} steps to run for ${targets[*]:-every target}"
target_args=()
for t in "${targets[@]}"; do target_args+=(--target "$t"); done
cmake --build "$build_dir" -j "${JOBS:-$(nproc)}" "${target_args[@]}"
