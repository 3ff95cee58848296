#!/usr/bin/env bash
# A head on one GPU, replicated and sharded over the GPUs of the host, in one run: one
# losshead-server with --devices=all, and the C++ `losshead bench` (random head, V = 128256,
# D = 4096, 8192-token micro-batches). It runs:
# - 1, 2, 4, ... replicas with 4 and 8 streams per replica (on one H100 host the server's steady
#   state holds from 4 to 32 streams; a short bench's whole-run figure falls past 8 with the
#   pipelines' fill and drain: BENCHMARKS.md), with each GPU's peak memory (nvidia-smi) and busy
#   seconds (the server's losshead_device_busy_seconds_total: replicas should be about equally
#   busy), and each placement's device memory per GPU (HeadInfo);
# - the sharded head through the server (one stream, k = 1, 2, 4, ... shards against one GPU; then
#   8 streams for each k) and
#   `losshead_shard_bench` (the sharded micro-batch's latency against the unsharded call, and
#   1280-token micro-batches with and without deferred dW on the shards);
# - a head too large for one GPU (D = 16384, V = 2,000,000 where the GPUs hold it: 183 GiB of W
#   and dW; fewer rows where they do not, still past one GPU), refused on one and served sharded
#   over every GPU, its sharded micro-batch timed with random weights.
# A part that fails is reported in the summary and the rest still runs: one lease of a multi-GPU
# machine should give every figure it can.
#
#   scripts/run-multi-gpu-bench.sh BUNDLE_DIR [OUT_DIR]
#
# BUNDLE_DIR holds bin/losshead-server, bin/losshead, bin/losshead_shard_bench and lib/ (see
# scripts/run-gpu-e2e-bench.sh); libnccl.so.2 must be on LD_LIBRARY_PATH. NVLink multicast stays
# off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$(cd "$1" && pwd) || exit 1
out=${2:-$(mktemp -d)}
mkdir -p "$out"
port=${LOSSHEAD_PORT:-50061}
metrics_port=${LOSSHEAD_METRICS_PORT:-9561}
seconds=${BENCH_SECONDS:-15}
streams_per_replica=${STREAMS_PER_REPLICA:-4 8}
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader \
  | tee "$out/gpu.txt"
gpus=$(wc -l < "$out/gpu.txt")

# --max_head_bytes: the wide head below (up to 183 GiB of W and dW) must meet the devices' memory,
# not the server's default 16 GiB limit per head.
"$bundle/bin/losshead-server" --listen="127.0.0.1:$port" \
  --metrics_listen="127.0.0.1:$metrics_port" --backend=cuda --max_head_bytes=$((1 << 40)) \
  --devices=all > "$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  "$bundle/bin/losshead" health --server="127.0.0.1:$port" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { cat "$out/server.log"; exit 1; }
  sleep 0.2
done
head -3 "$out/server.log"
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
# Each device's busy seconds so far, as "cuda:0=1.23 cuda:1=0.98" (the server's metrics).
busy() {
  python3 - "$metrics_port" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
print(" ".join(f"{d}={float(v):.3f}" for d, v in
               re.findall(r'^losshead_device_busy_seconds_total\{device="([^"]+)"\} (\S+)$', text, re.M)))
PY
}
# Seconds each device was busy between two busy() readings.
busy_between() {
  python3 - "$1" "$2" <<'PY'
import sys
before = dict(kv.split("=") for kv in sys.argv[1].split())
after = dict(kv.split("=") for kv in sys.argv[2].split())
print(" ".join(f"{d} {float(after[d]) - float(before.get(d, 0)):.2f} s" for d in sorted(after)))
PY
}

