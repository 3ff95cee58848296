#!/usr/bin/env bash
# Installs what losshead needs to build and test on Debian 12 (run as root, or with sudo present).
# The CUDA toolkit is optional: with /usr/local/cuda/bin/nvcc the CUDA backend is built too.
#
#   scripts/install-deps.sh               everything the README's commands need (build + tests)
#   scripts/install-deps.sh --build-only  what building the binaries needs (the image's builder)
set -euo pipefail
build_packages=(
  build-essential cmake ninja-build pkg-config git curl ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libopenblas-dev libssl-dev
  libxxhash-dev  # the server's fingerprints of remembered micro-batches
)
test_packages=(
  libgtest-dev libgmock-dev
  prometheus  # prometheus + promtool: tests/deploy checks the scrape config, rules and live metrics
  openssl  # the CLI: tests/security makes a throwaway CA, server and client certificates
  clang libclang-rt-14-dev  # scripts/run-fuzz.sh: libFuzzer with ASan + UBSan
  llvm  # llvm-symbolizer: sanitizer reports (and LSan's suppressions) need symbolised stacks
  # Python: tests/deploy's checks, and the Python client's suite (client/python/run_tests.sh
  # installs the package into a venv that sees these system packages; no other index is needed).
  python3 python3-venv python3-pip python3-setuptools python3-wheel
  python3-pytest python3-numpy python3-torch python3-grpcio python3-protobuf
  python3-yaml  # tests/deploy/manifests_test.py parses the compose file and the manifests
)
packages=("${build_packages[@]}")
case "${1:-}" in
  --build-only) ;;
  "") packages+=("${test_packages[@]}") ;;
  *) echo "usage: $0 [--build-only]" >&2; exit 2 ;;
esac
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
