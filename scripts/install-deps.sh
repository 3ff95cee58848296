#!/usr/bin/env bash
# Installs what losshead needs to build and test on Debian 12 (run as root, or with sudo present).
# The CUDA toolkit is optional: with /usr/local/cuda/bin/nvcc the CUDA backend is built too.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libopenblas-dev
  prometheus  # prometheus + promtool: tests/deploy checks the scrape config, rules and live metrics
  openssl  # the CLI: tests/security makes a throwaway CA, server and client certificates
  clang libclang-rt-14-dev  # scripts/run-fuzz.sh: libFuzzer with ASan + UBSan
)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
