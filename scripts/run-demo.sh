#!/usr/bin/env bash
# Installs, builds, starts losshead-server (CUDA backend when a GPU is present, else CPU) on loopback,
# runs `losshead demo` against it, and stops the server. Extra arguments go to `losshead demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
build_dir=${BUILD_DIR:-build}
port=${LOSSHEAD_PORT:-50051}
metrics_port=${LOSSHEAD_METRICS_PORT:-9464}

log=$(mktemp -t losshead-server.XXXXXX.log)
"$build_dir/server/losshead-server" --backend=auto --listen="127.0.0.1:$port" \
  --metrics_listen="127.0.0.1:$metrics_port" 2>"$log" &
server_pid=$!
trap 'kill -TERM $server_pid 2>/dev/null; wait $server_pid 2>/dev/null || true' EXIT

for _ in $(seq 1 100); do
  "$build_dir/client/losshead" health --server="127.0.0.1:$port" >/dev/null 2>&1 && break
  kill -0 $server_pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
head -n 5 "$log"
"$build_dir/client/losshead" demo --server="127.0.0.1:$port" "$@"
