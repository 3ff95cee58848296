#!/usr/bin/env bash
# A head replicated over the GPUs of one host by one server process against the same head over
# two server processes joined in a group (docs/multi-process.md), in one run on one host:
#
#   one process,  2 GPUs   (--devices=0,1)           the baseline
#   one process,  all GPUs (--devices=all)           what one process does with the host
#   two processes, 2 GPUs each (0,1 and 2,3), one group
#
# (with SHARDED=1, the head sharded over the same GPUs as well: --shards, and --across_processes
# for the group) each with the C++ `losshead bench` (random head N(0, 0.02), V = 128256, D = 4096, bf16,
# 8192-token micro-batches, STREAMS_PER_GPU streams per GPU). The bench talks to process 0; each
# stream's client id has its home process (FNV-1a of the id mod 2), and the client follows the
# redirect there, so the streams spread over both processes as a fleet's trainers would. A
# group's collectives go over NCCL (NCCL_NVLS_ENABLE=0) and its cut over the host collective.
#
#   scripts/run-process-group-bench.sh BUNDLE_DIR [OUT_DIR]
#
# METRICS=1 also notes, after each bench, every process's mean phases per micro-batch and its
# devices' busy time (losshead_step_phase_duration_seconds, losshead_device_busy_seconds_total;
# the whole scrape in OUT_DIR/metrics-*.txt): where a row's time goes.
#
# BUNDLE_DIR holds bin/losshead-server, bin/losshead and lib/ (scripts/run-gpu-e2e-bench.sh);
# libnccl.so.2 must be on LD_LIBRARY_PATH. Needs 4 GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$(cd "$1" && pwd) || exit 1
out=${2:-$(mktemp -d)}
mkdir -p "$out"
seconds=${BENCH_SECONDS:-10}
per_gpu=${STREAMS_PER_GPU:-4}
rounds=${ROUNDS:-2}
sharded=${SHARDED:-}  # non-empty: the sharded rows too (SHARDED_STREAMS streams each)
sharded_streams=${SHARDED_STREAMS:-8}
only_sharded=${ONLY_SHARDED:-}  # non-empty: the sharded rows alone
metrics=${METRICS:-}  # non-empty: each process's phases and device busy time after each bench
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader \
  | tee "$out/gpu.txt"
[ "$(wc -l < "$out/gpu.txt")" -ge 4 ] || { echo "needs 4 GPUs"; exit 1; }
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
servers=()
stop_servers() {
  for pid in "${servers[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${servers[@]}"; do wait "$pid" 2>/dev/null; done
  servers=()
}
trap stop_servers EXIT

# start NAME PORT DEVICES [GROUP FLAGS...]: a server in the background, waited for.
start() {
  local name=$1 port=$2 devices=$3
  shift 3
  "$bundle/bin/losshead-server" --listen="127.0.0.1:$port" --backend=cuda --devices="$devices" \
    --metrics_listen="127.0.0.1:$((port + 1000))" "$@" > "$out/server-$name.log" 2>&1 &
  servers+=($!)
}
wait_healthy() {
  local port=$1
  for _ in $(seq 1 600); do
    "$bundle/bin/losshead" health --server="127.0.0.1:$port" > /dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}
# The process at `port`'s mean stage, queue, compute and finish phase per micro-batch and its
# devices' busy seconds, from its metrics endpoint (at port + 1000): means over every head it ran
# since it started (the benches keep theirs for this).
scrape() {
  local name=$1 port=$2 file="$out/metrics-${1//[^a-z0-9]/_}-$2.txt"
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(
    'http://127.0.0.1:$((port + 1000))/metrics', timeout=10).read().decode())" > "$file" 2>&1 || return
  note "  process :$port: $(awk '
    /^losshead_step_phase_duration_seconds_(sum|count)/ {
      match($0, /phase="[a-z]+"/); ph = substr($0, RSTART + 7, RLENGTH - 8)
      if ($0 ~ /_sum/) sum[ph] += $NF; else count[ph] += $NF }
    /^losshead_device_busy_seconds_total/ { match($0, /device="[^"]*"/)
      busy = busy " " substr($0, RSTART + 8, RLENGTH - 9) "=" sprintf("%.1fs", $NF) }
    END { for (ph in count) if (ph == "queue" || ph == "compute" || ph == "stage" || ph == "finish")
            printf "%s %.2f ms, ", ph, 1000 * sum[ph] / (count[ph] ? count[ph] : 1)
          printf "%d micro-batches; busy%s", count["compute"], busy }' "$file")"
}
# bench NAME PORT STREAMS PLACEMENT-FLAGS...
bench() {
  local name=$1 port=$2 streams=$3 log="$out/bench-${1//[^a-z0-9]/_}.log"
  shift 3
  local ports=("$port")
  [[ " $* " == *" --across_processes "* || "$name" == *"two processes"* ]] && ports=(50071 50072)
  if "$bundle/bin/losshead" bench --server="127.0.0.1:$port" --hidden_size=4096 \
    --vocab_size=128256 --chunk_tokens=8192 --streams="$streams" --seconds="$seconds" \
    ${metrics:+--keep_head} "$@" \
    > "$log" 2>&1; then
    note "$name, $streams streams: $(grep -E 'tokens/s|p50' "$log" | tr '\n' ' ')"
  else
    note "$name, $streams streams: FAILED: $(tail -3 "$log" | tr '\n' ' ')"
  fi
  if [ -n "$metrics" ]; then
    for p in "${ports[@]}"; do scrape "$name" "$p"; done
  fi
}

for round in $(seq 1 "$rounds"); do
  note "== round $round"
  start one-2 50071 0,1
  wait_healthy 50071 || note "one process on 2 GPUs did not start: $(tail -2 "$out/server-one-2.log")"
  [ -z "$only_sharded" ] && bench "round $round: one process, 2 GPUs" 50071 $((2 * per_gpu)) --replicas=2
  [ -n "$sharded" ] && bench "round $round: sharded, one process, 2 GPUs" 50071 "$sharded_streams" --shards=2
  stop_servers

  start one-4 50071 all
  wait_healthy 50071 || note "one process on 4 GPUs did not start: $(tail -2 "$out/server-one-4.log")"
  [ -z "$only_sharded" ] && bench "round $round: one process, 4 GPUs" 50071 $((4 * per_gpu)) --replicas=4
  [ -n "$sharded" ] && bench "round $round: sharded, one process, 4 GPUs" 50071 "$sharded_streams" --shards=4
  stop_servers

  peers=127.0.0.1:7171,127.0.0.1:7172
  start group-0 50071 0,1 --group_peers=$peers --group_rank=0
  start group-1 50072 2,3 --group_peers=$peers --group_rank=1
  if wait_healthy 50071 && wait_healthy 50072; then
    [ -z "$only_sharded" ] && bench "round $round: two processes x 2 GPUs" 50071 $((4 * per_gpu)) --replicas=2
    [ -n "$sharded" ] && bench "round $round: sharded, two processes x 2 GPUs" 50071 \
      "$sharded_streams" --shards=2 --across_processes
  else
    note "the group did not start: $(tail -2 "$out/server-group-0.log") $(tail -2 "$out/server-group-1.log")"
  fi
  stop_servers
done
