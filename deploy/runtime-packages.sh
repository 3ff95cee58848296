#!/usr/bin/env bash
# Prints "package=version" for every Debian package that ships a shared library the given binaries
# load, so the runtime image installs exactly the builder's libraries and nothing else.
# libcuda.so.1 belongs to the driver, which the NVIDIA container runtime mounts at run time.
# Fails when a library is missing or belongs to no package (it would be missing at run time).
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
for binary in "$@"; do
  ldd "$binary" >/dev/null || { echo "runtime-packages: $binary is not a dynamic executable" >&2; exit 1; }
done
status=0
declare -A packages=()
while read -r soname path; do
  case "$soname" in libcuda.so.*|libnvidia-*) continue ;; esac
  if [ "$path" = "not" ]; then
    echo "runtime-packages: $soname not found" >&2; status=1; continue
  fi
  # Debian 12 merges /lib into /usr/lib: dpkg knows each file under one of the two spellings.
  owner=""
  for candidate in "$path" "/usr$path" "${path#/usr}" "$(readlink -f "$path")"; do
    owner=$(dpkg-query -S "$candidate" 2>/dev/null | head -n1 | cut -d: -f1) && [ -n "$owner" ] && break
  done
  if [ -z "$owner" ]; then
    echo "runtime-packages: $path ($soname) belongs to no package" >&2; status=1; continue
  fi
  packages[$owner]=1
done < <(ldd "$@" | awk '$2 == "=>" && $3 != "" {print $1, $3}' | sort -u)
for p in "${!packages[@]}"; do
  dpkg-query -W -f='${Package}=${Version}\n' "$p"
done | sort
exit $status
