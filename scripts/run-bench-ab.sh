#!/usr/bin/env bash
# Server throughput of two builds in one run on the same GPU: `losshead bench` (random 128256 x
# 4096 bf16 head, 8192-token micro-batches) at 1, 4 and 8 streams against bundle A's server, then
# B's, then A's and B's again, so that drift of the card shows as the spread within A and within B.
#
#   scripts/run-bench-ab.sh BUNDLE_A BUNDLE_B [OUT_DIR]
#
# Each BUNDLE holds bin/losshead-server, bin/losshead and lib/ (see ../shared/GPU.md). The client
# is A's in every row, so only the server differs. Prints one line per row and a table last.
set -euo pipefail
a=$(cd "$1" && pwd)
b=$(cd "$2" && pwd)
out=${3:-$(mktemp -d)}
mkdir -p "$out"
port=${LOSSHEAD_PORT:-50051}
seconds=${BENCH_SECONDS:-10}
stream_counts=${BENCH_STREAMS:-1 4 8}  # e.g. BENCH_STREAMS=8 for one row per server
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"

run_server() {  # label, bundle
  local label=$1 bundle=$2 server
  LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$bundle/bin/losshead-server" \
    --listen="127.0.0.1:$port" --metrics_listen= --backend=cuda > "$out/server-$label.log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do
    LD_LIBRARY_PATH="$a/lib:/usr/local/cuda/lib64" "$a/bin/losshead" health \
      --server="127.0.0.1:$port" >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { cat "$out/server-$label.log"; exit 1; }
    sleep 0.2
  done
  for streams in $stream_counts; do
    # The old flag spellings (--n, --d, --v): the client is BASE's, which may predate
    # --chunk_tokens, --hidden_size and --vocab_size; newer clients accept them as deprecated.
    LD_LIBRARY_PATH="$a/lib:/usr/local/cuda/lib64" "$a/bin/losshead" bench \
      --server="127.0.0.1:$port" --n=8192 --d=4096 --v=128256 --streams=$streams \
      --seconds="$seconds" > "$out/bench-$label-s$streams.log" 2>&1 ||
      { cat "$out/bench-$label-s$streams.log"; exit 1; }
    local rate
    # The run's rate, then its steady state.
    rate=$(grep -oE '[0-9.]+ tokens/s' "$out/bench-$label-s$streams.log" | awk '{print $1}' |
      paste -sd' ')
    echo "$label streams=$streams $rate" | tee -a "$out/rows.txt"
  done
  kill -TERM $server
  wait $server 2>/dev/null || true
}

run_server A1 "$a"
run_server B1 "$b"
run_server A2 "$a"
run_server B2 "$b"
echo "== tokens/s over each row (A: $a, B: $b)"
for streams in $stream_counts; do
  printf 'streams=%s' "$streams"
  for label in A1 A2 B1 B2; do
    printf ' %s=%s' "$label" "$(grep "^$label streams=$streams " "$out/rows.txt" | awk '{print $3}')"
  done
  echo
done