replicas=1
while [ "$replicas" -le "$gpus" ]; do
  for per in $streams_per_replica; do
    streams=$((per * replicas))
    log="$out/bench-r$replicas-s$streams.log"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader -lms 1000 \
      > "$out/smi-r$replicas-s$streams.csv" &
    smi=$!
    before=$(busy)
    if ! "$bundle/bin/losshead" bench --server="127.0.0.1:$port" --hidden_size=4096 \
      --vocab_size=128256 --chunk_tokens=8192 --replicas="$replicas" --streams="$streams" \
      --seconds="$seconds" > "$log" 2>&1; then
      kill $smi
      note "replicas $replicas, $streams streams: FAILED: $(tail -3 "$log" | tr '\n' ' ')"
      continue
    fi
    kill $smi
    peak=$(awk -F', ' '{v = $2 + 0; if (v > m[$1]) m[$1] = v}
                       END {for (g in m) printf "gpu%s %s MiB; ", g, m[g]}' \
      "$out/smi-r$replicas-s$streams.csv")
    busy_seconds=$(busy_between "$before" "$(busy)")
    figures=$(grep -E 'tokens/s|p50|head bench' "$log" | tr '\n' ' ')
    note "replicas $replicas, $streams streams: $figures peak used: $peak" \
      "device busy over the bench (its check, ${seconds} s timed, the drain): $busy_seconds"
  done
  replicas=$((replicas * 2))
done

# What each device holds for a replicated head (W, dW; workspace once it has stepped).
"$bundle/bin/losshead" create --server="127.0.0.1:$port" --head=memory \
  --vocab_size=128256 --hidden_size=4096 --weight_dtype=bf16 --replicas=0 --init_std=0.02 2>&1 \
  | tee -a "$summary"
"$bundle/bin/losshead" delete --server="127.0.0.1:$port" --head=memory > /dev/null 2>&1

# Sharded through the server: one stream, so that the p50 is one micro-batch's latency with its
# transfers; k = 1 runs the shard sequence on one GPU, "single" is the unsharded placement.
for shards in single $(k=1; while [ "$k" -le "$gpus" ]; do echo $k; k=$((k * 2)); done); do
  flag=""; [ "$shards" = single ] || flag="--shards=$shards"
  log="$out/bench-sharded-$shards.log"
  if "$bundle/bin/losshead" bench --server="127.0.0.1:$port" --hidden_size=4096 \
    --vocab_size=128256 --chunk_tokens=8192 --streams=1 --seconds="$seconds" $flag \
    > "$log" 2>&1; then
    note "sharded $shards, 1 stream: $(grep -E 'tokens/s,|p50' "$log" | tr '\n' ' ')"
  else
    note "sharded $shards, 1 stream: FAILED: $(tail -3 "$log" | tr '\n' ' ')"
  fi
done

# Sharded through the server with 8 streams: the throughput of k shards, whose micro-batches run
# one at a time over every shard while the others' copies and wire transfers overlap them, and
# whose stashes fill and flush together.
k=1
while [ "$k" -le "$gpus" ]; do
  log="$out/bench-sharded-$k-s8.log"
  if "$bundle/bin/losshead" bench --server="127.0.0.1:$port" --hidden_size=4096 \
    --vocab_size=128256 --chunk_tokens=8192 --streams=8 --seconds="$seconds" --shards="$k" \
    > "$log" 2>&1; then
    note "sharded $k, 8 streams: $(grep -E 'tokens/s|p50' "$log" | tr '\n' ' ')"
  else
    note "sharded $k, 8 streams: FAILED: $(tail -3 "$log" | tr '\n' ' ')"
  fi
  k=$((k * 2))
done

# Sharded: one micro-batch's latency over 1, 2, 4, ... GPUs against the unsharded call.
counts=1
k=2
while [ "$k" -le "$gpus" ]; do counts="$counts,$k"; k=$((k * 2)); done
"$bundle/bin/losshead_shard_bench" --shards="$counts" --runs=10 2>&1 | tee -a "$summary" \
  || note "losshead_shard_bench --shards=$counts FAILED"
# The micro-batches a four-stream RemoteLMHead step sends (1280 tokens), 8 at a time: each shard
# adding to its dW as they run against deferred dW (a stash per shard, one flush per 8).
"$bundle/bin/losshead_shard_bench" --shards="$counts" --n=1280 --stash=8 --runs=8 2>&1 \
  | tee -a "$summary" || note "losshead_shard_bench --stash=8 FAILED"

# A head whose W and dW (V x 16384, bf16 + fp32: 6 bytes a weight) fit no single GPU: refused on
# one device, then created sharded over all of them with a random W (its creation timed: up to
# 33e9 weights drawn on every host core and copied in) and stepped through the server. V is
# 2,000,000 (183 GiB) where the GPUs hold 80 % of that, else the rows that fill 80 % of them.
smallest_mib=$(awk -F', ' '{m = $4 + 0; if (min == "" || m < min) min = m} END {print min}' \
  "$out/gpu.txt")
wide_v=$(( smallest_mib * 1048576 / 10 * 8 * gpus / (16384 * 6) ))
[ "$wide_v" -gt 2000000 ] && wide_v=2000000
wide() { "$bundle/bin/losshead" "$@" --server="127.0.0.1:$port" --head=wide --deadline_s=900; }
if wide create --vocab_size="$wide_v" --hidden_size=16384 --weight_dtype=bf16 \
  > "$out/wide-single.log" 2>&1; then
  note "a $wide_v x 16384 head fit one GPU"
  wide delete > /dev/null
else
  note "one GPU: $(tail -1 "$out/wide-single.log")"
fi
created=$(date +%s%N)
if wide create --vocab_size="$wide_v" --hidden_size=16384 --weight_dtype=bf16 --shards=0 \
  --init_std=0.02 > "$out/wide-sharded.log" 2>&1; then
  note "$(cat "$out/wide-sharded.log")"
  note "sharded create with normal init: $(( ($(date +%s%N) - created) / 1000000 )) ms"
  wide bench --hidden_size=16384 --vocab_size="$wide_v" --chunk_tokens=4096 --streams=2 \
    --seconds="$seconds" \
    > "$out/bench-wide.log" 2>&1 \
    || note "sharded bench of the wide head FAILED: $(tail -3 "$out/bench-wide.log" | tr '\n' ' ')"
  grep -E 'tokens/s|p50|check' "$out/bench-wide.log" | sed 's/^/sharded, random W: /' \
    | tee -a "$summary"
  wide delete > /dev/null 2>&1
else
  note "sharded create of the wide head FAILED: $(tail -3 "$out/wide-sharded.log" | tr '\n' ' ')"
fi

# The same shape's sharded micro-batch over every GPU with random W and H (the kernel sequence the
# server runs, without gRPC): the figure for BENCHMARKS.md. No unsharded reference: it fits no GPU.
"$bundle/bin/losshead_shard_bench" --v="$wide_v" --d=16384 --n=4096 --shards="$gpus" --runs=3 \
  --no_unsharded 2>&1 | tee -a "$summary" || note "losshead_shard_bench of the wide head FAILED"
