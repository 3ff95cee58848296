#!/usr/bin/env bash
# Runs the README's two commands (scripts/run-demo.sh, then scripts/run-tests.sh) in a fresh
# container made from a minimal Debian 12 (scripts/make-debian-base.sh): nothing preinstalled, so
# an install step missing from scripts/install-deps.sh fails here instead of on a user's machine,
# and the demo's time is what a newcomer waits. Run it before every submission that touches install
# or build files; it takes 30-60 minutes on two cores (every package installed, two builds, every
# test), the demo alone about 7 (README.md, "Set up").
#
#   scripts/check-fresh-machine.sh              both commands, in the order of the README
#   scripts/check-fresh-machine.sh --demo-only  scripts/run-demo.sh alone
#
# Prints each command's seconds on its own line ("check-fresh-machine: run-demo.sh: passed in N s").
# The working tree is used as a clean checkout would have it.
# Environment: BASE_IMAGE (default losshead/debian:12, made if missing), LOG (default
# build-fresh/fresh-machine.log). Needs a running Docker engine; containers use the host network.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
  --demo-only) mode=demo ;;
  "") ;;
  *) echo "usage: $0 [--demo-only]" >&2; exit 2 ;;
esac
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

# Each command's outcome and seconds as a line of its own ("== run-demo.sh: passed in N s"), read
# back from the log below.
start=$(date +%s)
status=0
docker run --rm -i --network host -e CI=true -e LOSSHEAD_PORT=50951 -e LOSSHEAD_METRICS_PORT=9964 "$image" bash -euo pipefail -c '
  mkdir /src && tar -xf - -C /src && cd /src
  timed() {
    local t0=$(date +%s) rc=0
    echo "== bash scripts/$1"
    bash "scripts/$1" || rc=$?
    local outcome=passed
    [ $rc -eq 0 ] || outcome="FAILED (exit code $rc)"
    echo "== $1: $outcome in $(( $(date +%s) - t0 )) s"
    return $rc
  }
  timed run-demo.sh
  [ "$1" = demo ] || timed run-tests.sh
' _ "$mode" < "$context" > "$log" 2>&1 || status=$?
elapsed=$(( $(date +%s) - start ))
tail -n 25 "$log"
grep -E '^== run-[a-z]+\.sh: ' "$log" | sed 's/^== /check-fresh-machine: /' || true
what="both README commands"
[ "$mode" = demo ] && what="scripts/run-demo.sh"
if [ $status -eq 0 ]; then
  echo "check-fresh-machine: $what passed in a fresh $image container (${elapsed}s; log: $log)"
else
  echo "check-fresh-machine: FAILED with exit code $status after ${elapsed}s (log: $log)" >&2
fi
exit $status
