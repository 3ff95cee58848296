#!/usr/bin/env bash
# Makes a Debian 12 base image locally, for machines that reach Debian's package mirror but no
# image registry: debootstrap's minbase variant (what the registry's debian:12 holds: essential
# packages and apt, nothing else) imported with `docker import`.
#
#   scripts/make-debian-base.sh [TAG]        (default losshead/debian:12; a no-op if it exists)
#
# Then build with it: docker build --build-arg DEBIAN_IMAGE=losshead/debian:12 \
#                       --build-arg RUNTIME_IMAGE=losshead/debian:12 ...
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian). Needs root, debootstrap and a
# running Docker engine.
set -euo pipefail
tag=${1:-losshead/debian:12}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "make-debian-base: $tag exists"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "make-debian-base: needs debootstrap (apt-get install debootstrap)" >&2
  exit 1
}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
chmod 755 "$root"  # it becomes the image's /, which every user must be able to traverse
debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
# What the registry's image does too: no package lists or caches in the layer, and apt told not to
# keep downloaded packages.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
echo 'APT::Keep-Downloaded-Packages "false";' > "$root/etc/apt/apt.conf.d/docker-clean"
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' - "$tag" >/dev/null
echo "make-debian-base: $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
