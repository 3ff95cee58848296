#!/usr/bin/env bash
# The same-node paths from PyTorch on the GPU host, in one run: for a server on the trainer's own
# GPU 0 and, where the host has a second GPU, on GPU 1 (its NVLink peer on the 2-GPU hosts),
# RemoteLMHead forward + backward of 8192 tokens at 4 and 1 streams beside the local head (eager
# and torch.compile) in the same run, without and with a trunk still running when the head is
# called (`--trunk-gemms`); then the Python client's same-node suite on CUDA.
#
#   scripts/run-same-node-bench.sh BUNDLE_DIR [OUT_DIR]
#
# BUNDLE_DIR holds bin/losshead-server, bin/losshead, bin/liblosshead_capi.so and lib/ (made with
# the GPU bundle tool, see client/python/README.md); python3 must have torch. Logs go to OUT_DIR
# (default: a temporary folder); the summary lines are printed as each run ends. TRUNK_GEMMS
# (default 48, about 9.5 ms on an H200) sets the trunk; ITERS (40) the timed steps per row.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=$(cd "$1" && pwd)
out=${2:-$(mktemp -d)}
mkdir -p "$out"
trunk=${TRUNK_GEMMS:-48}
iters=${ITERS:-40}
export LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
export PYTHONPATH="$PWD/client/python/src" LOSSHEAD_CAPI_LIB="$bundle/bin/liblosshead_capi.so"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)

server=
stop_server() {
  if [ -n "$server" ]; then
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=
  fi
}
trap stop_server EXIT

for gpu in $(seq 0 $((gpus > 1 ? 1 : 0))); do
  port=$((50071 + gpu))
  "$bundle/bin/losshead-server" --listen="127.0.0.1:$port" --metrics_listen= --backend=cuda \
    --devices="$gpu" > "$out/server-gpu$gpu.log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do
    "$bundle/bin/losshead" health --server="127.0.0.1:$port" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { cat "$out/server-gpu$gpu.log"; exit 1; }
    sleep 0.2
  done
  for gemms in 0 "$trunk"; do
    log="$out/bridge-server-gpu$gpu-trunk$gemms.log"
    python3 client/python/benchmarks/bridge_bench.py --server "127.0.0.1:$port" --paths native \
      --no-transfers --iters "$iters" --streams 4,1 --device cuda:0 --trunk-gemms "$gemms" \
      > "$log" 2>&1 || { cat "$log"; exit 1; }
    echo "server on GPU $gpu, trainer on GPU 0, trunk of $gemms GEMMs:"
    grep -E '^(RemoteLMHead|local head|trunk alone)' "$log" | cut -c1-60
  done
  stop_server
done

LOSSHEAD_TEST_NATIVE=1 LOSSHEAD_SERVER_BIN="$bundle/bin/losshead-server" \
  python3 -m pytest -q -p no:cacheprovider client/python/tests/test_same_node.py \
  > "$out/test-same-node.log" 2>&1 || { tail -40 "$out/test-same-node.log"; exit 1; }
# The summary line, not a warning torch prints as the process exits.
echo "test_same_node.py: $(grep -E '[0-9]+ (passed|failed)' "$out/test-same-node.log" | tail -1)"
echo "logs: $out"
