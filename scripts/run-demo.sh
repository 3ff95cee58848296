#!/usr/bin/env bash
# The README's first command: installs what the server and the CLI need (install-deps.sh
# --build-only), builds those two targets only, starts losshead-server on loopback and trains a head
# with `losshead demo` against it, then stops the server. Extra arguments go to `losshead demo`.
#
# One line per phase ("run-demo [k/4] ...") says what it does and, when done, how long it took; the
# line that starts the server says which backend it runs and why.
#
# The build directory is the test command's. One that does not exist yet is configured for the
# two targets alone: no test suites (no GoogleTest to install), the CUDA backend only where a GPU is
# present and nvcc can build it (without a GPU it could not run, and its kernels are the slowest
# part of the build), and a unity build (CMAKE_UNITY_BUILD: several files per compiler run, so the
# gRPC and protobuf headers are parsed a quarter as often; a fresh two-core machine built the two
# targets in 323 s instead of 694). scripts/build.sh, which scripts/run-tests.sh runs, configures
# all three back: tests on, CUDA wherever nvcc is, every file on its own. A build directory already
# configured keeps its configuration.
#
# Environment: BUILD_DIR (default build), LOSSHEAD_CUDA (ON, OFF or AUTO: the CUDA backend in spite
# of the above), LOSSHEAD_PORT (50051), LOSSHEAD_METRICS_PORT (9464), JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
port=${LOSSHEAD_PORT:-50051}
metrics_port=${LOSSHEAD_METRICS_PORT:-9464}
start=$SECONDS
phase() { phase_start=$SECONDS; echo "run-demo [$1/4] ${*:2}"; }
phase_done() { echo "run-demo [$1/4] done in $((SECONDS - phase_start)) s"; }

phase 1 "installing what building and running losshead-server and losshead need"
scripts/install-deps.sh --build-only
phase_done 1
install_s=$((SECONDS - phase_start))

# The GPU: nvidia-smi's answer where it is installed, else the driver's device files (a container
# may be given those without the tools).
gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)
fi
if [ -z "$gpu" ] && compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  gpu="an NVIDIA GPU ($(compgen -G '/dev/nvidia[0-9]*' | head -n1))"
fi
# nvcc where the build looks for it (CMakeLists.txt): $CUDACXX, /usr/local/cuda, then PATH.
nvcc=${CUDACXX:-}
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
[ -z "$nvcc" ] && nvcc=$(command -v nvcc || true)

# A build directory counts as configured once CMake has generated it: a configure that failed (a
# dependency missing) leaves a cache whose choices need not be kept.
cache="$build_dir/CMakeCache.txt"
if [ -f "$cache" ] && [ -f "$build_dir/build.ninja" ]; then
  tests=$(sed -n 's/^LOSSHEAD_BUILD_TESTS:[A-Z]*=//p' "$cache")
  cuda=$(sed -n 's/^LOSSHEAD_CUDA:[A-Z]*=//p' "$cache")
  unity=$(sed -n 's/^CMAKE_UNITY_BUILD:[A-Z]*=//p' "$cache")
  how="$build_dir/ exists and keeps its configuration: test suites ${tests:-ON},"
  how+=" LOSSHEAD_CUDA=${cuda:-AUTO}, unity build ${unity:-OFF}"
else
  tests=OFF
  cuda=OFF
  [ -n "$gpu" ] && [ -n "$nvcc" ] && cuda=ON
  unity=ON
  how="CUDA backend $cuda, unity build, no test suites: scripts/run-tests.sh builds those"
fi
if [ -n "${LOSSHEAD_CUDA:-}" ]; then
  cuda=$LOSSHEAD_CUDA
  how+="; LOSSHEAD_CUDA=$cuda from the environment"
fi

phase 2 "building losshead-server and losshead only ($how)"
# --log-level=NOTICE: CMake's own status lines; the line above says what matters.
if ! scripts/build.sh --target losshead-server --target losshead \
     -DLOSSHEAD_BUILD_TESTS="${tests:-ON}" -DLOSSHEAD_CUDA="${cuda:-AUTO}" \
     -DCMAKE_UNITY_BUILD="${unity:-OFF}" --log-level=NOTICE; then
  [ -n "$gpu" ] && [ "$cuda" != OFF ] && echo "run-demo: the build with the CUDA backend failed;" \
    "LOSSHEAD_CUDA=OFF bash scripts/run-demo.sh runs the demo on the CPU" >&2
  exit 1
fi
phase_done 2
build_s=$((SECONDS - phase_start))

# Which backend and why, from what this machine has and what the build holds.
cuda_built=0
grep -q 'losshead_kernels_cuda' "$build_dir/build.ninja" && cuda_built=1
if [ -n "$gpu" ] && [ $cuda_built -eq 1 ]; then
  backend=CUDA
  why="$gpu is present and the build has the CUDA backend"
elif [ -n "$gpu" ] && [ -z "$nvcc" ]; then
  backend=CPU
  why="$gpu is present, but nvcc is not (neither in /usr/local/cuda/bin nor on PATH), so the CUDA"
  why+=" backend is not built; with the CUDA toolkit at /usr/local/cuda it would be"
elif [ -n "$gpu" ]; then
  backend=CPU
  why="$gpu is present, but $build_dir is configured without the CUDA backend"
  why+=" (LOSSHEAD_CUDA=ON or AUTO builds it with $nvcc)"
else
  backend=CPU
  seen="no nvidia-smi"
  command -v nvidia-smi >/dev/null 2>&1 && seen="nvidia-smi lists none"
  why="there is no NVIDIA GPU on this machine ($seen, no /dev/nvidia*)"
  if [ $cuda_built -eq 0 ]; then
    why+=", so the CUDA backend, which could not run here, is left out of this build"
    [ -n "$nvcc" ] && why+=" (scripts/run-tests.sh builds it with $nvcc)"
  fi
fi

phase 3 "starting losshead-server on 127.0.0.1:$port with the $backend backend: $why"
log=$(mktemp -t losshead-server.XXXXXX.log)
"$build_dir/server/losshead-server" --backend=auto --listen="127.0.0.1:$port" \
  --metrics_listen="127.0.0.1:$metrics_port" 2>"$log" &
server_pid=$!
stop_server() {
  local rc=$?
  kill -TERM $server_pid 2>/dev/null && wait $server_pid 2>/dev/null || true
  if [ $rc -ne 0 ] && [ -s "$log" ]; then
    echo "run-demo: failed (exit code $rc); losshead-server's log:" >&2
    cat "$log" >&2
  fi
  rm -f "$log"
}
trap stop_server EXIT
up=0
for _ in $(seq 1 300); do
  if "$build_dir/client/losshead" health --server="127.0.0.1:$port" >/dev/null 2>&1; then
    up=1
    break
  fi
  kill -0 $server_pid 2>/dev/null || break
  sleep 0.1
done
if [ $up -ne 1 ]; then
  echo "run-demo: losshead-server did not come up on 127.0.0.1:$port" >&2
  exit 1
fi
head -n 5 "$log"
# --backend=auto takes the GPU whenever the CUDA runtime can use it; say so when it could not.
if [ "$backend" = CUDA ] && ! grep -q "backend cuda" "$log"; then
  echo "run-demo: $gpu is present, but the CUDA runtime found no usable device (is the driver" \
    "loaded?): the server runs on the CPU"
fi
phase_done 3

phase 4 "training a head: losshead demo $*"
"$build_dir/client/losshead" demo --server="127.0.0.1:$port" "$@"
phase_done 4
echo "run-demo: passed in $((SECONDS - start)) s (installing ${install_s} s, building ${build_s} s)"
