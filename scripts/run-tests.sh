#!/usr/bin/env bash
# Installs, builds and runs every test: the C++ suites through CTest (GPU suites skip where no GPU is
# present), the deployment checks, and the Python client's pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
build_dir=${BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "${JOBS:-$(nproc)}"
if [ -x client/python/run_tests.sh ]; then
  LOSSHEAD_SERVER_BIN="$PWD/$build_dir/server/losshead-server" client/python/run_tests.sh
fi
# Fuzzing (bounded: FUZZ_SECONDS, default 60) and the sanitizer build of the CPU paths; set
# SKIP_FUZZ=1 / SKIP_SANITIZERS=1 to leave them out of a quick local run.
if [ "${SKIP_FUZZ:-0}" != 1 ]; then
  scripts/run-fuzz.sh
fi
if [ "${SKIP_SANITIZERS:-0}" != 1 ]; then
  scripts/run-sanitizers.sh
fi
