#!/bin/sh
# Makes the local base image kvserve-base:bookworm without a registry: a minimal Debian bookworm (debootstrap)
# with python3.11 (and its headers), python3-venv and g++, imported into podman. Skipped when the image already exists (CI caches
# it on the machine). Usage: image/base.sh [TAG]
set -eu
tag="${1:-kvserve-base:bookworm}"
podman=${PODMAN:-podman}
if $podman image exists "$tag"; then exit 0; fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-dev,python3-venv,g++ bookworm "$root" http://deb.debian.org/debian >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | $podman import --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "image/base.sh: made $tag"
