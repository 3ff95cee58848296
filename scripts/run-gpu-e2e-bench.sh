#!/usr/bin/env bash
# End-to-end figures on the GPU host, in one run: losshead-server on CUDA, the C++ `losshead
# bench` (random head; one zero-head row for comparison) and the Python bridge benchmark
# (RemoteLMHead on the native path and on gRPC from Python, other cuts of the batch, the local
# torch head eager and compiled, pull / push / download) and the server-side AdamW step from Python against the mirror
# path, all against the same server at V = 128256, D = 4096.
#
#   scripts/run-gpu-e2e-bench.sh BUNDLE_DIR [OUT_DIR]
#
# BUNDLE_DIR holds bin/losshead-server, bin/losshead, bin/liblosshead_capi.so and lib/ (made with
# the GPU bundle tool, see client/python/README.md); python3 must have torch. Logs go to OUT_DIR
# (default: a temporary folder); the summary lines are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=$(cd "$1" && pwd)
out=${2:-$(mktemp -d)}
mkdir -p "$out"
port=${LOSSHEAD_PORT:-50051}
seconds=${BENCH_SECONDS:-10}
export LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

"$bundle/bin/losshead-server" --listen="127.0.0.1:$port" --metrics_listen= --backend=cuda \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  "$bundle/bin/losshead" health --server="127.0.0.1:$port" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { cat "$out/server.log"; exit 1; }
  sleep 0.2
done

bench() {  # name, flags...
  local name=$1
  shift
  "$bundle/bin/losshead" bench --server="127.0.0.1:$port" --hidden_size=4096 \
    --vocab_size=128256 \
    --seconds="$seconds" "$@" > "$out/bench-$name.log" 2>&1 || { cat "$out/bench-$name.log"; exit 1; }
  echo "cpp bench $name: $(grep -E 'tokens/s|p50' "$out/bench-$name.log" | tr '\n' ' ')"
}
{
  bench n8192-s1 --chunk_tokens=8192 --streams=1
  bench n8192-s4 --chunk_tokens=8192 --streams=4
  bench n8192-s8 --chunk_tokens=8192 --streams=8
  bench n4096-s4 --chunk_tokens=4096 --streams=4
  bench n8192-s8-zero-head --chunk_tokens=8192 --streams=8 --zero_head
} | tee "$out/cpp-bench.txt"

export PYTHONPATH="$PWD/client/python/src" LOSSHEAD_CAPI_LIB="$bundle/bin/liblosshead_capi.so"
python3 client/python/benchmarks/bridge_bench.py --server "127.0.0.1:$port" --paths native,grpc \
  --streams 1,4 2>&1 | tee "$out/bridge-bench.txt"
# Other cuts of the same batch: the previous defaults (2 x 4096 on one stream, 8 x 1024 on four)
# and one micro-batch of 2048 per stream.
python3 client/python/benchmarks/bridge_bench.py --server "127.0.0.1:$port" --paths native \
  --streams "" --plans 1:4096:1024:2:0,4:4096:1024:2:0,4:2048:1024:1:0 --no-local --no-transfers \
  2>&1 | tee "$out/bridge-bench-cuts.txt"
python3 client/python/benchmarks/optimizer_bench.py --server "127.0.0.1:$port" --mirror 2>&1 |
  tee "$out/optimizer-bench.txt"
echo "logs: $out"
