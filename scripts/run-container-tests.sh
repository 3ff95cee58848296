#!/usr/bin/env bash
# Builds the CPU variant of the server image and a Prometheus image on a Debian 12 base made
# locally (no image registry needed), then runs the live monitoring check against them as
# containers on the host network: health, a `losshead bench` and `losshead demo` from the host
# through the container's ports, the metrics scraped by the containerised Prometheus and every
# dashboard query answered, the server running as its unprivileged user, and a drain on SIGTERM.
# Then the TLS health check (tests/deploy/health_tls_test.py): a server container with the TLS
# flags and health environment of deploy/compose/docker-compose.remote.yml becomes healthy by the
# image's own HEALTHCHECK (and unhealthy without the CA). Then the restart check
# (tests/deploy/restart_test.py): compose brings up the compose file's server service with its
# checkpoint volume (the CPU override tests/deploy/compose.cpu-test.yml; Prometheus and Grafana are
# not started: their images come from a registry), it is killed mid-training (server-side AdamW)
# and comes back on the same volume with W, the optimizer state and the version of its last
# checkpoint.
#
#   scripts/run-container-tests.sh        (after scripts/build.sh: the host's `losshead` CLI is used)
#
# Starts a Docker engine when none answers (Debian's docker.io: vfs storage, no bridge, no
# iptables; containers use --network host and talk over 127.0.0.1 only). Compose: `docker compose`
# (v2) when present, else `docker-compose` (v1; Debian's package is installed when neither is).
# Needs root and the openssl CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
base=${BASE_IMAGE:-losshead/debian:12}
server_image=${SERVER_IMAGE:-losshead-server:test-cpu}
prometheus_image=${PROMETHEUS_IMAGE:-losshead/prometheus:debian}

if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || {
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends \
      docker.io debootstrap
  }
  mkdir -p "$build_dir"
  dockerd --storage-driver=vfs --bridge=none --iptables=false --ip6tables=false \
    > "$build_dir/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null || { cat "$build_dir/dockerd.log"; exit 1; }
fi
command -v debootstrap >/dev/null || apt-get install -y -qq --no-install-recommends debootstrap
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  apt-get install -y -qq --no-install-recommends docker-compose
fi

scripts/make-debian-base.sh "$base"
start=$(date +%s)
docker build --network host -q -f deploy/Dockerfile --build-arg BACKEND=cpu \
  --build-arg DEBIAN_IMAGE="$base" --build-arg RUNTIME_IMAGE="$base" -t "$server_image" . \
  > "$build_dir/server-image.log" 2>&1 || { tail -n 40 "$build_dir/server-image.log"; exit 1; }
docker build --network host -q -f deploy/prometheus/Dockerfile --build-arg DEBIAN_IMAGE="$base" \
  -t "$prometheus_image" deploy/prometheus > "$build_dir/prometheus-image.log" 2>&1 ||
  { tail -n 40 "$build_dir/prometheus-image.log"; exit 1; }
echo "run-container-tests: images $server_image and $prometheus_image built in $(( $(date +%s) - start ))s"

python3 tests/deploy/live_test.py . "$build_dir/server/losshead-server" "$build_dir/client/losshead" \
  --server-image "$server_image" --prometheus-image "$prometheus_image"
# The image's health check with TLS on (the compose remote override's flags and environment).
python3 tests/deploy/health_tls_test.py . "$build_dir/client/losshead" \
  --server-image "$server_image"
# The compose file's server on its checkpoint volume, driven by compose: killed mid-training,
# restored, nothing lost but what came after the last checkpoint, and the client told which.
python3 tests/deploy/restart_test.py . "$build_dir/client/losshead" --server-image "$server_image"
