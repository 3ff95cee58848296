#!/usr/bin/env bash
# Runs the README's two commands (scripts/run-demo.sh, then scripts/run-tests.sh) in a fresh
# container made from a minimal Debian 12 (scripts/make-debian-base.sh): nothing preinstalled, so
# an install step missing from scripts/install-deps.sh fails here instead of on a user's machine.
# Run it before every submission that touches install or build files; it takes 30-60 minutes on
# two cores (every package installed, two builds, every test).
#
#   scripts/check-fresh-machine.sh            the working tree as a clean checkout would have it
#
# Environment: BASE_IMAGE (default losshead/debian:12, made if missing), LOG (default
# build-fresh/fresh-machine.log). Needs a running Docker engine; containers use the host network.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${BASE_IMAGE:-losshead/debian:12}
log=${LOG:-build-fresh/fresh-machine.log}
mkdir -p "$(dirname "$log")"
scripts/make-debian-base.sh "$image"

# The tracked and the new (not ignored) files: what a clean checkout of this tree would hold.
context=$(mktemp)
trap 'rm -f "$context"' EXIT
git ls-files -z --cached --others --exclude-standard |
  xargs -0 -I{} sh -c '[ -e "{}" ] && printf "%s\0" "{}"' |
  tar --null -T - -cf "$context"

start=$(date +%s)
status=0
docker run --rm -i --network host -e CI=true -e LOSSHEAD_PORT=50951 -e LOSSHEAD_METRICS_PORT=9964 "$image" bash -euo pipefail -c '
  mkdir /src && tar -xf - -C /src && cd /src
  echo "== bash scripts/run-demo.sh"
  bash scripts/run-demo.sh
  echo "== bash scripts/run-tests.sh"
  bash scripts/run-tests.sh
' < "$context" > "$log" 2>&1 || status=$?
elapsed=$(( $(date +%s) - start ))
tail -n 25 "$log"
if [ $status -eq 0 ]; then
  echo "check-fresh-machine: both README commands passed in a fresh $image container (${elapsed}s; log: $log)"
else
  echo "check-fresh-machine: FAILED with exit code $status after ${elapsed}s (log: $log)" >&2
fi
exit $status
