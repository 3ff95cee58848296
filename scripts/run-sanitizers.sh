#!/usr/bin/env bash
# Builds the CPU paths with AddressSanitizer + UndefinedBehaviorSanitizer (clang) into
# ${ASAN_BUILD_DIR:-build-asan} (CUDA off) and runs their suites: the CPU kernels, the server, the
# service end to end, the load / dropped-connection tests, security (TLS, tokens, roles, limits) and
# crash recovery. The security and recovery suites spawn the losshead-server binary, which is
# instrumented too. Any sanitizer report fails the run, from a test process or a server child.
# gRPC, protobuf, c-ares and OpenBLAS come uninstrumented from the distribution; only our code is
# checked.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
build_dir=${ASAN_BUILD_DIR:-build-asan}
targets=(kernels_cpu_test server_test service_test load_test security_test recovery_test)
# clang: with gcc, UBSan in an ASan build ignores log_path (below) and writes to stderr only.
cc=${SAN_CC:-clang}
cxx=${SAN_CXX:-clang++}
fresh=()
if [ -f "$build_dir/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=$(command -v "$cxx")" "$build_dir/CMakeCache.txt"; then
  fresh=(--fresh)  # a build directory configured with another compiler
fi
cmake "${fresh[@]}" -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DLOSSHEAD_CUDA=OFF -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
  -DLOSSHEAD_SANITIZE=address,undefined >/dev/null
cmake --build "$build_dir" --target "${targets[@]}" losshead-server -j "${JOBS:-$(nproc)}"
build_s=$((SECONDS - start))

# Every process writes its reports to a file of its own under $reports: a server child's stderr
# goes to a log in a temporary directory that its test deletes, and a child that dies of a report
# would look to the recovery tests like one they killed. So any file there fails the suite.
# LeakSanitizer cannot report on a child killed with SIGKILL (the recovery kills); a child that
# exits (SIGTERM drain, refusal to start) is checked like any process.
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1:abort_on_error=1}:log_path=$reports/asan"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}:log_path=$reports/ubsan"
# scripts/lsan.supp: leaks inside the distribution's libraries (each entry says why).
export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"

# Each suite's binary directly: the build holds only these suites, so ctest would list the others as
# not built.
status=0
for t in "${targets[@]}"; do
  bin=$(find "$build_dir/tests" -type f -name "$t" -perm -u+x | head -n1)
  echo "== $t (ASan + UBSan)"
  t0=$SECONDS
  rc=0
  timeout -k 10 900 "$bin" --gtest_brief=1 || rc=$?
  if [ -n "$(ls -A "$reports")" ]; then
    echo "== $t: sanitizer reports:"
    cat "$reports"/*
    rm -f "$reports"/*
    rc=1
  fi
  echo "== $t: $([ $rc -eq 0 ] && echo passed || echo "FAILED ($rc)"), $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
done
echo "== sanitizers: build ${build_s} s, total $((SECONDS - start)) s"
exit $status
