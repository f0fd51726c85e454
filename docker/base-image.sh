#!/usr/bin/env bash
# Make a `python:3.11-slim-bookworm`-compatible base image from Debian's own packages, for hosts that
# cannot reach an image registry (air-gapped clusters). It builds a bookworm minbase root filesystem
# with mmdebstrap, adds Debian's Python 3.11 (interpreter, venv, headers for compiling extensions),
# links `python`/`python3` into /usr/local/bin as the official image has them, and imports the tar
# under the name the Dockerfiles' FROM lines use, so `podman build --pull=never` resolves it locally.
#
#   docker/base-image.sh                        # mirrors: deb.debian.org (or MIRROR, see below)
#   MIRROR=http://apt.internal/debian SECURITY_MIRROR=http://apt.internal/debian-security docker/base-image.sh
#
# Needs root (or a working unshare mode), mmdebstrap and podman or docker.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
ENGINE=${ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$ENGINE" ] || { echo "base-image.sh: neither podman nor docker is installed" >&2; exit 2; }
# podman resolves a short FROM name to localhost/NAME first; docker to docker.io/library/NAME, which a
# local tag of that name stands for (tried with podman only)
if [ "$(basename "$ENGINE")" = podman ]; then default_tag=localhost/python:3.11-slim-bookworm
else default_tag=python:3.11-slim-bookworm; fi
TAG=${BASE_TAG:-$default_tag}
command -v mmdebstrap >/dev/null || { echo "base-image.sh: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 2; }
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}

# What python:3.11-slim-bookworm has: Python with pip and venv, its headers, CA certificates, netbase, tzdata.
packages=python3,python3-venv,python3-pip,python3-dev,ca-certificates,netbase,tzdata
tarball=$(mktemp --suffix=.tar)
trap 'rm -f "$tarball"' EXIT

mmdebstrap --variant=minbase --format=tar --include="$packages" \
    --customize-hook='ln -sf /usr/bin/python3 "$1/usr/local/bin/python"' \
    --customize-hook='ln -sf /usr/bin/python3 "$1/usr/local/bin/python3"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/*.bin "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
    bookworm "$tarball" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" "deb $SECURITY_MIRROR bookworm-security main"

"$ENGINE" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$tarball" "$TAG"
echo "base image: $TAG"
