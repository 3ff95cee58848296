#!/usr/bin/env bash
# Installs what losshead needs to build and test on Debian 12 (run as root, or with sudo present).
# The CUDA toolkit is optional: with /usr/local/cuda/bin/nvcc the CUDA backend is built too.
#
#   scripts/install-deps.sh               everything the README's commands need (build + tests)
#   scripts/install-deps.sh --build-only  what building and running losshead-server and the
#                                         losshead CLI need (scripts/run-demo.sh, the image's
#                                         builder)
#
# Prints one line saying how many packages it installs and how much it downloads, or that nothing
# is missing.
set -euo pipefail
# Exactly what configuring with LOSSHEAD_BUILD_TESTS=OFF and building every non-test target needs;
# the dependencies of these (gRPC's c-ares, re2, zlib; gcc's binutils) come with them.
build_packages=(
  g++ cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc  # gRPC; grpc_cpp_plugin generates the stubs from proto/
  libprotobuf-dev protobuf-compiler  # protoc and the messages
  libabsl-dev  # Status, flags, containers, synchronization
  prometheus-cpp-dev  # the server's /metrics (server/observability)
  libopenblas-dev  # the CPU backend's GEMMs (kernels/cpu)
  libssl-dev  # the server's SHA-256, constant-time compares and PEM checks (server/security)
  libxxhash-dev  # the server's fingerprints of remembered micro-batches
)
test_packages=(
  libgtest-dev libgmock-dev  # LOSSHEAD_BUILD_TESTS=ON: find_package(GTest) at configure time
  prometheus  # prometheus + promtool: tests/deploy checks the scrape config, rules and live metrics
  openssl  # the CLI: tests/security makes a throwaway CA, server and client certificates
  clang libclang-rt-14-dev  # scripts/run-fuzz.sh: libFuzzer with ASan + UBSan
  llvm  # llvm-symbolizer: sanitizer reports (and LSan's suppressions) need symbolised stacks
  # Python: tests/deploy's checks, and the Python client's suite (client/python/run_tests.sh
  # installs the package into a venv that sees these system packages; no other index is needed).
  python3 python3-venv python3-pip python3-setuptools python3-wheel
  python3-pytest python3-numpy python3-torch python3-grpcio python3-protobuf
  python3-yaml  # tests/deploy/manifests_test.py parses the compose file and the manifests
  # A developer's machine: make and dpkg-dev, git, and curl for the README's `curl .../metrics`.
  build-essential git curl ca-certificates
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
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
$sudo_cmd apt-get update -qq
# What apt will do, so that the wait is explained: the packages with their dependencies, and the
# bytes still to download (--print-uris lists only what is not in apt's cache).
count=$($sudo_cmd apt-get install -s --no-install-recommends "${missing[@]}" |
  grep -c '^Inst ' || true)
megabytes=$($sudo_cmd apt-get install --print-uris -qq --no-install-recommends "${missing[@]}" |
  awk '{bytes += $3} END {printf "%.0f", bytes / 1e6}')
echo "install-deps: installing ${#missing[@]} packages (${count} with their dependencies," \
  "${megabytes} MB to download): ${missing[*]}"
$sudo_cmd env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
